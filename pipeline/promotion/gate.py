"""The quality gate: which evaluations count for a checkpoint, and whether they are good enough.

A pure function of ledger rows and the per-example outcomes they vouch for (raw outputs whose
sha256 the ledger recorded), so every refusal can be re-derived from the ledger and those files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.ledger.records import EvaluationRecord
from pipeline.promotion.comparison import (
    HeadlineSettings,
    OutcomesError,
    OutcomesLoader,
    compare,
    headline_sentence,
)
from pipeline.states import EvaluationStatus

_REASONS_SHOWN = 6


def _default_min_metrics() -> dict[str, float]:
    return {"holdout_accuracy.accuracy": 0.90, "noise_robustness.accuracy@0.1": 0.80}


@dataclass(frozen=True)
class QualityGate:
    """Thresholds a candidate must meet, and how far it may fall below the champion.

    ``min_metrics`` keys are ``<evaluator>.<metric>``. Slices are compared on
    ``slice_metric`` for every slice both the candidate and the champion have. The headline
    metric is compared example by example on the same task set (``headline``): the candidate
    may be worse by at most ``headline.margin``, and not significantly worse
    (:func:`pipeline.promotion.comparison.compare`).
    """

    min_metrics: Mapping[str, float] = field(default_factory=_default_min_metrics)
    max_slice_regression: float = 0.03
    slice_metric: str = "accuracy"
    headline: HeadlineSettings = field(default_factory=HeadlineSettings)

    def as_dict(self) -> dict[str, Any]:
        return {
            "min_metrics": dict(self.min_metrics),
            "max_slice_regression": self.max_slice_regression,
            "slice_metric": self.slice_metric,
            "headline": asdict(self.headline),
        }

    def decide(
        self,
        checkpoint_manifest_sha256: str,
        evaluations: Iterable[EvaluationRecord],
        champion_evaluations: Iterable[EvaluationRecord] = (),
        required: Sequence[str] = (),
        *,
        champion_version: str | None = None,
        evaluator_versions: Mapping[str, str] | None = None,
        task_set_version: str | None = None,
        outcomes: OutcomesLoader | None = None,
    ) -> GateDecision:
        """Decide on the checkpoint with manifest ``checkpoint_manifest_sha256``.

        Per evaluator, only rows for exactly that manifest at the evaluator's current version
        (``evaluator_versions``, default: the registry's) and, if given, ``task_set_version``
        count; the newest of them must be ``complete``: a newer failure blocks an older pass.
        Champion evaluations are matched per evaluator, preferring the same task set version.
        A champion (``champion_version`` or evaluations of it) with no evaluation to compare
        a required evaluator against refuses: an unshown comparison is no comparison.
        With a champion, ``outcomes`` loads each evaluation's per-example outcomes for the
        headline comparison; without it (or without a champion evaluation of the headline
        evaluator at the candidate's version and task set) the comparison is not made, and
        that refuses.
        """
        sha12 = checkpoint_manifest_sha256[:12]
        reasons: list[str] = []
        evaluations = list(evaluations)  # read twice below
        versions = _current_versions(evaluator_versions)
        newest = _newest_current(
            evaluations, checkpoint_manifest_sha256, versions, task_set_version
        )
        counted = {n: r for n, r in newest.items() if r.status == EvaluationStatus.COMPLETE}

        for name in required:
            if name in counted:
                continue
            reason = f"evaluator {name} has no complete evaluation for checkpoint {sha12}"
            at = f"its current version {versions.get(name, '(not registered)')}"
            if task_set_version:
                at += f" on task set {task_set_version[:12]}"
            if name in newest:
                failed = newest[name]
                reason += (
                    f": the newest at {at}, {failed.evaluation_id}, is {failed.status} "
                    f"(an older complete one does not outlive it)"
                )
            elif _evaluated_elsewhere(evaluations, checkpoint_manifest_sha256, name):
                reason += f" at {at} (only at other versions); re-evaluate the checkpoint"
            reasons.append(reason)
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

        champion_rows = list(champion_evaluations)
        headline = None
        if champion_version is not None or champion_rows:
            headline = self._compare_headline(
                counted, champion_rows, champion_version, required, outcomes, reasons
            )
        comparisons, champion_used = self._compare_slices(
            counted, champion_rows, champion_version, reasons
        )
        if champion_version is not None or champion_rows:
            against = f"champion version {champion_version}" if champion_version else "the champion"
            for name in required:
                if name in counted and name not in champion_used:
                    reasons.append(
                        f"{against} has no complete {name} evaluation to compare slices "
                        f"against; re-evaluate the champion, then promote again"
                    )
        details = {
            "checkpoint_manifest_sha256": checkpoint_manifest_sha256,
            "required": list(required),
            "evaluator_versions": {name: versions.get(name) for name in required},
            "task_set_version": task_set_version,
            "evaluations": {name: r.evaluation_id for name, r in sorted(counted.items())},
            # What the evaluated checkpoint trained through (spikes, skips, rollbacks).
            "training_health": next(
                (r.training_health for _, r in sorted(counted.items()) if r.training_health),
                None,
            ),
            "thresholds": checks,
            "champion_version": champion_version,
            "champion_evaluations": champion_used,
            "headline_comparison": headline,
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

    def _compare_headline(
        self,
        counted: dict[str, EvaluationRecord],
        champion_evaluations: list[EvaluationRecord],
        champion_version: str | None,
        required: Sequence[str],
        outcomes: OutcomesLoader | None,
        reasons: list[str],
    ) -> dict[str, Any]:
        settings = self.headline
        name = settings.evaluator
        metric = f"{name}.{settings.metric}"
        against = f"champion version {champion_version}" if champion_version else "the champion"

        def not_compared(reason: str, *, refuse: bool = True) -> dict[str, Any]:
            result = {"compared": False, "metric": metric, "reason": reason}
            if refuse:
                reasons.append(headline_sentence(result, against))
            return result

        candidate = counted.get(name)
        if candidate is None:
            # A required evaluator without a complete evaluation is refused above already.
            return not_compared(
                f"the candidate has no complete {name} evaluation", refuse=name not in required
            )
        mine = [
            r
            for r in champion_evaluations
            if r.evaluator_name == name and r.status == EvaluationStatus.COMPLETE
        ]
        same = [
            r
            for r in mine
            if r.task_set_version == candidate.task_set_version
            and r.evaluator_version == candidate.evaluator_version
        ]
        if not same:
            if not mine:
                # Said once, by the slice comparison's refusal, when the evaluator is required.
                return not_compared(
                    f"{against} has no complete {name} evaluation", refuse=name not in required
                )
            return not_compared(
                f"{against} has no complete {name} evaluation on the candidate's task set "
                f"{candidate.task_set_version[:12]} at version {candidate.evaluator_version} "
                f"(only on {_sets_and_versions(mine)}); the same examples must be compared"
            )
        baseline = max(same, key=_order)
        if outcomes is None:
            return not_compared("no per-example outcomes were given to the gate")
        try:
            result = compare(outcomes(candidate), outcomes(baseline), settings)
        except OutcomesError as exc:
            return not_compared(str(exc))
        result["task_set_version"] = candidate.task_set_version
        result["evaluator_version"] = candidate.evaluator_version
        if not result["passed"]:
            reasons.append(headline_sentence(result, against))
        return result

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
        headline = self.details.get("headline_comparison")
        if headline:
            who = f"champion version {champion}" if champion else "the champion"
            against += "; " + headline_sentence(headline, who)
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
    evaluator_versions: Mapping[str, str] | None = None,
    task_set_version: str | None = None,
    outcomes: OutcomesLoader | None = None,
) -> GateDecision:
    """:meth:`QualityGate.decide` with the default gate unless one is given."""
    return (gate or QualityGate()).decide(
        checkpoint_manifest_sha256,
        evaluations,
        champion_evaluations,
        required,
        champion_version=champion_version,
        evaluator_versions=evaluator_versions,
        task_set_version=task_set_version,
        outcomes=outcomes,
    )


def newest_complete(
    evaluations: Iterable[EvaluationRecord],
    checkpoint_manifest_sha256: str,
    *,
    evaluator_versions: Mapping[str, str] | None = None,
    task_set_version: str | None = None,
) -> dict[str, EvaluationRecord]:
    """Per evaluator, its newest evaluation of exactly this manifest that counts, if complete.

    Only rows at the evaluator's current version (``evaluator_versions``, default: the
    registry's) and, if given, on ``task_set_version`` are considered; when the newest of them
    failed, the evaluator has none (an older pass does not outlive a newer failure).
    """
    versions = _current_versions(evaluator_versions)
    newest = _newest_current(evaluations, checkpoint_manifest_sha256, versions, task_set_version)
    return {n: r for n, r in newest.items() if r.status == EvaluationStatus.COMPLETE}


def _current_versions(evaluator_versions: Mapping[str, str] | None) -> Mapping[str, str]:
    if evaluator_versions is not None:
        return evaluator_versions
    # A changed evaluator is a new one (its version digests its code): only its own rows count.
    from pipeline.evaluation.evaluators import EVALUATORS

    return {name: evaluator.version for name, evaluator in EVALUATORS.items()}


def _newest_current(
    evaluations: Iterable[EvaluationRecord],
    checkpoint_manifest_sha256: str,
    versions: Mapping[str, str],
    task_set_version: str | None,
) -> dict[str, EvaluationRecord]:
    newest: dict[str, EvaluationRecord] = {}
    for record in evaluations:
        if record.checkpoint_manifest_sha256 != checkpoint_manifest_sha256:
            continue
        if record.evaluator_version != versions.get(record.evaluator_name):
            continue
        if task_set_version and record.task_set_version not in ("", task_set_version):
            continue  # an empty one is refused as missing provenance instead
        current = newest.get(record.evaluator_name)
        if current is None or _order(record) > _order(current):
            newest[record.evaluator_name] = record
    return newest


def _evaluated_elsewhere(
    evaluations: Iterable[EvaluationRecord], checkpoint_manifest_sha256: str, name: str
) -> bool:
    return any(
        r.evaluator_name == name
        and r.checkpoint_manifest_sha256 == checkpoint_manifest_sha256
        and r.status == EvaluationStatus.COMPLETE
        for r in evaluations
    )


def _order(record: EvaluationRecord) -> tuple[Any, ...]:
    return (record.started_at, record.ended_at or record.started_at, record.evaluation_id)


def _sets_and_versions(records: Iterable[EvaluationRecord]) -> str:
    pairs = sorted({(r.task_set_version[:12], r.evaluator_version) for r in records})
    return ", ".join(f"task set {t} at version {v}" for t, v in pairs)


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
