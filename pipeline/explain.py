"""``tracks explain``: the whole story of a run or attempt on one page of Markdown."""

from __future__ import annotations

import json
from typing import Any

from pipeline.ledger import AttemptRecord, Ledger, RunRecord, UnknownRunError


def _parse_target(target: str) -> tuple[str, int | None]:
    # "RUN#3" or "RUN/3" names one attempt; a bare run id names the whole run.
    for sep in ("#", "/"):
        run_id, _, tail = target.rpartition(sep)
        if run_id and tail.isdigit():
            return run_id, int(tail)
    return target, None


def _config_changes(
    previous: dict[str, Any], current: dict[str, Any], prefix: str = ""
) -> list[str]:
    changes = []
    for key in sorted(set(previous) | set(current)):
        before, after = previous.get(key), current.get(key)
        name = f"{prefix}{key}"
        if isinstance(before, dict) and isinstance(after, dict):
            changes.extend(_config_changes(before, after, prefix=f"{name}."))
        elif before != after:
            changes.append(f"`{name}`: {before!r} → {after!r}")
    return changes


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else "—"


def _or_dash(value: Any) -> str:
    return "—" if value is None or value == "" else str(value)


def _attempt_section(attempt: AttemptRecord, previous: AttemptRecord | None) -> list[str]:
    p = attempt.placement or {}
    lines = [
        f"### Attempt {attempt.attempt_no} — {attempt.termination_reason or attempt.status}",
        "",
        f"- **Started** {_when(attempt.started_at)}, **ended** {_when(attempt.ended_at)}, "
        f"last heartbeat {_when(attempt.heartbeat_at)}",
        f"- **Termination**: {attempt.termination_reason or 'still running'} — "
        f"{attempt.termination_detail or 'no detail recorded'}",
        f"- **Exit**: code {_or_dash(attempt.exit_code)}, signal {_or_dash(attempt.signal)}; "
        f"last step {_or_dash(attempt.last_step)}",
        f"- **Resumed from**: {attempt.resumed_from_checkpoint or 'nothing (fresh start)'}",
        f"- **Config** sha256 `{attempt.config_sha256[:16]}`; "
        f"data manifest `{attempt.data_manifest_sha256[:16]}`",
    ]
    if previous is not None:
        changes = _config_changes(previous.config_snapshot, attempt.config_snapshot)
        lines.append(
            f"- **Changed from attempt {previous.attempt_no}**: "
            + ("; ".join(changes) if changes else "nothing")
        )
    lines += [
        f"- **Where**: host {_or_dash(p.get('host'))}, pod {_or_dash(p.get('pod'))}, "
        f"node {_or_dash(p.get('node'))}, {p.get('accelerator_count', 0)} x "
        f"{_or_dash(p.get('accelerator_type'))}, torch {_or_dash(p.get('torch_version'))}, "
        f"CUDA {p.get('cuda_version') or 'none'}, world size {p.get('world_size', 1)}",
        f"- **Cost**: {attempt.gpu_seconds:.0f} GPU-seconds, "
        f"{attempt.cpu_seconds:.0f} CPU-seconds; container `{attempt.container_digest[:40]}`; "
        f"code {attempt.code_commit or 'unknown'}",
        "- **Retry decision**: "
        + (
            json.dumps(attempt.retry_decision, sort_keys=True)
            if attempt.retry_decision
            else "none recorded"
        ),
        f"- **Dagster run**: {attempt.dagster_run_id or '— (run outside Dagster)'}",
    ]
    return lines


def render_run(ledger: Ledger, run: RunRecord, focus_attempt: int | None = None) -> str:
    """The one-page story of ``run`` as Markdown."""
    attempts = ledger.attempts(run.run_id)
    checkpoints = ledger.checkpoints(run.run_id)
    evaluations = ledger.evaluations_for_run(run.run_id)
    promotions = ledger.promotions(run_id=run.run_id)
    title = f"# Run {run.run_id}" + (f", attempt {focus_attempt}" if focus_attempt else "")
    out = [
        title,
        "",
        f"**{run.model_family}** for **{run.owner}** ({run.purpose}), "
        f"created {_when(run.created_at)}; status **{run.status}** "
        f"after {len(attempts)} attempt(s).",
        "",
        "## What was tried",
        "",
    ]
    if attempts:
        first = attempts[0]
        out.append("```json")
        out.append(json.dumps(first.config_snapshot, indent=2, sort_keys=True))
        out.append("```")
    out += [f"config sha256 `{run.config_sha256}`, code {run.code_commit or 'unknown'}", ""]
    out += ["## Data", "", f"snapshot `{run.snapshot_id}`"]
    if attempts:
        out.append(f", manifest sha256 `{attempts[-1].data_manifest_sha256}`")
    out += ["", "## Attempts and retries", ""]
    previous = None
    for attempt in attempts:
        out += _attempt_section(attempt, previous)
        out.append("")
        previous = attempt
    out += ["## Checkpoint lineage", ""]
    if checkpoints:
        out += [
            "| step | attempt | state | parent | manifest | metrics |",
            "|---:|---:|---|---|---|---|",
        ]
        for c in checkpoints:
            parent = c.parent_path.rsplit("/", 1)[-1] if c.parent_path else "—"
            metrics = ", ".join(
                f"{k}={v:.4g}" for k, v in (c.metrics or {}).items() if isinstance(v, int | float)
            )
            out.append(
                f"| {c.step} | {c.attempt_no} | {c.state} | {parent} | "
                f"`{(c.manifest_sha256 or '')[:12]}` | {metrics} |"
            )
    else:
        out.append("No checkpoint was ever started.")
    out += ["", "## Evaluations", ""]
    if evaluations:
        out += ["| evaluator | status | checkpoint | metrics | id |", "|---|---|---|---|---|"]
        for e in evaluations:
            metrics = ", ".join(f"{k}={v:.4f}" for k, v in sorted((e.metrics or {}).items()))
            status = e.status + (
                f" ({e.termination_reason}: {e.detail})" if e.termination_reason else ""
            )
            out.append(
                f"| {e.evaluator_name} {e.evaluator_version[:20]} | {status} | "
                f"`{e.checkpoint_manifest_sha256[:12]}` | {metrics} | `{e.evaluation_id}` |"
            )
    else:
        out.append("Not evaluated.")
    out += ["", "## Promotion", ""]
    if promotions:
        for p in promotions:
            version = f" as {p.model_name} version {p.model_version}" if p.model_version else ""
            out.append(f"- {_when(p.decided_at)}: **{p.decision}**{version} — {p.reason}")
    else:
        out.append("No promotion decision yet.")
    return "\n".join(out) + "\n"


def explain(ledger: Ledger, target: str) -> str:
    """Render the page for a run id, or an attempt named ``RUN#N``."""
    run_id, attempt_no = _parse_target(target)
    try:
        run = ledger.get_run(run_id)
    except UnknownRunError:
        if attempt_no is None:
            raise
        run = ledger.get_run(target)
        attempt_no = None
    if attempt_no is not None:
        ledger.get_attempt(run.run_id, attempt_no)  # raises if it does not exist
    return render_run(ledger, run, focus_attempt=attempt_no)
