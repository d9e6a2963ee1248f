"""The quality gate: which evaluations count for a checkpoint, and whether they are good enough.

A pure function of ledger rows, so every refusal can be re-derived from the ledger alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.ledger.records import EvaluationRecord
from pipeline.states import EvaluationStatus

_REASONS_SHOWN = 6


def _default_min_metrics() -> dict[str, float]:
    return {"holdout_accuracy.accuracy": 0.90, "noise_robustness.accuracy@0.1": 0.80}


@dataclass(frozen=True)
class QualityGate:
    """Thresholds a candidate must meet, and how far a slice may fall below the champion's.

    ``min_metrics`` keys are ``<evaluator>.<metric>``. Slices are compared on
    ``slice_metric`` for every slice both the candidate and the champion have.
    """

    min_metrics: Mapping[str, float] = field(default_factory=_default_min_metrics)
    max_slice_regression: float = 0.03
    slice_metric: str = "accuracy"

    def as_dict(self) -> dict[str, Any]:
        return {
            "min_metrics": dict(self.min_metrics),
            "max_slice_regression": self.max_slice_regression,
            "slice_metric": self.slice_metric,
        }

    def decide(
        self,
        checkpoint_manifest_sha256: str,
        evaluations: Iterable[EvaluationRecord],
        champion_evaluations: Iterable[EvaluationRecord] = (),
        required: Sequence[str] = (),
        *,
        champion_version: str | None = None,
    ) -> GateDecision:
        """Decide on the checkpoint with manifest ``checkpoint_manifest_sha256``.

        Only the newest ``complete`` evaluation per evaluator for exactly that manifest counts.
        Champion evaluations are matched per evaluator, preferring the same task set version.
        """
        sha12 = checkpoint_manifest_sha256[:12]
        reasons: list[str] = []
        counted = newest_complete(evaluations, checkpoint_manifest_sha256)

        for name in required:
            if name not in counted:
                reasons.append(
                    f"evaluator {name} has no complete evaluation for checkpoint {sha12}"
                )
        for name, record in sorted(counted.items()):
            missing = record.missing_provenance()
            if missing:
                reasons.append(
                    f"missing provenance fields {', '.join(missing)} on evaluation "
                    f"{record.evaluation_id} ({name})"
                )

        checks = []
        for key, threshold in sorted(self.min_metrics.items()):
            evaluator_name, _, metric = key.partition(".")
            record = counted.get(evaluator_name)
            if record is None:
                if evaluator_name not in required:
                    reasons.append(
                        f"{key} cannot be checked: evaluator {evaluator_name} has no complete "
                        f"evaluation for checkpoint {sha12}"
                    )
                checks.append(
                    {"metric": key, "threshold": threshold, "value": None, "passed": False}
                )
                continue
            value = (record.metrics or {}).get(metric)
            passed = value is not None and float(value) >= threshold
            checks.append({"metric": key, "threshold": threshold, "value": value, "passed": passed})
            if value is None:
                reasons.append(f"{key} is missing from evaluation {record.evaluation_id}")
            elif not passed:
                reasons.append(f"{key} {float(value):.4f} < {threshold:g}")

        comparisons, champion_used = self._compare_slices(
            counted, list(champion_evaluations), champion_version, reasons
        )
        details = {
            "checkpoint_manifest_sha256": checkpoint_manifest_sha256,
            "required": list(required),
            "evaluations": {name: r.evaluation_id for name, r in sorted(counted.items())},
            "thresholds": checks,
            "champion_version": champion_version,
            "champion_evaluations": champion_used,
            "slice_comparisons": comparisons,
            "gate": self.as_dict(),
            "reasons": reasons,
        }
        return GateDecision(
            passed=not reasons,
            reasons=reasons,
            details=details,
            evaluation_ids=[r.evaluation_id for _, r in sorted(counted.items())],
        )

    def _compare_slices(
        self,
        counted: dict[str, EvaluationRecord],
        champion_evaluations: list[EvaluationRecord],
        champion_version: str | None,
        reasons: list[str],
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        comparisons: list[dict[str, Any]] = []
        used: dict[str, Any] = {}
        against = f"champion version {champion_version}" if champion_version else "the champion"
        for name, record in sorted(counted.items()):
            baseline = _champion_baseline(champion_evaluations, name, record.task_set_version)
            if baseline is None:
                continue
            used[name] = {
                "evaluation_id": baseline.evaluation_id,
                "same_task_set": baseline.task_set_version == record.task_set_version,
            }
            champion_slices = baseline.slice_metrics or {}
            for slice_name, values in sorted((record.slice_metrics or {}).items()):
                before = champion_slices.get(slice_name, {}).get(self.slice_metric)
                after = values.get(self.slice_metric)
                if before is None or after is None:
                    continue
                drop = float(before) - float(after)
                regressed = drop > self.max_slice_regression + 1e-12
                comparisons.append(
                    {
                        "evaluator": name,
                        "slice": slice_name,
                        "champion": before,
                        "candidate": after,
                        "regressed": regressed,
                    }
                )
                if regressed:
                    reasons.append(
                        f"slice {slice_name} of {name} regressed from {float(before):.3f} to "
                        f"{float(after):.3f} (> {self.max_slice_regression:g}) against {against}"
                    )
        return comparisons, used


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict: ``reasons`` are plain sentences naming what failed (empty on a pass)."""

    passed: bool
    reasons: list[str]
    details: dict[str, Any]
    evaluation_ids: list[str]

    def summary(self) -> str:
        """One paragraph for the promotion row: the reasons, or what passed."""
        if not self.passed:
            shown = self.reasons[:_REASONS_SHOWN]
            if len(self.reasons) > _REASONS_SHOWN:
                # A broken model regresses every slice; the gate details keep the full list.
                shown.append(f"and {len(self.reasons) - _REASONS_SHOWN} more (see gate details)")
            return "Refused: " + "; ".join(shown) + "."
        checks = self.details.get("thresholds", [])
        compared = self.details.get("slice_comparisons", [])
        champion = self.details.get("champion_version")
        against = (
            f"no slice of {len(compared)} regressed more than "
            f"{self.details['gate']['max_slice_regression']:g} against champion version {champion}"
            if champion
            else "no champion to compare slices against"
        )
        return (
            f"Passed: {len(self.evaluation_ids)} evaluations with full provenance "
            f"({', '.join(self.details.get('evaluations', {}))}), "
            f"{len(checks)} thresholds met, {against}."
        )


def decide(
    checkpoint_manifest_sha256: str,
    evaluations: Iterable[EvaluationRecord],
    champion_evaluations: Iterable[EvaluationRecord],
    required: Sequence[str],
    *,
    champion_version: str | None = None,
    gate: QualityGate | None = None,
) -> GateDecision:
    """:meth:`QualityGate.decide` with the default gate unless one is given."""
    return (gate or QualityGate()).decide(
        checkpoint_manifest_sha256,
        evaluations,
        champion_evaluations,
        required,
        champion_version=champion_version,
    )


def newest_complete(
    evaluations: Iterable[EvaluationRecord], checkpoint_manifest_sha256: str
) -> dict[str, EvaluationRecord]:
    """The newest ``complete`` evaluation per evaluator for exactly this checkpoint manifest."""
    newest: dict[str, EvaluationRecord] = {}
    for record in evaluations:
        if record.checkpoint_manifest_sha256 != checkpoint_manifest_sha256:
            continue
        if record.status != EvaluationStatus.COMPLETE:
            continue
        current = newest.get(record.evaluator_name)
        if current is None or _order(record) > _order(current):
            newest[record.evaluator_name] = record
    return newest


def _order(record: EvaluationRecord) -> tuple[Any, ...]:
    return (record.started_at, record.ended_at or record.started_at, record.evaluation_id)


def _champion_baseline(
    champion_evaluations: list[EvaluationRecord], evaluator_name: str, task_set_version: str
) -> EvaluationRecord | None:
    # The champion re-evaluated on the candidate's task set is the fair baseline; failing that,
    # its newest evaluation (the comparison is then across task sets, and details say so).
    mine = [
        r
        for r in champion_evaluations
        if r.evaluator_name == evaluator_name and r.status == EvaluationStatus.COMPLETE
    ]
    if not mine:
        return None
    same = [r for r in mine if r.task_set_version == task_set_version]
    return max(same or mine, key=_order)
