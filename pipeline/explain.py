"""``tracks explain``: the whole story of a run or attempt on one page of Markdown.

The same page is attached to the attempt's materialization in the Dagster UI. Sections, in
order: a summary, what was tried, the data snapshot (with every check verdict), where it ran
(and why the placement changed between attempts), the checkpoint lineage, the attempts and
retries (reason, decision, rule, budget left, who launched each and from which tags), evaluation,
promotion and the model's champions. Naming an attempt (``RUN#N``) highlights it and adds its
full receipt.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from pipeline import ids, redact
from pipeline.digests import short_digest
from pipeline.launch_facts import (
    contradicted_tags,
    fault_hooks_words,
    in_run_words,
    placement_change_sentence,
    trainer_source_words,
)
from pipeline.ledger import (
    AttemptRecord,
    CheckpointRecord,
    EvaluationRecord,
    Ledger,
    NoteRecord,
    PromotionRecord,
    RunRecord,
    SnapshotCheckRecord,
    UnknownSnapshotError,
)
from pipeline.ledger.notes import NOTE_SOURCE_OF_TRACKS
from pipeline.retry import TERMINATED_BEFORE_CONTINUING, config_changes
from pipeline.states import PromotionDecision, TerminationReason

_STATE_WORDS = {
    "committed": "committed",
    "superseded": "superseded",
    "corrupt": "corrupt (failed verification; never resumed from)",
    "writing": "never finished writing (no COMMITTED marker; ignored by readers)",
}


def parse_target(target: str) -> tuple[str, int | None]:
    """``RUN#3`` or ``RUN/3`` names one attempt, a bare run id the whole run; both validated
    (a run id holds neither '#' nor '/', so either one starts an attempt number)."""
    for sep in ("#", "/"):
        run_id, found, tail = target.rpartition(sep)
        if found:
            if not (tail.isascii() and tail.isdigit() and len(tail) <= 4):
                raise ids.InvalidIdError(
                    "target",
                    target,
                    "expected a run id, RUN#N or RUN/N (attempt N from 1 to 9999), "
                    "or a snapshot id",
                )
            return ids.run_id(run_id), ids.attempt_no(int(tail))
    return ids.run_id(target), None


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else "—"


def _or_dash(value: Any) -> str:
    return "—" if value is None or value == "" else str(value)


def _cell(value: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(_or_dash(value).split()).replace("|", "\\|")


def _short(path: str | None) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if path else "—"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def _duration(attempt: AttemptRecord) -> str:
    if attempt.ended_at is None:
        return "still running"
    seconds = (attempt.ended_at - attempt.started_at).total_seconds()
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _budget_words(left: Mapping[str, Any] | None) -> str:
    if not left or left.get("count") is None:
        return "—"
    gpu = left.get("gpu_seconds")
    gpu_text = "no GPU-seconds limit" if gpu is None else f"{float(gpu):.0f} GPU-s"
    return f"{left['count']} attempt(s), {gpu_text}"


def _decision_words(decision: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """(action, rule, budget left) for the attempts table."""
    if not decision:
        return "not decided", "—", "—"
    return (
        str(decision.get("action", "—")),
        f"`{decision.get('rule', '—')}`",
        _budget_words(decision.get("budget_left")),
    )


def _mark(attempt: AttemptRecord, focus: int | None) -> str:
    return f"**▶ {attempt.attempt_no}**" if attempt.attempt_no == focus else str(attempt.attempt_no)


_STATUS_WORDS = {
    "running": "an attempt is running, or the retry policy will start another",
    "trained": "training finished; not promoted (yet)",
    "promoted": "its checkpoint became the champion; the Promotion section says what since",
    "refused": "trained, but the promotion gate refused it",
    "failed": "stopped by the retry policy",
}


def _status_line(
    run: RunRecord, promotions: Sequence[PromotionRecord], last: AttemptRecord | None = None
) -> str:
    words = _STATUS_WORDS.get(run.status, "unknown status")
    if run.status == "failed" and last is not None and _stopped_by_a_person(last):
        words = "stopped because a person cancelled it"
    line = f"Status **{run.status}** ({words})"
    if run.status == "refused":
        refused = [p for p in promotions if p.decision == "refused"]  # newest first
        if refused:
            line += f" — **promotion refused**: {refused[0].reason}"
    return line


def _stopped_by_a_person(attempt: AttemptRecord) -> bool:
    """Whether ``attempt`` stopped its run because a person cancelled: its own ending, or a
    termination of its Dagster run found after it ended (a second decision, not the policy's)."""
    rule = (attempt.retry_decision or {}).get("rule")
    return (
        attempt.termination_reason == TerminationReason.CANCELLED
        or rule == TERMINATED_BEFORE_CONTINUING
    )


def _summary(
    run: RunRecord,
    attempts: Sequence[AttemptRecord],
    focus: AttemptRecord | None,
    promotions: Sequence[PromotionRecord] = (),
) -> list[str]:
    total_gpu = sum(a.gpu_seconds for a in attempts)
    total_cpu = sum(a.cpu_seconds for a in attempts)
    status = _status_line(run, promotions, attempts[-1] if attempts else None)
    out = [
        f"A **{run.model_family}** run for **{run.owner}** ({run.purpose}), created "
        f"{_when(run.created_at)}. {status}, after {len(attempts)} "
        f"attempt(s), {_hours(total_gpu)} GPU-hours and {_hours(total_cpu)} CPU-hours.",
    ]
    if attempts:
        last = attempts[-1]
        decided = last.retry_decision or {}
        ended = (
            f"ended **{last.termination_reason}**"
            if last.termination_reason
            else "is **still running**"
        )
        if not decided:
            then = ""
        elif decided.get("rule") == TERMINATED_BEFORE_CONTINUING:
            # A person's stop, recorded as a second decision: not the retry policy's.
            then = f"; then **{decided['action']}**: {decided.get('reason', '').rstrip('.')}"
        else:
            action, rule = decided["action"], decided["rule"]
            then = f" and the retry policy decided **{action}** (rule `{rule}`)"
        out.append(f"The latest attempt, {last.attempt_no}, {ended}{then}.")
    if focus is not None:
        out.append(
            f"This page highlights **attempt {focus.attempt_no}** (▶), which ended "
            f"**{focus.termination_reason or 'not yet'}**: "
            f"{focus.termination_detail or 'no detail recorded'}"
        )
    return [" ".join(out), ""]


def _what_was_tried(
    run: RunRecord, attempts: Sequence[AttemptRecord], focus: AttemptRecord | None
) -> list[str]:
    out = ["## What was tried", ""]
    if not attempts:
        return [*out, f"No attempt has started yet; run config sha256 `{run.config_sha256}`.", ""]
    shown = focus or attempts[-1]
    out += [
        f"The config of attempt {shown.attempt_no} (sha256 `{shown.config_sha256}`; "
        f"run config `{run.config_sha256}`, code {run.code_commit or 'unknown'}):",
        "",
        "```json",
        json.dumps(shown.config_snapshot, indent=2, sort_keys=True),
        "```",
        "",
        "What changed from the previous attempt:",
        "",
    ]
    out.append(f"- attempt {attempts[0].attempt_no}: the first attempt")
    for previous, current in pairwise(attempts):
        changes = config_changes(previous.config_snapshot or {}, current.config_snapshot or {})
        if current.code_commit != previous.code_commit:
            changes.append(f"code: {previous.code_commit!r} → {current.code_commit!r}")
        if current.container_digest != previous.container_digest:
            changes.append(
                f"container: {previous.container_digest[:24]} → {current.container_digest[:24]}"
            )
        said = "; ".join(f"`{c}`" for c in changes) if changes else "nothing (same config)"
        out.append(f"- attempt {current.attempt_no}: {said}")
    return [*out, ""]


def _data(
    run: RunRecord, attempts: Sequence[AttemptRecord], ledger: Ledger | None = None
) -> list[str]:
    out = ["## Data snapshot", "", f"Snapshot `{run.snapshot_id}`."]
    manifests: dict[str, list[int]] = defaultdict(list)
    for a in attempts:
        manifests[a.data_manifest_sha256].append(a.attempt_no)
    if len(manifests) == 1:
        ((sha, _numbers),) = manifests.items()
        out[-1] += f" Every attempt read manifest sha256 `{sha}`."
    elif manifests:
        out[-1] += " **The attempts did not all read the same bytes:**"
        out.append("")
        for sha, numbers in manifests.items():
            out.append(f"- manifest sha256 `{sha}`: attempt(s) {', '.join(map(str, numbers))}")
    if ledger is not None:
        out += ["", *_snapshot_facts(ledger, run.snapshot_id, run.run_id)]
    return [*out, ""]


def _snapshot_facts(ledger: Ledger, snapshot_id: str, run_id: str | None = None) -> list[str]:
    """The checks' verdict, and which other snapshots and runs hold byte-identical data."""
    try:
        snap = ledger.get_snapshot(snapshot_id)
    except UnknownSnapshotError:
        return ["(The ledger has no record of this snapshot's checks.)"]
    out = [f"Blocking checks: **{snap.verdict}** for manifest `{snap.manifest_sha256[:16]}`."]
    history = ledger.snapshot_check_history(snapshot_id)
    if history:
        out.append(f"Check history (oldest first): {_check_history_words(history)}.")
    twins = [
        s
        for s in (ledger.snapshots_with_content(snap.content_sha256) if snap.content_sha256 else [])
        if s.snapshot_id != snapshot_id
    ]
    for twin in twins:
        runs = [
            r.run_id for r in ledger.find_runs(snapshot_id=twin.snapshot_id) if r.run_id != run_id
        ]
        used = f"; run(s) {', '.join(runs)} trained on it" if runs else ""
        out.append(
            f"Its data is **byte-identical** to snapshot `{twin.snapshot_id}` (same file bytes "
            f"in the same order, other file names){used}."
        )
    return out


def _check_history_words(history: Sequence[SnapshotCheckRecord]) -> str:
    """One clause per check evaluation: when, which check, its verdict."""
    return "; ".join(
        f"{_when(c.checked_at)} {c.check_name} {'passed' if c.passed else 'failed'}"
        + ("" if c.blocking else " (warns)")
        for c in history
    )


def _check_history_table(history: Sequence[SnapshotCheckRecord], manifest: str) -> list[str]:
    out = [
        "| checked | check | result | manifest | Dagster run | what it found |",
        "|---|---|---|---|---|---|",
    ]
    for c in history:
        summary = (c.detail or {}).get("summary", "")
        other = "" if c.manifest_sha256 == manifest else " (another manifest)"
        out.append(
            f"| {_when(c.checked_at)} | {c.check_name} | "
            f"{'passed' if c.passed else '**failed**'} | `{c.manifest_sha256[:12]}`{other} | "
            f"{_cell(c.dagster_run_id)} | {_cell(summary)} |"
        )
    return out


def render_snapshot(ledger: Ledger, snapshot_id: str) -> str:
    """The page of a data snapshot: its verdict, every check's outcome, the runs that used it."""
    snap = ledger.get_snapshot(snapshot_id)
    out = [f"# Snapshot {snapshot_id}", ""]
    out.append(
        f"Registered {_when(snap.created_at)} with {_or_dash(snap.rows)} rows from "
        f"{_or_dash(snap.source)}; manifest sha256 `{snap.manifest_sha256}`."
    )
    out += [*_snapshot_facts(ledger, snapshot_id), "", "## Checks", ""]
    checks = ledger.snapshot_checks(snapshot_id, snap.manifest_sha256)
    if not checks:
        out.append("No check has run on this manifest.")
    else:
        out += ["| check | blocking | result | what it found |", "|---|---|---|---|"]
        for c in checks:
            summary = (c.detail or {}).get("summary", "")
            out.append(
                f"| {c.check_name} | {'yes' if c.blocking else 'no (warns)'} | "
                f"{'passed' if c.passed else '**failed**'} | {_cell(summary)} |"
            )
    history = ledger.snapshot_check_history(snapshot_id)
    out += ["", "## Check history", ""]
    if history:
        out.append(f"Every evaluation of a check on this snapshot, oldest first ({len(history)}):")
        out += ["", *_check_history_table(history, snap.manifest_sha256)]
    else:
        out.append("No check evaluation is recorded.")
    runs = ledger.find_runs(snapshot_id=snapshot_id)
    out += ["", "## Runs", ""]
    if runs:
        out += [f"- `{r.run_id}`: {r.status}" for r in runs]
    elif snap.verdict == "blocked":
        out.append("None: the blocking checks stopped this batch before any training.")
    else:
        out.append("None yet.")
    return "\n".join(out).rstrip() + "\n"


def _ranks_words(p: Mapping[str, Any]) -> str:
    """World size, its shape, and whether the restore resharded a checkpoint of another size."""
    world = int(p.get("world_size") or 1)
    words = str(world)
    if world > 1:
        words += f" ({p.get('ranks_per_node', world)} per node x {p.get('nodes', 1)} node(s))"
    if p.get("resharded_from"):
        words += f", resharded from {p['resharded_from']}"
    return words


def _placement(attempts: Sequence[AttemptRecord], focus: int | None) -> list[str]:
    out = ["## Where it ran", ""]
    if not attempts:
        return [*out, "Nowhere yet.", ""]
    out += [
        "| attempt | host | pod | node | accelerators | torch | CUDA | ranks | container |",
        "|---:|---|---|---|---|---|---|---|---|",
    ]
    for a in attempts:
        p = a.placement or {}
        accelerators = f"{p.get('accelerator_count', 0)} x {_or_dash(p.get('accelerator_type'))}"
        out.append(
            f"| {_mark(a, focus)} | {_cell(p.get('host'))} | {_cell(p.get('pod'))} | "
            f"{_cell(p.get('node'))} | {_cell(accelerators)} | {_cell(p.get('torch_version'))} | "
            f"{_cell(p.get('cuda_version') or 'none')} | {_cell(_ranks_words(p))} | "
            f"`{_cell(a.container_digest[:32])}` |"
        )
    changed = [
        sentence
        for previous, current in pairwise(attempts)
        if (sentence := placement_change_sentence(previous, current, attempts))
    ]
    if changed:
        out += ["", "The placement changed between attempts:", ""]
        out += [f"- {sentence}" for sentence in changed]
    return [*out, ""]


def _unresumed_words(a: AttemptRecord) -> str:
    """What an attempt with no checkpoint restored did, from its restored step: 0 is a fresh
    start the trainer reported; none means it never reported one."""
    if a.restored_step == 0:
        return "started fresh"
    if a.ended_at is None:
        return "has not reported a restore or a fresh start yet"
    return "ended before it restored a checkpoint or reported a fresh start"


def _lineage(
    attempts: Sequence[AttemptRecord], checkpoints: Sequence[CheckpointRecord], focus: int | None
) -> list[str]:
    out = ["## Checkpoint lineage", ""]
    by_path = {c.path: c for c in checkpoints}
    for a in attempts:
        made = [c for c in checkpoints if c.attempt_no == a.attempt_no]
        committed = [c for c in made if c.state != "writing" and c.committed_at is not None]
        if a.resumed_from_checkpoint:
            source = by_path.get(a.resumed_from_checkpoint)
            origin = (
                f" (step {source.step}, written by attempt {source.attempt_no}, now {source.state})"
                if source
                else " (not in the ledger)"
            )
            start = f"resumed from `{_short(a.resumed_from_checkpoint)}`{origin}"
        else:
            start = _unresumed_words(a)
        wrote = (
            "committed steps " + ", ".join(str(c.step) for c in committed)
            if committed
            else "committed no checkpoint"
        )
        lead = (
            f"**Attempt {a.attempt_no}** ▶" if a.attempt_no == focus else f"Attempt {a.attempt_no}"
        )
        out.append(f"- {lead} {start}; {wrote}.")
    if attempts:
        out.append("")
    if not checkpoints:
        return [*out, "No checkpoint was ever started.", ""]
    out += [
        "| step | attempt | state | why | parent | manifest sha256 | metrics |",
        "|---:|---:|---|---|---|---|---|",
    ]
    for c in checkpoints:
        metrics = ", ".join(
            f"{k}={v:.4g}"
            for k, v in sorted((c.metrics or {}).items())
            if isinstance(v, int | float)
        )
        out.append(
            f"| {c.step} | {c.attempt_no} | {_cell(_STATE_WORDS.get(c.state, c.state))} | "
            f"{_cell(c.state_detail)} | {_cell(_short(c.parent_path))} | "
            f"`{(c.manifest_sha256 or '—')[:16]}` | {_cell(metrics)} |"
        )
    return [*out, ""]


def _steps_words(a: AttemptRecord, checkpoints: Sequence[CheckpointRecord]) -> str:
    """Reached, restored, committed and lost: the figures an operator asks first."""
    committed = [
        c.step
        for c in checkpoints
        if c.attempt_no == a.attempt_no and c.state in ("committed", "superseded")
    ]
    restored = a.restored_step if a.restored_step is not None else None
    top = max(committed, default=None)
    words = [f"reached step {_or_dash(a.last_step)}", f"restored step {_or_dash(restored)}"]
    words.append(f"last commit at step {_or_dash(top)}")
    if a.last_step is not None and a.termination_reason not in (None, "succeeded"):
        # What the next attempt must train again: past the newest commit (or the restore).
        kept = max(s for s in (top, restored, 0) if s is not None)
        words.append(f"**{max(a.last_step - kept, 0)} step(s) lost**")
    return ", ".join(words)


def _clock_words(a: AttemptRecord) -> str:
    """Each clock named: the receipt's span and what the trainer process measured inside it."""
    words = [f"receipt open {_duration(a)} (from the attempt's begin to its end)"]
    t = a.timings or {}
    if "trainer_process_seconds" in t:
        words.append(f"trainer process {float(t['trainer_process_seconds']):.1f}s")
    if "setup_seconds" in t:
        words.append(f"of which set-up {float(t['setup_seconds']):.1f}s")
    if "training_seconds" in t:
        words.append(f"training loop {float(t['training_seconds']):.1f}s")
    return "; ".join(words)


# The start-up's parts as the trainer measured them (``timings.startup``), in its order.
_STARTUP_PARTS = (
    ("process_start", "process start"),
    ("imports", "imports"),
    ("ledger", "ledger"),
    ("data", "data"),
    ("restore", "restore"),
    ("first_step", "first step"),
)


def _startup_lines(a: AttemptRecord) -> list[str]:
    """Where the trainer's start-up went, up to the end of its first step: one line."""
    split = (a.timings or {}).get("startup")
    if not isinstance(split, dict):
        return []
    seconds = {key: float(split[key]) for key, _ in _STARTUP_PARTS if key in split}
    parts = [f"{words} {seconds[key]:.1f}s" for key, words in _STARTUP_PARTS if key in seconds]
    if "total" not in split:
        return [f"- **Start-up** (no step trained): {', '.join(parts)}"]
    # ``total`` counts from the process's start (from main() or run_training where that start
    # was not measured, and those parts are missing then); what no part names is the rest.
    total = float(split["total"])
    rest = max(total - sum(seconds.values()), 0.0)
    parts.append(f"the rest {rest:.1f}s (building the model and optimizer, joining ranks, events)")
    return [f"- **Start-up**: {total:.1f}s to the first step's end: {', '.join(parts)}"]


def _launch_words(a: AttemptRecord, attempts: Sequence[AttemptRecord] = ()) -> str:
    launched = a.launched_by or {}
    admission = a.admission or {}
    out = []
    if launched:
        who = launched.get("via", "unknown")
        extra = [f"user {launched['user']}"] if launched.get("user") else []
        if launched.get("claimed"):
            extra.append(f"its tags claimed {launched['claimed']}")
        # Which sensor tick or scheduled execution, where Dagster's daemon recorded it.
        for key, words in (("tick", "tick"), ("scheduled_for", "scheduled for")):
            if launched.get(key):
                extra.append(f"{words} {launched[key]}")
        if launched.get("run_key"):
            extra.append(f"run key `{launched['run_key']}`")
        if launched.get("dagster_run_id"):
            extra.append(f"Dagster run {launched['dagster_run_id']}")
        out.append(f"Launched by **{who}**" + (f" ({', '.join(extra)})" if extra else "") + ".")
        if in_run := in_run_words(launched):
            out.append(f"{in_run}.")
        if contradicted := contradicted_tags(launched, a.run_id, a.attempt_no):
            out.append(f"**{contradicted}**")
        if launched.get("trainer_config"):
            out.append(f"Trainer config: {trainer_source_words(launched, attempts)}.")
    if hooks := fault_hooks_words(a.placement):
        out.append(f"**{hooks[0].upper()}{hooks[1:]}.**")
    if admission:
        after = admission.get("after_decision")
        sentence = f"Admitted by rule `{admission.get('rule', '—')}`"
        if admission.get("after_attempt") is not None:
            sentence += f" after attempt {admission['after_attempt']}"
            if after:
                sentence += f" ended with **{after}**"
        sentence += f": {admission.get('reason', '')}".rstrip(": ")
        changes = admission.get("config_changes") or []
        if after == "stop" and changes:
            sentence += f" — relaunched with a changed config ({'; '.join(changes)})"
        out.append(sentence.rstrip(".") + ".")
    return " ".join(out)


def _attempts(
    attempts: Sequence[AttemptRecord], checkpoints: Sequence[CheckpointRecord], focus: int | None
) -> list[str]:
    out = ["## Attempts and retries", ""]
    if not attempts:
        return [*out, "No attempts.", ""]
    out += [
        "| # | started | receipt open | reason | GPU-h | decision | rule | budget left |",
        "|---:|---|---|---|---:|---|---|---|",
    ]
    for a in attempts:
        action, rule, left = _decision_words(a.retry_decision)
        out.append(
            f"| {_mark(a, focus)} | {_when(a.started_at)} | {_duration(a)} | "
            f"{a.termination_reason or 'still running'} | {_hours(a.gpu_seconds)} | "
            f"{action} | {rule} | {_cell(left)} |"
        )
    out.append("")
    for a in attempts:
        lead = (
            f"**▶ Attempt {a.attempt_no}**" if a.attempt_no == focus else f"Attempt {a.attempt_no}"
        )
        reason = a.termination_reason or "still running"
        exit_words = (
            f"exit code {_or_dash(a.exit_code)}, signal {_or_dash(a.signal)}; "
            f"{_steps_words(a, checkpoints)}"
        )
        detail = a.termination_detail or "no detail recorded"
        line = f"- {lead} — **{reason}** ({exit_words}): {detail}"
        if launch := _launch_words(a, attempts):
            line += f" {launch}"
        decision = a.retry_decision
        if decision:
            line += f" → **{decision['action']}**: {decision.get('reason', '')}"
            backoff = decision.get("backoff_seconds") or 0
            if backoff:
                line += f" (after a {float(backoff):.0f}s backoff)"
            previous = decision.get("previous")
            if previous:
                line += (
                    f" This replaced an earlier decision, **{previous.get('action')}** "
                    f"(`{previous.get('rule')}`): {previous.get('reason', '')}"
                )
        elif a.termination_reason:
            line += " → no retry decision recorded."
        out.append(line)
    spend: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for a in attempts:
        if a.termination_reason:
            spend[a.termination_reason][0] += 1
            spend[a.termination_reason][1] += a.gpu_seconds
    if spend:
        out += [
            "",
            "Spent per reason: "
            + "; ".join(
                f"{reason} {int(n)} attempt(s), {_hours(gpu)} GPU-h"
                for reason, (n, gpu) in sorted(spend.items(), key=lambda kv: -kv[1][1])
            )
            + ".",
        ]
    return [*out, ""]


def _focus_receipt(a: AttemptRecord, attempts: Sequence[AttemptRecord] = ()) -> list[str]:
    decision = a.retry_decision or {}
    return [
        f"## Attempt {a.attempt_no} in detail",
        "",
        f"- **Started** {_when(a.started_at)}, **ended** {_when(a.ended_at)}, "
        f"last heartbeat {_when(a.heartbeat_at)}; Dagster run "
        f"{a.dagster_run_id or '— (run outside Dagster)'}",
        f"- **Termination**: {a.termination_reason or 'still running'} — "
        f"{a.termination_detail or 'no detail recorded'}",
        f"- **Exit**: code {_or_dash(a.exit_code)}, signal {_or_dash(a.signal)}; "
        f"reached step {_or_dash(a.last_step)}, restored step {_or_dash(a.restored_step)}; "
        f"fencing token {a.fencing_token}",
        f"- **Launched**: {_launch_words(a, attempts) or 'not recorded'}",
        f"- **Resumed from**: {a.resumed_from_checkpoint or f'nothing ({_unresumed_words(a)})'}",
        f"- **Config** sha256 `{a.config_sha256}`; data manifest `{a.data_manifest_sha256}`; "
        f"container `{a.container_digest}`; code {a.code_commit or 'unknown'}",
        f"- **Clocks**: {_clock_words(a)}",
        *_startup_lines(a),
        *_step_timing_lines(a),
        *_hang_lines(a),
        f"- **Cost**: {a.gpu_seconds:.0f} GPU-seconds, {a.cpu_seconds:.0f} CPU-seconds",
        "- **Retry decision**: "
        + (
            f"{decision.get('action')} by rule `{decision.get('rule')}`; budget left "
            f"{_budget_words(decision.get('budget_left'))}; spent "
            f"{json.dumps(decision.get('spent'), sort_keys=True)}; resume from "
            f"{decision.get('resume_from') or '—'}"
            if decision
            else "none recorded"
        ),
        "",
    ]


# -- health: the loss-spike detector's timeline ---------------------------------------------


def _detector_words(settings: Mapping[str, Any]) -> str:
    if not settings.get("enabled", True):
        return "Loss-spike detector off (`spikes.enabled: false`): nothing was judged."
    limits = []
    if settings.get("zscore") is not None:
        limits.append(f"more than {settings['zscore']} standard deviations above")
    if settings.get("ratio") is not None:
        limits.append(f"more than {settings['ratio']} times")
    action = settings.get("action")
    what = {
        "skip": "its update is skipped",
        "rollback": f"the newest committed checkpoint from before it is restored and batches "
        f"{settings.get('skip_batches_before')} before to {settings.get('skip_batches_after')} "
        "after the spiking one are dealt past",
        "stop": "the attempt stops as diverged",
    }.get(str(action), f"action {action}")
    stop = settings.get("max_spikes")
    return (
        f"Loss-spike detector on {' and '.join(str(settings.get('metrics')).split(','))}: "
        "a step is a spike when "
        f"its value lies {' or '.join(limits)} the mean of the last {settings.get('window')} "
        f"steps (judged from {settings.get('min_history')} on); then {what}"
        + (f"; spike {stop} of the run stops it as diverged." if stop else ".")
    )


def _spike_row(e: Mapping[str, Any], focus: int | None) -> str:
    from pipeline.trainer.spikes import spike_words

    attempt = e.get("attempt_no")
    shown = f"**{attempt}**" if focus is not None and attempt == focus else _or_dash(attempt)
    action = {"skip": "update skipped", "rollback": "rolled back", "stop": "stopped (diverged)"}
    words = action.get(str(e.get("action")), str(e.get("action")))
    if e.get("why"):
        words += f": {e['why']}"
    skipped = e.get("skipped_batches")
    batches = f"{skipped[0]}-{skipped[1]}" if skipped else "—"
    back = e.get("rolled_back_to") or {}
    to = f"step {back.get('step')} (`{_short(back.get('path'))}`)" if back else "—"
    return (
        f"| {shown} | {e.get('step')} | {_cell(spike_words(e))} | {_cell(words)} | "
        f"{batches} | {to} |"
    )


def _health(
    attempts: Sequence[AttemptRecord],
    evaluations: Sequence[EvaluationRecord],
    focus: int | None,
) -> list[str]:
    """Every spike any attempt saw, what was done, which batches were dealt past and where it
    rolled back to; and whether the evaluated checkpoints carry that history. Attempts from
    before the detector recorded nothing: then there is no section."""
    from pipeline.trainer.spikes import health_summary

    recorded = [a.health for a in attempts if a.health]
    if not recorded:
        return []
    out = ["## Health", "", _detector_words(recorded[-1].get("settings") or {}), ""]
    # Each attempt's record holds the history it inherited from its checkpoint too: an event
    # is listed once, under the attempt that saw it.
    events: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for health in recorded:
        for e in health.get("events") or []:
            key = (e.get("attempt_no"), e.get("step"), e.get("batch"), e.get("action"))
            events.setdefault(key, e)
    if not events:
        out.append("No loss spike in any attempt.")
    else:
        totals = health_summary({"events": list(events.values())})
        ranges = ", ".join(f"{a}-{b}" for a, b in totals["skipped_batches"]) or "none"
        out += [
            f"{totals['spikes']} spike(s): {totals['skipped_updates']} update(s) skipped, "
            f"{totals['rollbacks']} rollback(s), {totals['stops']} stop(s); batches never "
            f"trained on: {ranges}.",
            "",
            "| attempt | step | spike | action | batches never trained on | rolled back to |",
            "|---:|---:|---|---|---|---|",
        ]
        out += [_spike_row(e, focus) for e in events.values()]
    for e in evaluations:
        carried = e.training_health
        if e.status != "complete" or carried is None:
            continue
        out += [
            "",
            f"Evaluation `{e.evaluation_id}` ({e.evaluator_name}) of `{_short(e.checkpoint_path)}` "
            f"records the history that checkpoint carries: {carried.get('spikes', 0)} spike(s), "
            f"{carried.get('rollbacks', 0)} rollback(s), {carried.get('skipped_updates', 0)} "
            "update(s) skipped.",
        ]
    return [*out, ""]


_TIMED = (("data", "data"), ("compute", "compute"), ("collective", "collective"),
          ("health", "spike detector"), ("save_stall", "save stall"),
          ("total", "total"))  # fmt: skip


def _step_timing_lines(a: AttemptRecord) -> list[str]:
    """One line per rank: median and p99 of each part of its steps (``timings.steps``)."""
    ranks = (a.timings or {}).get("steps")
    if not isinstance(ranks, Mapping):
        return []
    out = []
    for rank in sorted(ranks, key=lambda r: int(r) if str(r).isdigit() else -1):
        figures = ranks[rank]
        if not isinstance(figures, Mapping):
            continue
        parts = [
            f"{words} {_ms(figures[key].get('median'))} / {_ms(figures[key].get('p99'))}"
            for key, words in _TIMED
            if isinstance(figures.get(key), Mapping)
        ]
        out.append(
            f"- **Step timing, rank {rank}** ({figures.get('steps', '?')} steps; median / p99 "
            f"in ms): {', '.join(parts)}"
        )
    return out


def _ms(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "—"
    ms = float(seconds) * 1000
    return f"{ms:.3g}" if ms < 100 else f"{ms:,.0f}"


def _hang_lines(a: AttemptRecord) -> list[str]:
    """The watchdog's facts when it ended the attempt: who was stuck, who waited, the stacks."""
    fired = (a.timings or {}).get("watchdog")
    if not isinstance(fired, Mapping):
        return []
    story = fired.get("story") if isinstance(fired.get("story"), Mapping) else {}
    stuck = ", ".join(str(r) for r in story.get("stuck") or [])
    waiting = ", ".join(str(r) for r in story.get("waiting") or [])
    frames = " ← ".join(str(f) for f in (fired.get("top_frames") or [])[:5])
    line = (
        f"- **Hang**: stuck rank(s) {stuck or '—'}"
        + (f", waiting rank(s) {waiting}" if waiting else "")
        + f"; rank {fired.get('rank')}'s watchdog fired at step {fired.get('step')} in "
        f"{fired.get('phase')} ({fired.get('what')}) after {fired.get('stalled_seconds')} s "
        f"without a finished step (threshold {fired.get('threshold_seconds')} s: the larger "
        f"of {fired.get('multiple')} times its p99 step time {fired.get('p99_step_seconds')} s "
        f"and the floor {fired.get('floor_seconds')} s)"
    )
    if frames:
        line += f"; its top frames: {frames}"
    if fired.get("stacks_file"):
        line += f"; every thread's stack beside its last words: {fired['stacks_file']}"
    return [line]


def _evaluations(evaluations: Sequence[EvaluationRecord], attempts_ok: bool) -> list[str]:
    out = ["## Evaluation", ""]
    if not evaluations:
        why = (
            "no evaluation has been recorded yet"
            if attempts_ok
            else "no attempt succeeded, so there is no final checkpoint to evaluate"
        )
        return [*out, f"Not evaluated: {why}.", ""]
    complete = [e for e in evaluations if e.status == "complete"]
    failed = [e for e in evaluations if e.status != "complete"]
    out.append(
        f"{len(complete)} complete and {len(failed)} failed evaluation(s). "
        + (
            "Crashed evaluators are retried on their own; the training is never re-run for them."
            if failed
            else ""
        )
    )
    out += [
        "",
        "| evaluator | status | checkpoint | metrics | missing provenance | id |",
        "|---|---|---|---|---|---|",
    ]
    for e in evaluations:
        metrics = ", ".join(
            f"{k}={v:.4f}"
            for k, v in sorted((e.metrics or {}).items())
            if isinstance(v, int | float)
        )
        status = e.status + (
            f" ({e.termination_reason}: {e.detail})" if e.termination_reason else ""
        )
        # A field the evaluator itself states does not apply (and why) is not missing.
        declared = (e.provenance or {}).get("not_applicable") or {}
        missing = (
            ", ".join(f for f in e.missing_provenance() if f not in declared)
            if e.status == "complete"
            else "—"
        )
        out.append(
            f"| {_cell(e.evaluator_name)} {_cell(e.evaluator_version[:20])} | {_cell(status)} | "
            f"`{_short(e.checkpoint_path)}` (`{e.checkpoint_manifest_sha256[:12]}`) | "
            f"{_cell(metrics)} | {_cell(missing or 'none')} | `{e.evaluation_id}` |"
        )
    recorded = [e for e in evaluations if e.provenance]
    if recorded:
        out += ["", "What each evaluation recorded, as `tracks reproduce` reads it:", ""]
        for e in recorded:
            out += _provenance_lines(e)
    return [*out, ""]


def _decoding(params: Mapping[str, Any]) -> str:
    parts = [f"{k}={params[k]}" for k in ("temperature", "top_k", "top_p") if k in params]
    parts.append(f"max_new_tokens={params.get('max_new_tokens')}")
    stops = params.get("stop_sequences") or []
    parts.append(f"stop={[str(s) for s in stops]!r}")
    return ", ".join(parts)


def _provenance_lines(e: EvaluationRecord) -> list[str]:
    """One evaluation's recorded provenance, every field a reader needs to trust or reproduce
    it, and what its evaluator states does not apply, with the reason."""
    p = e.provenance or {}
    fields = [
        f"code `{e.evaluator_version}`",
        f"weights `{short_digest(p.get('model_digest'))}`",
        f"snapshot `{p.get('snapshot_id', '—')}`",
    ]
    if isinstance(p.get("tokenizer"), Mapping):
        tok = p["tokenizer"]
        fields.append(f"tokenizer {tok.get('name')} `{short_digest(tok.get('digest'))}`")
    prompts = p.get("prompt_set")
    if isinstance(prompts, Mapping):
        fields.append(
            f"prompt set {prompts.get('version')} ({prompts.get('items')} items) "
            f"`{short_digest(prompts.get('digest'))}`"
        )
    template = p.get("template")
    if isinstance(template, Mapping):
        fields.append(f"template {template.get('name')} `{short_digest(template.get('digest'))}`")
    decoding = p.get("decoding_params")
    if isinstance(decoding, Mapping) and isinstance(decoding.get("greedy"), Mapping):
        fields.append(f"greedy decoding ({_decoding(decoding['greedy'])})")
        if isinstance(decoding.get("sampled"), Mapping):
            fields.append(
                f"sampled decoding ({_decoding(decoding['sampled'])}, "
                f"{decoding.get('samples_per_prompt')} per prompt)"
            )
        fields.append(f"seed {decoding.get('seed')} ({decoding.get('sample_seed', 'per sample')})")
    judge = p.get("judge")
    if isinstance(judge, Mapping):
        fields.append(
            f"judge {judge.get('version')} `{short_digest(judge.get('digest'))}`, rubric "
            f"`{judge.get('rubric_version')}`"
        )
    if "overlap_fraction" in p:
        fields.append(
            f"contamination {float(p['overlap_fraction']):.3f} of {p.get('evaluation_ngrams')} "
            f"{p.get('method')} against training snapshot `{p.get('training_snapshot_id')}` "
            f"(threshold {p.get('threshold')}: "
            f"{'contaminated' if p.get('contaminated') else 'clean'})"
        )
    lines = [f"- `{e.evaluation_id}` ({e.evaluator_name}): " + "; ".join(fields) + "."]
    declared = p.get("not_applicable") or {}
    if declared:
        lines.append(
            "  Not applicable, as the evaluator states: "
            + "; ".join(f"{k}: {v}" for k, v in sorted(declared.items()))
            + "."
        )
    else:
        lines.append("  Not applicable: nothing; every field is filled.")
    return lines


def _promotions(promotions: Sequence[PromotionRecord]) -> list[str]:
    out = ["## Promotion", ""]
    if not promotions:
        return [*out, "No promotion decision yet.", ""]
    for p in promotions:
        version = f" as {p.model_name} version {p.model_version}" if p.model_version else ""
        champion = (
            f" (previous champion: version {p.previous_champion_version})"
            if p.previous_champion_version
            else ""
        )
        out.append(
            f"- {_when(p.decided_at)}: **{p.decision}**{version}{champion} for checkpoint "
            f"`{_short(p.checkpoint_path)}` of attempt {p.attempt_no} — {p.reason}"
        )
        out += _headline(p)
    return [*out, ""]


def _headline(p: PromotionRecord) -> list[str]:
    # Rows decided before the headline comparison existed hold none: nothing is claimed then.
    from pipeline.promotion.comparison import headline_sentence

    gate = p.gate or {}
    if "headline_comparison" not in gate:
        return []
    headline = gate["headline_comparison"]
    if headline is None:
        return ["  - Headline: no champion to compare against."]
    champion = gate.get("champion_version")
    who = f"champion version {champion}" if champion else "the champion"
    sentence = headline_sentence(headline, who)
    # A refusal or pass for the headline already quotes it in full: say it once.
    lines = [] if sentence in p.reason else [f"  - Headline: {sentence}."]
    again = gate.get("champion_reevaluation")
    if again and again.get("evaluated"):
        lines.append(
            f"  - The champion was evaluated on this task set for the comparison: evaluation "
            f"`{again['evaluation_id']}`."
        )
    return lines


def _model_history(
    ledger: Ledger, run: RunRecord, promotions: Sequence[PromotionRecord]
) -> list[str]:
    """For each model this run was put forward for: its champions in order, who dethroned whom
    and when, and who is champion now (the ledger's promotion records)."""
    out = ["## Model history", ""]
    names = sorted({p.model_name for p in promotions})
    if not names:
        return [*out, "No promotion decision names a model for this run yet.", ""]
    for name in names:
        crowned = ledger.promotions(model_name=name, decision=PromotionDecision.PROMOTED)[::-1]
        if not crowned:
            out += [f"`{name}` has had no champion yet.", ""]
            continue
        now = crowned[-1]
        mine = " (this run)" if now.run_id == run.run_id else ""
        out += [
            f"Champion of `{name}` now: **version {now.model_version}** from run "
            f"`{now.run_id}`{mine}, attempt {now.attempt_no}, since {_when(now.decided_at)}.",
            "",
            "| crowned | version | run | attempt | dethroned |",
            "|---|---|---|---:|---|",
        ]
        for held, successor in zip(crowned, [*crowned[1:], None], strict=True):
            dethroned = (
                f"by version {successor.model_version} (run `{successor.run_id}`) on "
                f"{_when(successor.decided_at)}"
                if successor is not None
                else "champion now"
            )
            out.append(
                f"| {_when(held.decided_at)} | {held.model_version} | `{held.run_id}`"
                f"{' (this run)' if held.run_id == run.run_id else ''} | {held.attempt_no} | "
                f"{dethroned} |"
            )
        out.append("")
    return out


# -- the logbook: notes (people's, and Tracks' own) among the run's events ------------------


def _note_lines(note: NoteRecord) -> list[str]:
    on = "the run" if note.attempt_no is None else f"attempt {note.attempt_no}"
    by = (
        "recorded by **Tracks** itself (a Dagster run's training step)"
        if note.source == NOTE_SOURCE_OF_TRACKS
        else f"by **{_cell(note.author)}** ({_cell(note.source)})"
    )
    head = f"- {_when(note.created_at)} — **note {note.note_id}** on {on} {by}:"
    # A blockquote under the list item keeps the note's own lines, as it was written.
    return [head, *(f"  > {line}".rstrip() for line in note.text.splitlines())]


def _logbook_events(
    run: RunRecord, attempts: Sequence[AttemptRecord], promotions: Sequence[PromotionRecord]
) -> list[tuple[Any, str]]:
    """(when, one line) for what the ledger recorded happening: the context of the notes."""
    events = [(run.created_at, f"run created for {run.owner} ({run.purpose})")]
    for a in attempts:
        via = (a.launched_by or {}).get("via")
        launched = f" (launched by {via})" if via else ""
        events.append((a.started_at, f"attempt {a.attempt_no} started{launched}"))
        if a.ended_at is not None:
            action = (a.retry_decision or {}).get("action")
            then = f" → {action}" if action else ""
            events.append(
                (a.ended_at, f"attempt {a.attempt_no} ended **{a.termination_reason}**{then}")
            )
    for p in promotions:
        version = f" (version {p.model_version})" if p.model_version else ""
        events.append((p.decided_at, f"promotion **{p.decision}**{version}"))
    return events


def _logbook(
    run: RunRecord,
    attempts: Sequence[AttemptRecord],
    promotions: Sequence[PromotionRecord],
    notes: Sequence[NoteRecord],
    focus: int | None,
) -> list[str]:
    """People's notes in time order among the run's events; an attempt's page shows the run's
    notes and its own."""
    out = ["## Logbook", ""]
    shown = [n for n in notes if focus is None or n.attempt_no in (None, focus)]
    elsewhere = sorted({n.attempt_no for n in notes if n not in shown})
    if not shown:
        out.append(
            f"No notes{' on this attempt or the run' if focus is not None else ''}. "
            f'`tracks note {run.run_id}[#N] "why"` adds one; notes are only ever added.'
        )
    else:
        out += [
            "Notes people left (only ever added, never edited), in time order among the "
            "run's events:",
            "",
        ]
        # Notes sort after an event of the same instant: a launch note follows its attempt.
        events = _logbook_events(run, attempts, promotions)
        timeline = [(when, 0, [f"- {_when(when)} — {what}"]) for when, what in events]
        timeline += [(n.created_at, 1, _note_lines(n)) for n in shown]
        for _when_at, _order, lines in sorted(timeline, key=lambda item: item[:2]):
            out += lines
    if elsewhere:
        said = ", ".join(f"`{run.run_id}#{n}`" for n in elsewhere)
        out += ["", f"Other attempts have notes of their own: {said}."]
    return [*out, ""]


def render_run(ledger: Ledger, run: RunRecord, focus_attempt: int | None = None) -> str:
    """The one-page story of ``run`` as Markdown; ``focus_attempt`` is highlighted."""
    attempts = ledger.attempts(run.run_id)
    checkpoints = ledger.checkpoints(run.run_id)
    evaluations = ledger.evaluations_for_run(run.run_id)
    promotions = ledger.promotions(run_id=run.run_id)
    focus = next((a for a in attempts if a.attempt_no == focus_attempt), None)
    title = f"# Run {run.run_id}" + (f", attempt {focus_attempt}" if focus_attempt else "")
    out = [title, ""]
    out += _summary(run, attempts, focus, promotions)
    out += _logbook(run, attempts, promotions, ledger.notes(run.run_id), focus_attempt)
    out += _what_was_tried(run, attempts, focus)
    out += _data(run, attempts, ledger)
    out += _placement(attempts, focus_attempt)
    out += _lineage(attempts, checkpoints, focus_attempt)
    out += _health(attempts, evaluations, focus_attempt)
    out += _attempts(attempts, checkpoints, focus_attempt)
    if focus is not None:
        out += _focus_receipt(focus, attempts)
    out += _evaluations(evaluations, any(a.termination_reason == "succeeded" for a in attempts))
    out += _promotions(promotions)
    out += _model_history(ledger, run, promotions)
    return "\n".join(out).rstrip() + "\n"


def explain(ledger: Ledger, target: str) -> str:
    """Render the page for a run id, or an attempt named ``RUN#N``."""
    if ids.is_snapshot_id(target):
        try:
            return redact.text(render_snapshot(ledger, target))
        except UnknownSnapshotError:
            pass  # a run may be named like a snapshot; try it as a run
    run_id, attempt_no = parse_target(target)
    run = ledger.get_run(run_id)
    if attempt_no is not None:
        ledger.get_attempt(run.run_id, attempt_no)  # raises if it does not exist
    # Rows written before details were redacted on the way in may still quote a password.
    return redact.text(render_run(ledger, run, focus_attempt=attempt_no))
