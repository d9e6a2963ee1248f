"""Test helpers for promotion: a checkpoint evaluated by the required evaluators, then promoted
after the ledger row training would have left, and a version 1 crowned that way."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.evaluation import run_evaluation
from pipeline.ledger import EvaluationRecord, Ledger, PromotionRecord
from pipeline.promotion import promote
from tests.evaluation_support import World, open_ledger, record_committed, write_checkpoint

# The feature columns of a digits snapshot, in the order a served model takes them.
PIXELS = [f"px_{i:02d}" for i in range(64)]


def evaluate_checkpoint(
    world: World,
    ledger: Ledger,
    checkpoint: Path,
    run_id: str,
    evaluators: Sequence[str] = ("holdout_accuracy", "noise_robustness"),
) -> list[EvaluationRecord]:
    """Run each of ``evaluators`` on ``checkpoint`` (attempt 1 of ``run_id``); their records."""
    return [
        run_evaluation(
            checkpoint_dir=checkpoint,
            snapshot=world.snapshot,
            ledger=ledger,
            settings=world.settings,
            evaluator=name,
            run_id=run_id,
            attempt_no=1,
        )
        for name in evaluators
    ]


def promote_checkpoint(
    world: World, ledger: Ledger, checkpoint: Path, run_id: str, model_name: str, **kw: object
) -> PromotionRecord:
    """Promote ``checkpoint`` (attempt 1 of ``run_id``) to ``model_name``, after recording it
    committed as training would have; ``kw`` goes to ``promote``."""
    record_committed(ledger, checkpoint, world.snapshot.snapshot_id)  # as training would have
    return promote(
        ledger=ledger,
        settings=world.settings,
        run_id=run_id,
        attempt_no=1,
        checkpoint_dir=checkpoint,
        snapshot_id=world.snapshot.snapshot_id,
        model_name=model_name,
        **kw,
    )


def nudged(state: dict[str, torch.Tensor], times: int = 1) -> dict[str, torch.Tensor]:
    """The same model but for one output bias moved by ``times`` millionths: other bytes (so
    not "identical to the champion", which registers nothing), the same answers."""
    moved = {k: v.clone() for k, v in state.items()}
    bias = [k for k in moved if k.endswith(".bias")][-1]
    moved[bias][0] += 1e-6 * times
    return moved


def crown(world: World, tmp_path: Path, run_id: str, model_name: str) -> Path:
    """Version 1 of ``model_name`` promoted from ``run_id``, recorded in a ledger of its own
    (``first.db``); its checkpoint."""
    ledger = open_ledger(tmp_path / "first.db", world.snapshot.snapshot_id, run_id)
    checkpoint = write_checkpoint(tmp_path, world.good_state, run_id=run_id)
    evaluate_checkpoint(world, ledger, checkpoint, run_id)
    assert promote_checkpoint(world, ledger, checkpoint, run_id, model_name).model_version == "1"
    return checkpoint
