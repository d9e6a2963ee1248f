"""``tracks diff RUN RUN``: two runs side by side, from the ledger alone, as Markdown.

Config key by key (each run's newest attempt, what it last trained with), data (snapshot ids,
manifest and content digests, the checks' verdicts), placement (the newest attempts') and
evaluations (each evaluator's newest complete metrics, with the difference).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline import redact
from pipeline.ledger import (
    AttemptRecord,
    EvaluationRecord,
    Ledger,
    RunRecord,
    UnknownSnapshotError,
)
from pipeline.states import EvaluationStatus

# Where an attempt ran, in the order an operator compares them.
PLACEMENT_KEYS = (
    "host", "node", "backend", "world_size", "ranks_per_node", "nodes", "accelerator_type",
    "accelerator_count", "torch_version", "cuda_version",
)  # fmt: skip


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            _flat(f"{prefix}{key}.", inner, out)
    else:
        out[prefix.rstrip(".")] = value
    return out


def _shown(value: Any) -> str:
    if value is None:
        return "—"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return " ".join(text.split()).replace("|", "\\|")


def _row(name: str, left: Any, right: Any) -> str:
    mark = "" if left == right else " **≠**"
    return f"| {name}{mark} | {_shown(left)} | {_shown(right)} |"


def _newest(attempts: Sequence[AttemptRecord]) -> AttemptRecord | None:
    return attempts[-1] if attempts else None


def _which(run: RunRecord, attempt: AttemptRecord | None) -> str:
    return f"`{run.run_id}` attempt {attempt.attempt_no}" if attempt else f"`{run.run_id}` (none)"


def _summary(ledger: Ledger, runs: tuple[RunRecord, RunRecord]) -> list[str]:
    out = ["| | left | right |", "|---|---|---|"]
    attempts = [ledger.attempts(r.run_id) for r in runs]
    rows: list[tuple[str, Any, Any]] = [
        ("run", runs[0].run_id, runs[1].run_id),
        ("model family", runs[0].model_family, runs[1].model_family),
        ("owner", runs[0].owner, runs[1].owner),
        ("purpose", runs[0].purpose, runs[1].purpose),
        ("status", runs[0].status, runs[1].status),
        ("attempts", len(attempts[0]), len(attempts[1])),
        (
            "GPU-hours",
            round(sum(a.gpu_seconds for a in attempts[0]) / 3600, 3),
            round(sum(a.gpu_seconds for a in attempts[1]) / 3600, 3),
        ),
        ("code commit", runs[0].code_commit, runs[1].code_commit),
    ]
    return out + [_row(name, left, right) for name, left, right in rows]


def _config(runs: tuple[RunRecord, RunRecord], newest: list[AttemptRecord | None]) -> list[str]:
    out = [
        f"Each run's newest attempt: {_which(runs[0], newest[0])} against "
        f"{_which(runs[1], newest[1])}.",
        "",
    ]
    flat = [_flat("", (a.config_snapshot if a else None) or {}, {}) for a in newest]
    keys = sorted(set(flat[0]) | set(flat[1]))
    differ = [k for k in keys if flat[0].get(k) != flat[1].get(k)]
    if not keys:
        return [*out, "Neither run has a recorded config."]
    out.append(f"{len(differ)} of {len(keys)} key(s) differ.")
    out += ["", "| key | left | right |", "|---|---|---|"]
    # The keys that differ first: they are the answer; the rest confirm what stayed.
    for key in [*differ, *(k for k in keys if k not in differ)]:
        out.append(_row(f"`{key}`", flat[0].get(key), flat[1].get(key)))
    return out


def _data(ledger: Ledger, runs: tuple[RunRecord, RunRecord]) -> list[str]:
    facts: list[dict[str, Any]] = []
    for run in runs:
        manifests = sorted({a.data_manifest_sha256 for a in ledger.attempts(run.run_id)})
        fact: dict[str, Any] = {"snapshot": run.snapshot_id, "manifests": manifests}
        try:
            snap = ledger.get_snapshot(run.snapshot_id)
        except UnknownSnapshotError:
            fact |= {"content": None, "verdict": "not in the ledger", "rows": None}
        else:
            fact |= {"content": snap.content_sha256, "verdict": snap.verdict, "rows": snap.rows}
        facts.append(fact)
    left, right = facts
    out = ["| | left | right |", "|---|---|---|"]
    out.append(_row("snapshot", left["snapshot"], right["snapshot"]))
    out.append(
        _row(
            "manifest sha256 read by the attempts",
            ", ".join(m[:16] for m in left["manifests"]) or None,
            ", ".join(m[:16] for m in right["manifests"]) or None,
        )
    )
    out.append(
        _row(
            "content sha256",
            (left["content"] or "")[:16] or None,
            (right["content"] or "")[:16] or None,
        )
    )
    out.append(_row("rows", left["rows"], right["rows"]))
    out.append(_row("blocking checks", left["verdict"], right["verdict"]))
    if (
        left["snapshot"] != right["snapshot"]
        and left["content"]
        and (left["content"] == right["content"])
    ):
        out += ["", "The two snapshots hold **byte-identical** data under other file names."]
    return out


def _placement(runs: tuple[RunRecord, RunRecord], newest: list[AttemptRecord | None]) -> list[str]:
    out = [
        f"{_which(runs[0], newest[0])} against {_which(runs[1], newest[1])}.",
        "",
        "| | left | right |",
        "|---|---|---|",
    ]
    places = [(a.placement or {}) if a else {} for a in newest]
    for key in PLACEMENT_KEYS:
        out.append(_row(key, places[0].get(key), places[1].get(key)))
    out.append(
        _row(
            "device",
            ((newest[0].config_snapshot or {}) if newest[0] else {}).get("device"),
            ((newest[1].config_snapshot or {}) if newest[1] else {}).get("device"),
        )
    )
    out.append(
        _row(
            "container",
            newest[0].container_digest if newest[0] else None,
            newest[1].container_digest if newest[1] else None,
        )
    )
    return out


def _newest_complete(evaluations: Sequence[EvaluationRecord]) -> dict[str, EvaluationRecord]:
    found: dict[str, EvaluationRecord] = {}
    for e in evaluations:  # oldest first: the newest one per evaluator stays
        if e.status == EvaluationStatus.COMPLETE:
            found[e.evaluator_name] = e
    return found


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _evaluations(ledger: Ledger, runs: tuple[RunRecord, RunRecord]) -> list[str]:
    found = [_newest_complete(ledger.evaluations_for_run(r.run_id)) for r in runs]
    names = sorted(set(found[0]) | set(found[1]))
    if not names:
        return ["Neither run has a complete evaluation."]
    out = [
        "Each evaluator's newest complete evaluation per run.",
        "",
        "| evaluator | metric | left | right | right - left |",
        "|---|---|---|---|---:|",
    ]
    for name in names:
        left, right = found[0].get(name), found[1].get(name)
        metrics = sorted(set((left.metrics if left else None) or {}) |
                         set((right.metrics if right else None) or {}))  # fmt: skip
        if not metrics:
            out.append(f"| {name} | — | {'—' if left is None else 'no metrics'} | "
                       f"{'—' if right is None else 'no metrics'} | |")  # fmt: skip
        for metric in metrics:
            a = _number(((left.metrics if left else None) or {}).get(metric))
            b = _number(((right.metrics if right else None) or {}).get(metric))
            change = f"{b - a:+.4f}" if a is not None and b is not None else ""
            out.append(
                f"| {name} | {metric} | {'—' if a is None else f'{a:.4f}'} | "
                f"{'—' if b is None else f'{b:.4f}'} | {change} |"
            )
    return out


def diff_runs(ledger: Ledger, left_id: str, right_id: str) -> str:
    """The page comparing runs ``left_id`` and ``right_id``; raises for an unknown run."""
    runs = (ledger.get_run(left_id), ledger.get_run(right_id))
    newest = [_newest(ledger.attempts(r.run_id)) for r in runs]
    out = [f"# Run {runs[0].run_id} against run {runs[1].run_id}", ""]
    out += [*_summary(ledger, runs), ""]
    out += ["## Config", "", *_config(runs, newest), ""]
    out += ["## Data", "", *_data(ledger, runs), ""]
    out += ["## Placement", "", *_placement(runs, newest), ""]
    out += ["## Evaluations", "", *_evaluations(ledger, runs), ""]
    # Rows written before details were redacted on the way in may still quote a password.
    return redact.text("\n".join(out).rstrip() + "\n")
