"""The headline comparison: a candidate must be shown no worse than the champion, example by
example, on the same held-out examples. Real checkpoints, real evaluations, MLflow on SQLite."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from pipeline.data import read_snapshot_frame
from pipeline.evaluation import EvalSet, run_evaluation
from pipeline.explain import explain
from pipeline.ledger import EvaluationRecord, Ledger
from pipeline.promotion import champion_version
from pipeline.promotion.comparison import (
    HeadlineSettings,
    PairedOutcomes,
    compare,
    load_outcomes,
)
from pipeline.states import PromotionDecision
from pipeline.trainer.model import build_model
from tests.evaluation_support import (
    MODEL_CONFIG,
    World,
    open_ledger,
    shared_world,
    write_checkpoint,
)
from tests.promotion_support import evaluate_checkpoint, nudged, promote_checkpoint

RUNS = ("run-champion", "run-candidate")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return shared_world(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def eval_set(world: World) -> EvalSet:
    return EvalSet.from_snapshot(world.snapshot)


@pytest.fixture(scope="module")
def two_worse(world: World, eval_set: EvalSet) -> dict[str, torch.Tensor]:
    """The trained weights, two held-out examples worse and no other prediction changed."""
    return worse_by(world.good_state, eval_set, examples=2)


def _logits(state: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    model = build_model(MODEL_CONFIG)
    model.load_state_dict(state)
    model.eval()
    with torch.inference_mode():
        return model(images.float())


def worse_by(
    state: dict[str, torch.Tensor], eval_set: EvalSet, *, examples: int
) -> dict[str, torch.Tensor]:
    """``state`` with the output bias lowered class by class, each time just enough to lose the
    least confident right answer of that class, until exactly ``examples`` right answers are
    wrong: one per class at most, so no class slice drops by more than one example. Smallest
    nudges first, so the noisy inputs' predictions move least."""
    labels = eval_set.labels
    logits = _logits(state, eval_set.images)
    before = logits.argmax(1)
    spoiled = copy.deepcopy(state)
    bias = [k for k in spoiled if k.endswith(".bias")][-1]  # the output layer's
    classes = range(int(labels.max()) + 1)
    for label in sorted(classes, key=lambda k: _nudge(logits, labels, k)):
        trial = copy.deepcopy(spoiled)
        trial[bias][label] -= _nudge(_logits(spoiled, eval_set.images), labels, label)
        changed = _logits(trial, eval_set.images).argmax(1) != before
        if bool(((before == labels) & changed).sum() == changed.sum()):  # only right → wrong
            spoiled = trial
            if int(changed.sum()) == examples:
                return spoiled
    raise AssertionError(f"no bias change loses exactly {examples} examples")


def _nudge(logits: torch.Tensor, labels: torch.Tensor, label: int) -> float:
    """Halfway between the two smallest margins of ``label``'s right answers: loses one."""
    runner_up = logits.topk(2, dim=1).values[:, 1]
    right = (logits.argmax(1) == label) & (labels == label)
    margins = (logits[:, label] - runner_up)[right].sort().values
    return float(margins[0] + margins[1]) / 2


def _evaluate_on(
    world: World, ledger: Ledger, checkpoint: Path, run_id: str, eval_set: EvalSet
) -> list[EvaluationRecord]:
    """As ``evaluate_checkpoint``, on ``eval_set`` instead of the snapshot's eval split."""
    return [
        run_evaluation(
            checkpoint_dir=checkpoint, snapshot=eval_set, ledger=ledger,
            settings=world.settings, evaluator=name, run_id=run_id, attempt_no=1,
        )
        for name in ("holdout_accuracy", "noise_robustness")
    ]  # fmt: skip


def _crowned(
    world: World, ledger: Ledger, tmp_path: Path, state: dict[str, torch.Tensor], name: str
) -> tuple[Path, list[EvaluationRecord]]:
    """``state`` as version 1 of ``name``: checkpoint of run-champion, evaluated, promoted."""
    checkpoint = write_checkpoint(tmp_path / "champion", state, run_id=RUNS[0])
    evaluations = evaluate_checkpoint(world, ledger, checkpoint, RUNS[0])
    assert promote_checkpoint(world, ledger, checkpoint, RUNS[0], name).model_version == "1"
    return checkpoint, evaluations


def _holdout(evaluations: list[EvaluationRecord]) -> EvaluationRecord:
    return next(e for e in evaluations if e.evaluator_name == "holdout_accuracy")


def _promotion_section(ledger: Ledger, run_id: str) -> str:
    page = explain(ledger, run_id)
    start = page.index("## Promotion")
    end = page.find("\n## ", start + 1)
    return page[start : end if end > 0 else None]


def test_a_candidate_worse_overall_without_a_slice_regression_is_refused(
    world: World, two_worse: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    name = "digits-headline-worse"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, *RUNS)
    _, champion_evaluations = _crowned(world, ledger, tmp_path, world.good_state, name)
    candidate = write_checkpoint(tmp_path / "candidate", two_worse, run_id=RUNS[1])
    evaluations = evaluate_checkpoint(world, ledger, candidate, RUNS[1])

    record = promote_checkpoint(world, ledger, candidate, RUNS[1], name)

    assert record.decision == PromotionDecision.REFUSED, record.reason
    assert str(champion_version(world.settings, name).version) == "1"
    gate = record.gate
    # Every other rule passes: thresholds met, no slice regressed beyond the tolerance.
    assert all(check["passed"] for check in gate["thresholds"])
    assert gate["slice_comparisons"] and not any(s["regressed"] for s in gate["slice_comparisons"])
    headline = gate["headline_comparison"]
    assert len(gate["reasons"]) == 1 and record.reason.startswith("Refused: holdout_accuracy")
    # The numbers come from the two recorded evaluations, paired over the same 359 examples.
    champion_holdout, candidate_holdout = _holdout(champion_evaluations), _holdout(evaluations)
    assert headline["candidate"] == candidate_holdout.metrics["accuracy"]
    assert headline["champion"] == champion_holdout.metrics["accuracy"]
    assert f"{headline['candidate']:.4f}" == "0.9721" and f"{headline['champion']:.4f}" == "0.9777"
    assert headline["n"] == len(EvalSet.from_snapshot(world.snapshot).labels) == 359
    assert (headline["only_champion_correct"], headline["only_candidate_correct"]) == (2, 0)
    assert headline["difference"] == pytest.approx(-2 / 359)
    assert headline["candidate_evaluation_id"] == candidate_holdout.evaluation_id
    assert headline["champion_evaluation_id"] == champion_holdout.evaluation_id
    assert headline["candidate_raw_outputs_sha256"] == candidate_holdout.raw_outputs_sha256
    low, high = headline["interval"]
    assert low < -0.005 <= high <= 0 and headline["margin"] == 0.005
    assert (headline["method"], headline["seed"], headline["resamples"]) == (
        "paired bootstrap", 20_260_101, 10_000,
    )  # fmt: skip
    assert headline["passed"] is False and gate["gate"]["headline"]["margin"] == 0.005
    # Re-derivable: the recorded outputs and the recorded seed give the recorded interval.
    again = compare(
        load_outcomes(candidate_holdout, world.settings),
        load_outcomes(champion_holdout, world.settings),
        HeadlineSettings(seed=headline["seed"], resamples=headline["resamples"]),
    )
    assert again["interval"] == headline["interval"]

    for text in (record.reason, _promotion_section(ledger, RUNS[1])):
        assert "holdout_accuracy.accuracy 0.9721 vs champion version 1's 0.9777" in text
        assert "difference -0.0056" in text and f"[{low:+.4f}, {high:+.4f}]" in text
        assert "n=359 paired examples" in text and "seed 20260101, 10000 resamples" in text
        assert "worse by more than the margin 0.005" in text


def test_an_equal_or_better_candidate_is_promoted_with_the_comparison_recorded(
    world: World, two_worse: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    from assets.promotion import promotion_metadata

    name = "digits-headline-better"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, *RUNS)
    _crowned(world, ledger, tmp_path, two_worse, name)
    candidate = write_checkpoint(tmp_path / "candidate", world.good_state, run_id=RUNS[1])
    evaluate_checkpoint(world, ledger, candidate, RUNS[1])

    record = promote_checkpoint(world, ledger, candidate, RUNS[1], name)

    assert record.decision == PromotionDecision.PROMOTED, record.reason
    assert (record.model_version, record.previous_champion_version) == ("2", "1")
    headline = record.gate["headline_comparison"]
    assert headline["passed"] is True and headline["difference"] == pytest.approx(2 / 359)
    low, high = headline["interval"]
    assert -0.005 <= low <= 0 < high
    sentence = (
        f"holdout_accuracy.accuracy 0.9777 vs champion version 1's 0.9721: difference +0.0056, "
        f"95% paired bootstrap interval [{low:+.4f}, {high:+.4f}] over n=359 paired examples"
    )
    assert "not worse by more than the margin 0.005, nor significantly worse" in record.reason
    assert sentence in record.reason
    assert sentence in _promotion_section(ledger, RUNS[1])
    # The first promotion had no champion: its page says so instead of quoting numbers.
    assert "Headline: no champion to compare against." in _promotion_section(ledger, RUNS[0])

    metadata = promotion_metadata(record)
    fields = {r.data["field"]: r.data["value"] for r in metadata["headline_comparison"].records}
    assert (fields["difference"], fields["n"]) == (headline["difference"], headline["n"])
    [paired] = [
        r.data
        for r in metadata["gate_rules"].records
        if r.data["rule"] == "holdout_accuracy.accuracy against the champion, paired"
    ]
    assert f"{paired['reference']:.4f}" == "0.9721" and paired["result"] == "passed"
    assert sentence in metadata["decision_against_champion"].value


def test_a_champion_evaluated_on_other_examples_is_re_evaluated_on_the_candidates(
    world: World, two_worse: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    name = "digits-headline-task-set"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, *RUNS)
    older = _older_eval_set(world)
    checkpoint = write_checkpoint(tmp_path / "champion", world.good_state, run_id=RUNS[0])
    _evaluate_on(world, ledger, checkpoint, RUNS[0], older)
    assert promote_checkpoint(world, ledger, checkpoint, RUNS[0], name).model_version == "1"
    candidate = write_checkpoint(tmp_path / "candidate", two_worse, run_id=RUNS[1])
    candidate_holdout = _holdout(evaluate_checkpoint(world, ledger, candidate, RUNS[1]))
    assert candidate_holdout.task_set_version != older.task_set_version

    record = promote_checkpoint(world, ledger, candidate, RUNS[1], name)

    again = record.gate["champion_reevaluation"]
    assert again["evaluated"] is True, again
    [reevaluated] = [
        e for e in ledger.evaluations_for_run(RUNS[0]) if e.evaluation_id == again["evaluation_id"]
    ]
    assert reevaluated.task_set_version == candidate_holdout.task_set_version
    assert reevaluated.evaluator_name == "holdout_accuracy" and reevaluated.raw_outputs_sha256
    headline = record.gate["headline_comparison"]
    assert headline["champion_evaluation_id"] == reevaluated.evaluation_id
    assert headline["n"] == 359 and headline["only_champion_correct"] == 2
    assert record.decision == PromotionDecision.REFUSED
    assert f"evaluation `{reevaluated.evaluation_id}`" in _promotion_section(ledger, RUNS[1])


def test_a_champion_that_cannot_be_re_evaluated_refuses_naming_why(
    world: World, tmp_path: Path
) -> None:
    name = "digits-headline-gone"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, *RUNS)
    older = _older_eval_set(world)
    checkpoint = write_checkpoint(tmp_path / "champion", world.good_state, run_id=RUNS[0])
    _evaluate_on(world, ledger, checkpoint, RUNS[0], older)
    assert promote_checkpoint(world, ledger, checkpoint, RUNS[0], name).model_version == "1"
    shutil.rmtree(checkpoint)  # retention, or a person, removed the champion's checkpoint
    # Not the champion's weights to the byte (those would be recorded unchanged, not gated).
    candidate = write_checkpoint(tmp_path / "candidate", nudged(world.good_state), run_id=RUNS[1])
    evaluate_checkpoint(world, ledger, candidate, RUNS[1])

    record = promote_checkpoint(world, ledger, candidate, RUNS[1], name)

    assert record.decision == PromotionDecision.REFUSED
    assert record.gate["headline_comparison"]["compared"] is False
    assert (
        "holdout_accuracy.accuracy was not compared with champion version 1: champion version 1 "
        "has no complete holdout_accuracy evaluation on the candidate's task set"
    ) in record.reason
    assert "champion version 1 could not be evaluated on the candidate's task set: " in (
        record.reason
    )
    assert str(checkpoint) in record.gate["champion_reevaluation"]["reason"]
    assert "was not compared with champion version 1" in _promotion_section(ledger, RUNS[1])


def test_raw_outputs_changed_after_their_evaluation_refuse_the_promotion(
    world: World, two_worse: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    name = "digits-headline-tampered"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, *RUNS)
    _crowned(world, ledger, tmp_path, world.good_state, name)
    candidate = write_checkpoint(tmp_path / "candidate", two_worse, run_id=RUNS[1])
    holdout = _holdout(evaluate_checkpoint(world, ledger, candidate, RUNS[1]))
    # Someone with write access to the artifact store marks every answer right.
    stored = Path(holdout.raw_outputs_uri.removeprefix("file://"))
    outputs = pd.read_parquet(stored)
    outputs["correct"] = True
    os.chmod(stored, 0o644)
    outputs.to_parquet(stored, index=False)

    record = promote_checkpoint(world, ledger, candidate, RUNS[1], name)

    assert record.decision == PromotionDecision.REFUSED
    assert record.gate["headline_comparison"]["compared"] is False
    assert f"raw outputs of evaluation {holdout.evaluation_id}: " in record.reason
    assert f"the ledger recorded {holdout.raw_outputs_sha256}" in record.reason
    assert str(champion_version(world.settings, name).version) == "1"


def _older_eval_set(world: World) -> EvalSet:
    """An older eval split the champion was evaluated on: today's rows less the last ten."""
    frame = read_snapshot_frame(world.snapshot)
    last = frame.loc[frame["split"] == "eval", "sample_id"].sort_values().tail(10)
    return EvalSet.from_frame(frame[~frame["sample_id"].isin(last)], snapshot_id="older")


def _outcomes(name: str, correct: list[bool]) -> PairedOutcomes:
    import numpy as np

    return PairedOutcomes(name, "sha256:" + name, tuple(range(len(correct))), np.array(correct))


@pytest.mark.parametrize(
    ("gained", "lost", "n", "passed"),
    [
        # Measured on a live run: 0.9443 against 0.9331, the models disagreeing on 28 examples.
        (16, 12, 359, True),
        (10, 10, 359, True),  # equal, with disagreements both ways
        (0, 2, 359, False),  # 0.9721 against 0.9777: worse by more than the margin
        (0, 40, 20_000, False),  # within the margin, but the whole interval lies below 0
    ],
)
def test_the_headline_rule_refuses_worse_and_promotes_equal_or_better(
    gained: int, lost: int, n: int, passed: bool
) -> None:
    champion = [True] * n
    candidate = [True] * n
    for i in range(lost):
        candidate[i] = False
    for i in range(lost, lost + gained):
        champion[i] = False
    result = compare(
        _outcomes("candidate", candidate), _outcomes("champion", champion), HeadlineSettings()
    )
    assert result["passed"] is passed, result
    assert result["difference"] == pytest.approx((gained - lost) / n)
    low, high = result["interval"]
    assert low <= result["difference"] <= high
    if (gained, lost) == (16, 12):
        assert low < -0.005  # strict non-inferiority would have refused this better model
    if n == 20_000:
        assert result["within_margin"] and result["significantly_worse"]
