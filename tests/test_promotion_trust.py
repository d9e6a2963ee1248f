"""Promotion under a hostile or busy world: store writers, stale champions, racing promotions."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

from pipeline.data import read_snapshot_frame
from pipeline.digests import sha256_bytes
from pipeline.ledger import EvaluationRecord, Ledger, PromotionRecord
from pipeline.states import PromotionDecision
from tests.evaluation_support import World, open_ledger, shared_world, write_checkpoint
from tests.promotion_support import (
    PIXELS,
    crown,
    evaluate_checkpoint,
    nudged,
    promote_checkpoint,
)

# The module, where promote() looks up the functions these tests replace.
promote_module = importlib.import_module("pipeline.promotion.promote")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return shared_world(tmp_path_factory.getbasetemp())


def _store_with_donor(
    world: World, tmp_path: Path, run_id: str
) -> tuple[Ledger, Path, Path, list[EvaluationRecord]]:
    """A run's evaluated checkpoint, and another checkpoint whose weights a writer could swap in."""
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, run_id)
    checkpoint = write_checkpoint(tmp_path / "ckpt", world.good_state, run_id=run_id)
    donor = write_checkpoint(tmp_path / "donor", world.untrained_state, run_id="run-donor")
    return ledger, checkpoint, donor, evaluate_checkpoint(world, ledger, checkpoint, run_id)


def _swap_weights(checkpoint: Path, donor: Path, *, rewrite_manifest: bool) -> None:
    """What a store writer does: other weights in, and (optionally) a manifest that agrees."""
    data = (donor / "model.safetensors").read_bytes()
    staged = checkpoint / ".swap"
    staged.write_bytes(data)
    os.replace(staged, checkpoint / "model.safetensors")
    if rewrite_manifest:
        manifest = json.loads((checkpoint / "MANIFEST.json").read_bytes())
        for entry in manifest["files"]:
            if entry["name"] == "model.safetensors":
                entry.update(size=len(data), sha256=sha256_bytes(data))
        staged.write_text(json.dumps(manifest))
        os.replace(staged, checkpoint / "MANIFEST.json")


def _accuracy(world: World, served: object) -> float:
    frame = read_snapshot_frame(world.snapshot)
    rows = frame[frame["split"] == "eval"]
    predicted = served.predict(rows[PIXELS].to_numpy())  # type: ignore[attr-defined]
    return float((predicted == rows["label"].to_numpy()).mean())


def test_weights_swapped_in_the_store_during_the_upload_are_never_vouched_for(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    from pipeline.serving.champion import load_champion

    ledger, checkpoint, donor, evaluations = _store_with_donor(world, tmp_path, "run-upload")
    committed = json.loads((checkpoint / "MANIFEST.json").read_bytes())
    good = next(e for e in committed["files"] if e["name"] == "model.safetensors")

    log_model = mlflow.pyfunc.log_model

    def swap_then_log(*args: object, **kwargs: object) -> object:
        # After verification, before MLflow copies a byte: weights and manifest both swapped.
        _swap_weights(checkpoint, donor, rewrite_manifest=True)
        return log_model(*args, **kwargs)

    monkeypatch.setattr(mlflow.pyfunc, "log_model", swap_then_log)
    record = promote_checkpoint(world, ledger, checkpoint, "run-upload", "digits-upload-swap")

    assert record.decision == PromotionDecision.PROMOTED, record.reason
    vouched = record.serving_manifest["files"]["weights"]
    assert (vouched["digest"], vouched["bytes"]) == (good["sha256"], good["size"])
    # Serving verifies against that record and serves the evaluated weights, not the donor's.
    served = load_champion(world.settings, ledger, "digits-upload-swap")
    holdout = next(e for e in evaluations if e.evaluator_name == "holdout_accuracy")
    assert _accuracy(world, served) == pytest.approx(holdout.metrics["accuracy"])


def test_weights_swapped_before_the_private_copy_refuse_the_promotion(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.promotion.promote import champion_version
    from pipeline.serving.champion import ServedFilesChangedError

    ledger, checkpoint, donor, _ = _store_with_donor(world, tmp_path, "run-early")
    vouch = promote_module._require_ledger_committed

    def vouch_then_swap(*args: object) -> None:
        vouch(*args)  # verified and vouched for; the store changes right after
        _swap_weights(checkpoint, donor, rewrite_manifest=False)

    monkeypatch.setattr(promote_module, "_require_ledger_committed", vouch_then_swap)
    with pytest.raises(ServedFilesChangedError, match=r"model\.safetensors now has sha256"):
        promote_checkpoint(world, ledger, checkpoint, "run-early", "digits-early-swap")
    assert champion_version(world.settings, "digits-early-swap") is None


def test_a_champion_with_no_evaluations_to_compare_against_refuses(
    world: World, tmp_path: Path
) -> None:
    name = "digits-no-baseline"
    crown(world, tmp_path, "run-c1", name)

    # A ledger that knows the champion only by its tag: none of its evaluations are here.
    ledger = open_ledger(tmp_path / "second.db", world.snapshot.snapshot_id, "run-c2")
    candidate = write_checkpoint(tmp_path, world.good_state, run_id="run-c2", step=800)
    evaluate_checkpoint(world, ledger, candidate, "run-c2")
    record = promote_checkpoint(world, ledger, candidate, "run-c2", name)

    assert record.decision == PromotionDecision.REFUSED, record.reason
    assert "champion version 1 has no complete holdout_accuracy evaluation" in record.reason
    assert "re-evaluate the champion" in record.reason
    assert "no slice of 0 regressed" not in record.reason


def test_a_champion_that_changes_during_the_promotion_is_not_overwritten(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.promotion.promote import champion_version

    name = "digits-race"
    runs = ("run-v1", "run-slow", "run-fast")
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, *runs)
    checkpoints = {  # three sets of weights: the same answers, none identical to another
        run: write_checkpoint(tmp_path, nudged(world.good_state, i), run_id=run, step=400 + 100 * i)
        for i, run in enumerate(runs)
    }
    for run, checkpoint in checkpoints.items():
        evaluate_checkpoint(world, ledger, checkpoint, run)
    assert (
        promote_checkpoint(world, ledger, checkpoints["run-v1"], "run-v1", name).model_version
        == "1"
    )

    register = promote_module._register
    raced: list[PromotionRecord] = []
    racing = []

    def register_while_another_promotes(*args: object, **kwargs: object) -> str:
        version = register(*args, **kwargs)
        if not racing:  # the other promotion, also compared against v1, finishes first
            racing.append(True)
            raced.append(
                promote_checkpoint(world, ledger, checkpoints["run-fast"], "run-fast", name)
            )
        return version

    monkeypatch.setattr(promote_module, "_register", register_while_another_promotes)
    slow = promote_checkpoint(world, ledger, checkpoints["run-slow"], "run-slow", name)

    fast = raced[0]
    assert (fast.decision, fast.model_version) == (PromotionDecision.PROMOTED, "3")
    assert slow.decision == PromotionDecision.REFUSED, slow.reason
    assert f"the champion of {name} changed during the promotion" in slow.reason
    assert "compared against version 1, now version 3" in slow.reason
    assert "Re-run the promotion" in slow.reason
    assert str(champion_version(world.settings, name).version) == "3"
    assert ledger.current_champion(name) == fast
