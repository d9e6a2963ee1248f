"""``tracks diff RUN RUN`` compares two runs without SQL: config, data, placement, metrics.

Before it, the only way to answer "what differs between these two runs" was SQL on the ledger.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pipeline.cli import main as tracks
from pipeline.ledger import AttemptStart, EvaluationRecord, Ledger

CONFIG: dict[str, Any] = {
    "model_family": "digits-cnn", "seed": 0, "max_steps": 300, "batch_size": 64,
    "learning_rate": 0.003, "model": {"channels": 16, "hidden": 64},
}  # fmt: skip


def _run(
    ledger: Ledger,
    run_id: str,
    snapshot: str,
    config: dict[str, Any],
    placement: dict[str, Any],
    accuracy: float | None,
) -> None:
    ledger.create_run(
        run_id=run_id, model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="c" * 64, snapshot_id=snapshot,
    )  # fmt: skip
    ledger.register_snapshot(
        snapshot_id=snapshot, manifest_sha256=snapshot[-4:] * 16, content_sha256="f" * 64,
        rows=1797, source="landing",
    )  # fmt: skip
    ledger.begin_attempt(
        run_id,
        AttemptStart(
            config_snapshot=config, config_sha256="c" * 64,
            data_manifest_sha256=snapshot[-4:] * 16, container_digest="sha256:" + "e" * 64,
            placement=placement,
        ),
    )  # fmt: skip
    if accuracy is None:
        return
    ledger.record_evaluation(
        EvaluationRecord(
            evaluation_id=f"ev-{run_id}", run_id=run_id, attempt_no=1,
            checkpoint_path=f"/store/{run_id}/step-0000000300-a01",
            checkpoint_manifest_sha256="0" * 64, evaluator_name="holdout_accuracy",
            evaluator_version="1.0", evaluator_env_digest="env", task_set_version="v1",
            decoding_params={}, judge_model="none", rubric_version="v1", status="complete",
            started_at=datetime(2026, 11, 21, tzinfo=UTC),
            metrics={"accuracy": accuracy, "loss": 0.1},
        )
    )  # fmt: skip


@pytest.fixture
def ledger(tracks_home: Path) -> Ledger:
    return Ledger.open(f"sqlite:///{tracks_home / 'ledger.db'}")


def test_diff_compares_config_data_placement_and_evaluations(ledger: Ledger) -> None:
    one = {"world_size": 1, "accelerator_type": "cpu", "accelerator_count": 0}
    two = {"world_size": 2, "ranks_per_node": 2, "nodes": 1, "accelerator_type": "cpu",
           "accelerator_count": 0, "backend": "torchrun"}  # fmt: skip
    _run(ledger, "run-a", "digits-000000000000aaaa", CONFIG, one, accuracy=0.95)
    smaller = {**CONFIG, "batch_size": 32, "model": {"channels": 16, "hidden": 128}}
    _run(ledger, "run-b", "digits-000000000000bbbb", smaller, two, accuracy=0.97)

    result = CliRunner().invoke(tracks, ["diff", "run-a", "run-b"])
    assert result.exit_code == 0, result.output
    page = result.output
    assert page.startswith("# Run run-a against run run-b")
    assert "2 of 7 key(s) differ." in page
    assert "| `batch_size` **≠** | 64 | 32 |" in page
    assert "| `model.hidden` **≠** | 64 | 128 |" in page
    assert "| `learning_rate` | 0.003 | 0.003 |" in page  # the same, and shown as such
    assert "| snapshot **≠** | digits-000000000000aaaa | digits-000000000000bbbb |" in page
    assert (
        "| manifest sha256 read by the attempts **≠** | aaaaaaaaaaaaaaaa | bbbbbbbbbbbbbbbb |"
        in (page)
    )
    assert "**byte-identical** data" in page  # same content digest, other snapshot ids
    assert "| world_size **≠** | 1 | 2 |" in page
    assert "| backend **≠** | — | torchrun |" in page
    assert "| holdout_accuracy | accuracy | 0.9500 | 0.9700 | +0.0200 |" in page
    assert "| holdout_accuracy | loss | 0.1000 | 0.1000 | +0.0000 |" in page


def test_diff_of_an_unknown_run_names_it(ledger: Ledger) -> None:
    _run(ledger, "run-a", "digits-000000000000aaaa", CONFIG, {}, accuracy=None)
    result = CliRunner().invoke(tracks, ["diff", "run-a", "run-nowhere"])
    assert result.exit_code == 1
    assert "run 'run-nowhere' is not in the ledger" in result.output
    assert (
        "Neither run has a complete evaluation."
        in CliRunner().invoke(tracks, ["diff", "run-a", "run-a"]).output
    )
