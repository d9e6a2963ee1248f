"""The quality gate: which evaluations count for a checkpoint, and whether they are good enough.

A pure function of ledger rows and the per-example outcomes they vouch for (raw outputs whose
sha256 the ledger recorded), so every refusal can be re-derived from the ledger and those files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.digests import short_digest
from pipeline.evaluation.base import NOT_APPLICABLE
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
    # Metrics that must not exceed a ceiling (``<evaluator>.<metric>``: bits per byte, say).
    max_metrics: Mapping[str, float] = field(default_factory=dict)
    # False when the slice metric falls as a model improves (bits per byte per topic).
    slice_higher_is_better: bool = True
    # Per evaluator, the dotted fields its ``provenance`` must hold (empty: the row's columns
    # are its provenance, as for the digits evaluators).
    required_provenance: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # Per evaluator, the fields that truly do not apply to it, with the reason: only these may
    # be "not applicable" in its row or provenance; anywhere else that value refuses.
    not_applicable: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # The evaluator whose overlap with the training snapshot is checked, and the highest
    # overlap fraction the gate accepts (it enforces its own, whatever a row recorded).
    contamination_evaluator: str | None = None
    max_contamination: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "min_metrics": dict(self.min_metrics),
            "max_metrics": dict(self.max_metrics),
            "max_slice_regression": self.max_slice_regression,
            "slice_metric": self.slice_metric,
            "slice_higher_is_better": self.slice_higher_is_better,
            "headline": asdict(self.headline),
            "required_provenance": {k: list(v) for k, v in self.required_provenance.items()},
            "not_applicable": {k: dict(v) for k, v in self.not_applicable.items()},
            "contamination_evaluator": self.contamination_evaluator,
            "max_contamination": self.max_contamination,
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
            declared = self.not_applicable.get(name, {})
            missing = [f for f in record.missing_provenance() if f not in declared]
            if missing:
                reasons.append(
                    f"missing provenance fields {', '.join(missing)} on evaluation "
                    f"{record.evaluation_id} ({name})"
                )
        reasons += self.recorded_provenance_problems(counted)
        contamination = self._check_contamination(counted, required, reasons)

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
        for key, ceiling in sorted(self.max_metrics.items()):
            evaluator_name, _, metric = key.partition(".")
            record = counted.get(evaluator_name)
            value = None if record is None else (record.metrics or {}).get(metric)
            passed = value is not None and float(value) <= ceiling
            checks.append(
                {
                    "metric": key,
                    "threshold": ceiling,
                    "value": value,
                    "passed": passed,
                    "needs": "<=",
                }
            )
            if record is None:
                if evaluator_name not in required:
                    reasons.append(
                        f"{key} cannot be checked: evaluator {evaluator_name} has no complete "
                        f"evaluation for checkpoint {sha12}"
                    )
            elif value is None:
                reasons.append(f"{key} is missing from evaluation {record.evaluation_id}")
            elif not passed:
                reasons.append(f"{key} {float(value):.4f} > {ceiling:g}")

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
            "contamination": contamination,
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

    def recorded_provenance_problems(self, counted: dict[str, EvaluationRecord]) -> list[str]:
        """Each evaluation's recorded provenance: every field its evaluator requires present,
        "not applicable" only where the evaluator states it does not apply, one weights digest
        across the checkpoint's evaluations."""
        reasons: list[str] = []
        digests: dict[str, list[str]] = {}
        for name, record in sorted(counted.items()):
            fields = self.required_provenance.get(name)
            if not fields:
                continue
            provenance = record.provenance or {}
            declared = self.not_applicable.get(name, {})
            absent = [f for f in fields if _dotted(provenance, f) in (_ABSENT, None, "", {})]
            if absent:
                reasons.append(
                    f"evaluation {record.evaluation_id} ({name}) is incomplete: its provenance "
                    f"lacks {', '.join(absent)}"
                )
            columns = {
                "judge_model": record.judge_model,
                "rubric_version": record.rubric_version,
                "decoding_params": record.decoding_params,
            }
            claimed = [
                path
                for path in (*_not_applicable_leaves(columns), *_not_applicable_leaves(provenance))
                if not _declared(path, declared)
            ]
            if claimed:
                reasons.append(
                    f"evaluation {record.evaluation_id} ({name}) records "
                    f"{', '.join(sorted(set(claimed)))} as {NOT_APPLICABLE}, but {name} states "
                    f"only {', '.join(sorted(declared)) or 'nothing'} does not apply"
                )
            recorded_version = provenance.get("evaluator_version")
            if recorded_version not in (None, record.evaluator_version):
                reasons.append(
                    f"evaluation {record.evaluation_id} ({name}) was recorded at evaluator "
                    f"version {record.evaluator_version} but its provenance says {recorded_version}"
                )
            if isinstance(provenance.get("model_digest"), str):
                digests.setdefault(provenance["model_digest"], []).append(record.evaluation_id)
        if len(digests) > 1:
            shown = "; ".join(
                f"{short_digest(d)}: {', '.join(ids)}" for d, ids in sorted(digests.items())
            )
            reasons.append(f"the checkpoint's evaluations evaluated different weights ({shown})")
        return reasons

    def _check_contamination(
        self,
        counted: dict[str, EvaluationRecord],
        required: Sequence[str],
        reasons: list[str],
    ) -> dict[str, Any] | None:
        """Refuse an evaluation set that overlaps the training snapshot above the gate's
        threshold (or that its own check found contaminated); the figure in the reason."""
        name = self.contamination_evaluator
        if name is None:
            return None
        record = counted.get(name)
        if record is None:
            if name not in required:
                reasons.append(f"no complete {name} evaluation: contamination was not checked")
            return None
        provenance = record.provenance or {}
        overlap = provenance.get("overlap_fraction", (record.metrics or {}).get("overlap_fraction"))
        threshold = self.max_contamination
        if threshold is None:
            threshold = provenance.get("threshold")
        if not isinstance(overlap, int | float) or not isinstance(threshold, int | float):
            reasons.append(
                f"evaluation {record.evaluation_id} ({name}) records no overlap fraction and "
                f"threshold: contamination cannot be judged"
            )
            return None
        over = float(overlap) > float(threshold) + 1e-12
        contaminated = over or bool(provenance.get("contaminated"))
        summary = provenance.get("summary") or ""
        if contaminated:
            reasons.append(
                f"the evaluation set is contaminated: overlap {float(overlap):.3f} with training "
                f"snapshot {provenance.get('training_snapshot_id', '(unrecorded)')} against the "
                f"threshold {float(threshold):g} (evaluation {record.evaluation_id}: {summary})"
            )
        return {
            "evaluation_id": record.evaluation_id,
            "overlap_fraction": float(overlap),
            "threshold": float(threshold),
            "recorded_threshold": provenance.get("threshold"),
            "training_snapshot_id": provenance.get("training_snapshot_id"),
            "contaminated": contaminated,
            "summary": summary,
        }

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
                if not self.slice_higher_is_better:
                    drop = -drop  # bits per byte that rose
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
    from pipeline.evaluation.evaluators import evaluator_versions

    return evaluator_versions()


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT: Any = _Absent()


def _dotted(tree: Any, dotted: str) -> Any:
    value = tree
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    return value


def _not_applicable_leaves(tree: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every value in ``tree`` that says "not applicable"."""
    if isinstance(tree, dict):
        found: list[str] = []
        for key, value in tree.items():
            if key == "not_applicable":
                continue  # the evaluator's own statement of what does not apply, with reasons
            found += _not_applicable_leaves(value, f"{prefix}{key}.")
        return found
    return [prefix.rstrip(".")] if tree == NOT_APPLICABLE else []


def _declared(path: str, declared: Mapping[str, str]) -> bool:
    # "decoding_params" declared covers "decoding_params.decision" too.
    return any(path == name or path.startswith(name + ".") for name in declared)


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
