"""The quality gate as a pure function of ledger rows: what counts, and why it refuses."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from pipeline.evaluation.evaluators import EVALUATORS
from pipeline.ledger import EvaluationRecord
from pipeline.promotion import QualityGate, decide, newest_complete
from pipeline.promotion.comparison import PairedOutcomes

SHA = "a" * 64
OTHER_SHA = "b" * 64
REQUIRED = ["holdout_accuracy", "noise_robustness"]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
OLD_VERSION = "src:sha256:0123456789abcdef"  # what the evaluator's code digested to before


def _evaluation(
    evaluator: str = "holdout_accuracy",
    *,
    sha: str = SHA,
    minutes: int = 0,
    status: str = "complete",
    accuracy: float = 0.97,
    slices: dict[str, float] | None = None,
    task_set: str = "task-v1",
    **overrides: Any,
) -> EvaluationRecord:
    metrics = {"accuracy": accuracy} if evaluator == "holdout_accuracy" else {"accuracy@0.1": 0.95}
    slices = slices or {"class=3": 0.97}
    values: dict[str, Any] = {
        "evaluation_id": f"eval-{evaluator}-{sha[:4]}-{minutes}-{status}",
        "run_id": "run",
        "attempt_no": 1,
        "checkpoint_path": f"/ck/{sha[:4]}",
        "checkpoint_manifest_sha256": sha,
        "evaluator_name": evaluator,
        # Rows count only at the registry's current version of their evaluator.
        "evaluator_version": EVALUATORS[evaluator].version,
        "evaluator_env_digest": "env:sha256:00",
        "task_set_version": task_set,
        "decoding_params": {"decision": "argmax", "temperature": 1.0, "batch_size": 256},
        "judge_model": "not applicable",
        "rubric_version": "not applicable",
        "status": status,
        "started_at": T0 + timedelta(minutes=minutes),
        "metrics": metrics if status == "complete" else None,
        "slice_metrics": {k: {"accuracy": v, "support": 36.0} for k, v in slices.items()}
        if status == "complete"
        else None,
        "raw_outputs_uri": "file:///a/raw_outputs.parquet" if status == "complete" else None,
        "failures_uri": "file:///a/failures.json" if status == "complete" else None,
        "mlflow_run_id": "0" * 32,
    }
    values.update(overrides)
    return EvaluationRecord(**values)


def _outcomes(record: EvaluationRecord) -> PairedOutcomes:
    """Per-example outcomes that agree with the row's accuracy: its first examples right."""
    n = 1000
    correct = np.arange(n) < round(record.metrics["accuracy"] * n)
    return PairedOutcomes(record.evaluation_id, "0" * 64, tuple(range(n)), correct)


def _both(**kw: Any) -> list[EvaluationRecord]:
    return [_evaluation("holdout_accuracy", **kw), _evaluation("noise_robustness", **kw)]


def test_complete_evaluations_meeting_thresholds_pass() -> None:
    decision = decide(SHA, _both(), [], REQUIRED)
    assert decision.passed and decision.reasons == []
    assert decision.summary().startswith("Passed: 2 evaluations")
    assert sorted(decision.evaluation_ids) == sorted(e.evaluation_id for e in _both())


def test_only_the_newest_complete_evaluation_per_evaluator_counts() -> None:
    old_bad = _evaluation(accuracy=0.5, minutes=0)
    new_good = _evaluation(accuracy=0.97, minutes=5)
    noise = _evaluation("noise_robustness")
    assert newest_complete([new_good, old_bad, noise], SHA) == {
        "holdout_accuracy": new_good,
        "noise_robustness": noise,
    }
    assert decide(SHA, [old_bad, new_good, noise], [], REQUIRED).passed
    # And the other way round: a newer complete evaluation below threshold refuses.
    refused = decide(SHA, [new_good, _evaluation(accuracy=0.81, minutes=7), noise], [], REQUIRED)
    assert refused.reasons == ["holdout_accuracy.accuracy 0.8100 < 0.9"]


def test_a_newer_failed_evaluation_cancels_an_older_complete_one() -> None:
    new_good = _evaluation(accuracy=0.97, minutes=5)
    newer_failed = _evaluation(status="failed", minutes=9, termination_reason="evaluator_crash")
    noise = _evaluation("noise_robustness")
    assert newest_complete([new_good, newer_failed, noise], SHA) == {"noise_robustness": noise}
    decision = decide(SHA, [new_good, newer_failed, noise], [], REQUIRED)
    assert not decision.passed
    assert decision.reasons[0].startswith(
        f"evaluator holdout_accuracy has no complete evaluation for checkpoint {SHA[:12]}: "
        f"the newest at its current version {EVALUATORS['holdout_accuracy'].version}, "
        f"{newer_failed.evaluation_id}, is failed"
    )


def test_an_old_version_complete_and_a_current_version_failure_is_refused() -> None:
    old_pass = _evaluation(evaluator_version=OLD_VERSION, minutes=0)
    current_failed = _evaluation(status="failed", minutes=5, termination_reason="evaluator_crash")
    decision = decide(
        SHA, [old_pass, current_failed, _evaluation("noise_robustness")], [], REQUIRED
    )
    assert not decision.passed
    assert "evaluator holdout_accuracy has no complete evaluation" in decision.reasons[0]
    assert current_failed.evaluation_id in decision.reasons[0]
    assert old_pass.evaluation_id not in decision.evaluation_ids


def test_evaluations_at_an_old_evaluator_version_do_not_count() -> None:
    old_pass = _evaluation(evaluator_version=OLD_VERSION)
    decision = decide(SHA, [old_pass, _evaluation("noise_robustness")], [], REQUIRED)
    assert not decision.passed
    current = EVALUATORS["holdout_accuracy"].version
    assert decision.reasons == [
        f"evaluator holdout_accuracy has no complete evaluation for checkpoint {SHA[:12]} at "
        f"its current version {current} (only at other versions); re-evaluate the checkpoint"
    ]
    # Versions can be given explicitly, as a caller pinning a registry would.
    pinned = {
        "holdout_accuracy": OLD_VERSION,
        "noise_robustness": EVALUATORS["noise_robustness"].version,
    }
    assert decide(
        SHA, [old_pass, _evaluation("noise_robustness")], [], REQUIRED, evaluator_versions=pinned
    ).passed


def test_evaluations_on_another_task_set_do_not_count_when_the_task_set_is_known() -> None:
    rows = [_evaluation(task_set="task-v0"), _evaluation("noise_robustness", task_set="task-v1")]
    assert decide(SHA, rows, [], REQUIRED).passed  # task set unknown: not filtered
    decision = decide(SHA, rows, [], REQUIRED, task_set_version="task-v1")
    assert not decision.passed
    assert "evaluator holdout_accuracy has no complete evaluation" in decision.reasons[0]
    assert "on task set task-v1" in decision.reasons[0]


def test_a_champion_without_a_baseline_for_a_required_evaluator_is_refused() -> None:
    # The champion was evaluated by holdout_accuracy only: noise slices cannot be compared.
    champion = [_evaluation(sha=OTHER_SHA)]
    decision = decide(SHA, _both(), champion, REQUIRED, champion_version="7", outcomes=_outcomes)
    assert not decision.passed
    assert decision.reasons == [
        "champion version 7 has no complete noise_robustness evaluation to compare slices "
        "against; re-evaluate the champion, then promote again"
    ]
    # With no evaluations of the champion at all, every required evaluator is named.
    bare = decide(SHA, _both(), [], REQUIRED, champion_version="7")
    assert len(bare.reasons) == 2 and "no slice of 0 regressed" not in bare.summary()
    # No champion at all: nothing to compare against, and that is said, not refused.
    assert (
        decide(SHA, _both(), [], REQUIRED)
        .summary()
        .endswith("no champion to compare slices against.")
    )


def test_evaluations_of_another_checkpoint_do_not_count() -> None:
    decision = decide(SHA, [*_both(sha=OTHER_SHA), _evaluation("holdout_accuracy")], [], REQUIRED)
    assert not decision.passed
    assert decision.reasons == [
        f"evaluator noise_robustness has no complete evaluation for checkpoint {SHA[:12]}"
    ]


def test_a_failed_evaluation_is_no_evaluation() -> None:
    failed = _evaluation("noise_robustness", status="failed", termination_reason="evaluator_crash")
    decision = decide(SHA, [_evaluation("holdout_accuracy"), failed], [], REQUIRED)
    assert decision.reasons[0].startswith(
        f"evaluator noise_robustness has no complete evaluation for checkpoint {SHA[:12]}: "
        f"the newest at its current version"
    )
    assert failed.evaluation_id in decision.reasons[0] and len(decision.reasons) == 1


def test_missing_provenance_is_refused_naming_the_fields_and_the_evaluation() -> None:
    holdout = _evaluation(task_set_version="", failures_uri=None)
    decision = decide(SHA, [holdout, _evaluation("noise_robustness")], [], REQUIRED)
    assert decision.reasons == [
        f"missing provenance fields task_set_version, failures_uri on evaluation "
        f"{holdout.evaluation_id} (holdout_accuracy)"
    ]


def test_slice_regression_against_the_champion_is_named() -> None:
    champion = _both(sha=OTHER_SHA, slices={"class=3": 0.97, "class=4": 1.0})
    candidate = _both(slices={"class=3": 0.91, "class=4": 0.98})
    decision = decide(SHA, candidate, champion, REQUIRED, champion_version="2", outcomes=_outcomes)
    assert decision.reasons == [
        "slice class=3 of holdout_accuracy regressed from 0.970 to 0.910 (> 0.03) "
        "against champion version 2",
        "slice class=3 of noise_robustness regressed from 0.970 to 0.910 (> 0.03) "
        "against champion version 2",
    ]
    # class=4 fell by 0.02: within tolerance, compared and recorded, not refused.
    compared = {(c["evaluator"], c["slice"]): c for c in decision.details["slice_comparisons"]}
    assert compared[("holdout_accuracy", "class=4")]["regressed"] is False


def test_slices_compare_against_the_champion_on_the_same_task_set_when_it_has_one() -> None:
    # The champion was evaluated on the old task set (0.99) and re-evaluated on the new (0.95).
    champion = [
        _evaluation(sha=OTHER_SHA, slices={"class=3": 0.99}, task_set="task-v0", minutes=1),
        _evaluation(sha=OTHER_SHA, slices={"class=3": 0.95}, task_set="task-v1", minutes=0),
        _evaluation("noise_robustness", sha=OTHER_SHA),
    ]
    candidate = [_evaluation(slices={"class=3": 0.94}), _evaluation("noise_robustness")]
    decision = decide(SHA, candidate, champion, REQUIRED, champion_version="3", outcomes=_outcomes)
    assert decision.passed, decision.reasons
    used = decision.details["champion_evaluations"]["holdout_accuracy"]
    assert used == {"evaluation_id": champion[1].evaluation_id, "same_task_set": True}


def test_thresholds_and_tolerance_are_configurable() -> None:
    strict = QualityGate(min_metrics={"holdout_accuracy.accuracy": 0.99}, max_slice_regression=0)
    champion = _both(sha=OTHER_SHA, slices={"class=3": 0.98})
    decision = strict.decide(
        SHA, _both(slices={"class=3": 0.97}), champion, REQUIRED, outcomes=_outcomes
    )
    assert decision.reasons == [
        "holdout_accuracy.accuracy 0.9700 < 0.99",
        "slice class=3 of holdout_accuracy regressed from 0.980 to 0.970 (> 0) "
        "against the champion",
        "slice class=3 of noise_robustness regressed from 0.980 to 0.970 (> 0) "
        "against the champion",
    ]
    assert decision.details["gate"]["min_metrics"] == {"holdout_accuracy.accuracy": 0.99}


def test_a_threshold_on_a_metric_the_evaluation_lacks_is_refused() -> None:
    gate = QualityGate(min_metrics={"holdout_accuracy.macro_f1": 0.9})
    holdout = _evaluation()
    decision = gate.decide(SHA, [holdout, _evaluation("noise_robustness")], [], REQUIRED)
    assert decision.reasons == [
        f"holdout_accuracy.macro_f1 is missing from evaluation {holdout.evaluation_id}"
    ]


def test_long_refusals_keep_the_summary_readable_and_the_details_complete() -> None:
    slices = {f"class={k}": 0.99 for k in range(10)}
    champion = _both(sha=OTHER_SHA, slices=slices)
    candidate = _both(slices={k: 0.1 for k in slices})
    decision = decide(SHA, candidate, champion, REQUIRED, champion_version="1", outcomes=_outcomes)
    assert len(decision.reasons) == 20 and decision.details["reasons"] == decision.reasons
    assert decision.summary().endswith("and 14 more (see gate details).")


def test_decision_records_are_plain_json() -> None:
    import json

    decision = decide(SHA, _both(), _both(sha=OTHER_SHA), REQUIRED, champion_version="1")
    assert json.loads(json.dumps(decision.details)) == decision.details
    assert dataclasses.asdict(QualityGate())["max_slice_regression"] == 0.03
