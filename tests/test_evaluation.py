"""Evaluation: real checkpoints, a real snapshot, MLflow and the ledger on SQLite; no mocks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from pipeline.checkpoint import CorruptCheckpointError
from pipeline.data import eval_task_set_version, read_snapshot_frame
from pipeline.environment import container_digest
from pipeline.evaluation import (
    EVALUATORS,
    NOT_APPLICABLE,
    CheckpointAttemptMismatchError,
    EvalSet,
    EvaluatorCrashError,
    get_evaluator,
    required_evaluators,
    run_evaluation,
)
from pipeline.evaluation.base import ClassifierEvaluator, EvaluatorResult
from pipeline.ledger import EvaluationRecord, Ledger
from pipeline.ledger.ledger import utcnow
from pipeline.states import EvaluationStatus, TerminationReason
from pipeline.trainer.model import build_model
from tests.evaluation_support import (
    World,
    manifest_sha256,
    open_ledger,
    shared_world,
    write_checkpoint,
)

RUN_ID = "run-eval"


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return shared_world(tmp_path_factory.getbasetemp())


@pytest.fixture
def ledger(tmp_path: Path, world: World) -> Ledger:
    return open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, RUN_ID)


@pytest.fixture
def good_checkpoint(tmp_path: Path, world: World) -> Path:
    return write_checkpoint(tmp_path / "checkpoints", world.good_state, run_id=RUN_ID)


def _evaluate(world: World, ledger: Ledger, checkpoint: Path, evaluator: Any, **kw: Any):
    return run_evaluation(
        checkpoint_dir=checkpoint,
        snapshot=world.snapshot,
        ledger=ledger,
        settings=world.settings,
        evaluator=evaluator,
        run_id=RUN_ID,
        attempt_no=1,
        **kw,
    )


def _download(uri: str, tmp_path: Path) -> Path:
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path)))


@pytest.mark.parametrize("name", ["holdout_accuracy", "noise_robustness"])
def test_evaluation_records_complete_provenance_and_artifacts(
    name: str, world: World, ledger: Ledger, good_checkpoint: Path, tmp_path: Path
) -> None:
    record = _evaluate(world, ledger, good_checkpoint, name, dagster_run_id="dagster-123")
    frame = read_snapshot_frame(world.snapshot)
    n_eval = int((frame["split"] == "eval").sum())
    evaluator = EVALUATORS[name]

    assert record.status == EvaluationStatus.COMPLETE
    assert record.missing_provenance() == []
    assert record.checkpoint_manifest_sha256 == manifest_sha256(good_checkpoint)
    assert record.checkpoint_path == str(good_checkpoint)
    assert (record.evaluator_name, record.evaluator_version) == (name, evaluator.version)
    assert record.evaluator_env_digest == container_digest()
    assert record.task_set_version == eval_task_set_version(frame)
    assert record.decoding_params["decision"] == "argmax"
    assert record.decoding_params["temperature"] == 1.0
    assert record.judge_model == record.rubric_version == NOT_APPLICABLE
    assert record.dagster_run_id == "dagster-123"
    assert record.evaluation_id.startswith(f"eval-{name}-")
    # The ledger holds exactly what was returned.
    assert ledger.evaluations_for_checkpoint(record.checkpoint_manifest_sha256) == [record]

    # Raw outputs: one row per eval example (per noise level), joinable on sample_id.
    raw = pd.read_parquet(_download(record.raw_outputs_uri, tmp_path / "raw"))
    levels = len(getattr(evaluator, "noise_levels", (None,)))
    assert len(raw) == n_eval * levels
    assert {"sample_id", "label", "prediction", "confidence", "correct", "prob_0"} <= set(raw)
    assert set(raw["sample_id"]) == set(frame.loc[frame["split"] == "eval", "sample_id"])
    failures = json.loads(_download(record.failures_uri, tmp_path / "failures").read_text())
    assert failures["total_failures"] == int((~raw["correct"]).sum())
    assert len(failures["failures"]) == min(25, failures["total_failures"])

    # The MLflow run carries the same provenance as params, tags and metrics.
    client = MlflowClient(world.settings.mlflow_tracking_uri)
    run = client.get_run(record.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tracks-evaluation"
    tags = run.data.tags
    assert tags["tracks.run_id"] == RUN_ID and tags["tracks.attempt_no"] == "1"
    assert tags["tracks.checkpoint_manifest_sha256"] == record.checkpoint_manifest_sha256
    assert tags["tracks.snapshot_id"] == world.snapshot.snapshot_id
    assert (tags["tracks.evaluator_name"], tags["tracks.evaluator_version"]) == (
        name,
        evaluator.version,
    )
    assert tags["tracks.evaluation_id"] == record.evaluation_id
    params = run.data.params
    assert params["task_set_version"] == record.task_set_version
    assert params["evaluator_env_digest"] == record.evaluator_env_digest
    assert params["judge_model"] == NOT_APPLICABLE
    assert params["decoding.decision"] == "argmax"
    artifacts = {a.path for a in client.list_artifacts(record.mlflow_run_id)}
    assert {"raw_outputs.parquet", "failures.json", "metrics.json"} <= artifacts
    metrics = run.data.metrics
    if name == "holdout_accuracy":
        assert "confusion_matrix.png" in artifacts
        assert record.metrics["accuracy"] > 0.9
        assert metrics["accuracy"] == pytest.approx(record.metrics["accuracy"])
        assert set(record.slice_metrics) == {f"class={k}" for k in range(10)}
        assert sum(s["support"] for s in record.slice_metrics.values()) == n_eval
        assert metrics["slice/class_3/accuracy"] == record.slice_metrics["class=3"]["accuracy"]
    else:
        assert record.metrics["accuracy@0"] >= record.metrics["accuracy@0.3"]
        assert metrics["accuracy_at_0.1"] == pytest.approx(record.metrics["accuracy@0.1"])
        assert set(record.slice_metrics) == {
            "noise=0",
            "noise=0.05",
            "noise=0.1",
            "noise=0.2",
            "noise=0.3",
        }


def test_confusion_matrix_png_is_a_real_image(
    world: World, ledger: Ledger, good_checkpoint: Path, tmp_path: Path
) -> None:
    record = _evaluate(world, ledger, good_checkpoint, "holdout_accuracy")
    png = Path(
        mlflow.artifacts.download_artifacts(
            run_id=record.mlflow_run_id,
            artifact_path="confusion_matrix.png",
            dst_path=str(tmp_path),
            tracking_uri=world.settings.mlflow_tracking_uri,
        )
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5_000


class _CrashingEvaluator(ClassifierEvaluator):
    name = "crashing_probe"

    def evaluate(self, model, images, labels, sample_ids) -> EvaluatorResult:
        raise RuntimeError("probe head returned 11 logits for 10 classes")


def test_evaluator_crash_records_failed_row_and_raises(
    world: World, ledger: Ledger, good_checkpoint: Path
) -> None:
    with pytest.raises(EvaluatorCrashError) as caught:
        _evaluate(world, ledger, good_checkpoint, _CrashingEvaluator())
    message = str(caught.value)
    assert "crashing_probe" in message and str(good_checkpoint) in message

    [row] = ledger.evaluations_for_checkpoint(manifest_sha256(good_checkpoint))
    assert row.status == EvaluationStatus.FAILED
    assert row.termination_reason == TerminationReason.EVALUATOR_CRASH
    assert row.evaluation_id == caught.value.evaluation_id
    assert "RuntimeError" in row.detail and "11 logits" in row.detail
    assert row.detail.count("\n") == 0
    # What was known before the crash is still recorded; results are not.
    assert row.evaluator_version.startswith("src:sha256:")
    assert row.task_set_version and row.evaluator_env_digest
    assert row.metrics is None and row.raw_outputs_uri is None
    run = MlflowClient(world.settings.mlflow_tracking_uri).get_run(row.mlflow_run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["tracks.termination_reason"] == "evaluator_crash"


LEAKY_URL = "postgresql://tracks:hunter2@db/ledger"


class _LeakyEvaluator(ClassifierEvaluator):
    name = "leaky_probe"

    def evaluate(self, model, images, labels, sample_ids) -> EvaluatorResult:
        # The cut of the first line (300 characters) falls between the password and its '@'.
        raise RuntimeError("x" * 253 + f" could not reach {LEAKY_URL}\nsecond line")


def test_evaluator_crash_quotes_no_password_anywhere(
    world: World, ledger: Ledger, good_checkpoint: Path
) -> None:
    with pytest.raises(EvaluatorCrashError) as caught:
        _evaluate(world, ledger, good_checkpoint, _LeakyEvaluator())
    # The message is what assets/evaluation.py logs and fails the step with.
    assert "hunter2" not in str(caught.value) and "tracks:***@db" in str(caught.value)
    [row] = ledger.evaluations_for_checkpoint(manifest_sha256(good_checkpoint))
    assert row.detail and "RuntimeError" in row.detail and "hunter2" not in row.detail
    run = MlflowClient(world.settings.mlflow_tracking_uri).get_run(row.mlflow_run_id)
    assert "hunter2" not in run.data.tags["tracks.termination_detail"]


def test_evaluator_crash_error_message_is_redacted() -> None:
    error = EvaluatorCrashError(
        evaluator_name="probe",
        evaluator_version="1",
        checkpoint_path="/ckpt/step-00010",
        evaluation_id="eval-probe-1",
        cause=ConnectionError(f"could not reach {LEAKY_URL}"),
    )
    assert "hunter2" not in str(error) and "ConnectionError" in str(error)


def test_record_evaluation_stores_no_password(ledger: Ledger) -> None:
    record = EvaluationRecord(
        evaluation_id="eval-leaky-1", run_id=RUN_ID, attempt_no=1,
        checkpoint_path="/ckpt/step-00010", checkpoint_manifest_sha256="a" * 64,
        evaluator_name="leaky_probe", evaluator_version="1", evaluator_env_digest="env",
        task_set_version="t", decoding_params={}, judge_model="none", rubric_version="none",
        status=str(EvaluationStatus.FAILED), started_at=utcnow(), ended_at=utcnow(),
        termination_reason=str(TerminationReason.EVALUATOR_CRASH),
        detail=f"evaluator leaky_probe raised OperationalError: could not reach {LEAKY_URL}",
        raw_outputs_uri="https://tracks:hunter2@mlflow.example/artifacts/raw.jsonl",
    )  # fmt: skip
    returned = ledger.record_evaluation(record)
    [stored] = ledger.evaluations_for_checkpoint("a" * 64)
    for kept in (returned, stored):
        assert "hunter2" not in repr(kept)
        assert kept.detail and "tracks:***@db/ledger" in kept.detail
        assert kept.raw_outputs_uri == "https://tracks:***@mlflow.example/artifacts/raw.jsonl"


def test_corrupt_checkpoint_is_refused_before_anything_is_recorded(
    world: World, ledger: Ledger, good_checkpoint: Path
) -> None:
    weights = good_checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors"):
        _evaluate(world, ledger, good_checkpoint, "holdout_accuracy")
    assert ledger.evaluations_for_checkpoint(manifest_sha256(good_checkpoint)) == []


def test_checkpoint_of_another_attempt_is_refused(
    world: World, ledger: Ledger, tmp_path: Path
) -> None:
    checkpoint = write_checkpoint(tmp_path / "other", world.good_state, run_id=RUN_ID, attempt_no=2)
    with pytest.raises(CheckpointAttemptMismatchError, match=f"{RUN_ID}#2"):
        _evaluate(world, ledger, checkpoint, "holdout_accuracy")


def test_evaluators_are_deterministic_and_versioned_by_their_source(world: World) -> None:
    eval_set = EvalSet.from_snapshot(world.snapshot)
    model = build_model({"channels": 8, "hidden": 32})
    model.load_state_dict(world.good_state)
    for name in required_evaluators():
        evaluator = get_evaluator(name)
        first = evaluator.evaluate(model, eval_set.images, eval_set.labels, eval_set.sample_ids)
        second = evaluator.evaluate(
            model, eval_set.images.clone(), eval_set.labels, eval_set.sample_ids
        )
        assert first.metrics == second.metrics
        assert first.slice_metrics == second.slice_metrics
        pd.testing.assert_frame_equal(first.raw_outputs, second.raw_outputs)
        assert re.fullmatch(r"src:sha256:[0-9a-f]{16}", evaluator.version)
    assert required_evaluators() == ["holdout_accuracy", "noise_robustness"]
    assert EVALUATORS["holdout_accuracy"].version != EVALUATORS["noise_robustness"].version
    # A changed evaluator is a different evaluator: its version follows its code.
    assert _CrashingEvaluator().version not in {e.version for e in EVALUATORS.values()}


def test_eval_set_ids_line_up_with_tensors(world: World) -> None:
    frame = read_snapshot_frame(world.snapshot)
    eval_set = EvalSet.from_frame(frame, snapshot_id=world.snapshot.snapshot_id)
    by_id = frame.set_index("sample_id")
    for index in (0, len(eval_set.sample_ids) // 2, len(eval_set.sample_ids) - 1):
        row = by_id.loc[eval_set.sample_ids[index]]
        assert row["split"] == "eval"
        assert int(row["label"]) == int(eval_set.labels[index])
        pixels = torch.tensor([row[f"px_{i:02d}"] for i in range(64)], dtype=torch.float32) / 16
        assert torch.equal(eval_set.images[index].reshape(64), pixels)
