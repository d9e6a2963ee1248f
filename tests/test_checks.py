"""The asset checks that run with every training run: what they pass, what they fail, and how."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg

from assets.checks import (
    LOSS_FALLS,
    PROVENANCE_COMPLETE,
    RESTORES_IN_NEW_PROCESS,
    judge_loss_falls,
    judge_provenance_complete,
    judge_restores_in_new_process,
)
from definitions import build_definitions
from pipeline.digests import sha256_bytes
from pipeline.ledger import EvaluationRecord, Ledger
from pipeline.settings import TracksSettings
from tests.trainer_support import small_checkpoint

SHA = "5a" * 32
OTHER_SHA = "0b" * 32
RUN = "digits-cnn-canary-1"
# provenance_complete reads the family from the partition: a digits snapshot id.
PARTITION = "digits-0123456789abcdef"


def test_loss_falls_passes_on_a_real_fall_and_warns_otherwise() -> None:
    fell = judge_loss_falls(
        {"run_id": RUN, "attempt_no": 1, "first_loss": 2.2, "final_loss": 0.3}, "p"
    )
    assert fell.passed

    flat = judge_loss_falls(
        {"run_id": RUN, "attempt_no": 1, "first_loss": 2.30, "final_loss": 2.29}, "p"
    )
    assert not flat.passed
    assert flat.severity == dg.AssetCheckSeverity.WARN
    assert f"{RUN}#1" in flat.description and "2.3000" in flat.description
    assert "2.2900" in flat.description

    silent = judge_loss_falls({"run_id": RUN, "attempt_no": 2}, "p")
    assert not silent.passed and "no losses" in silent.description
    assert not judge_loss_falls(None, "p").passed


def _ledger(tmp_path: Path) -> Ledger:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.create_run(
        run_id=RUN, model_family="digits-cnn", owner="ci", purpose="canary",
        config_sha256="c" * 64, snapshot_id="digits-0000000000000000",
    )  # fmt: skip
    return ledger


def _evaluation(
    evaluation_id: str, evaluator: str, sha: str = SHA, **changes: Any
) -> EvaluationRecord:
    now = datetime.now(UTC)
    fields: dict[str, Any] = {
        "evaluation_id": evaluation_id, "run_id": RUN, "attempt_no": 1,
        "checkpoint_path": "/ckpt/step-0000000120-a01", "checkpoint_manifest_sha256": sha,
        "evaluator_name": evaluator, "evaluator_version": "code:sha256:1",
        "evaluator_env_digest": "env:sha256:2", "task_set_version": "digits-holdout:sha256:3",
        "decoding_params": {"argmax": True}, "judge_model": "not applicable",
        "rubric_version": "not applicable", "status": "complete", "started_at": now,
        "ended_at": now, "metrics": {"accuracy": 0.95}, "slice_metrics": {"digit=8": {"a": 1}},
        "raw_outputs_uri": "mlflow:/raw", "failures_uri": "mlflow:/failures",
        "mlflow_run_id": "ml-1",
    }  # fmt: skip
    return EvaluationRecord(**{**fields, **changes})


def _evaluated(*ids: str, sha: str = SHA) -> dict[str, Any]:
    return {"checkpoint_manifest_sha256": sha, "evaluation_ids": list(ids), "run_id": RUN}


def test_provenance_complete_passes_when_every_required_evaluator_has_a_full_row(
    tmp_path: Path,
) -> None:
    ledger = _ledger(tmp_path)
    ledger.record_evaluation(_evaluation("ev-h", "holdout_accuracy"))
    ledger.record_evaluation(_evaluation("ev-n", "noise_robustness"))

    result = judge_provenance_complete(
        _evaluated("ev-h", "ev-n"), {"manifest_sha256": SHA}, ledger, PARTITION
    )
    assert result.passed, result.description
    assert result.check_name == PROVENANCE_COMPLETE


def test_provenance_complete_fails_naming_missing_fields_and_foreign_evaluations(
    tmp_path: Path,
) -> None:
    ledger = _ledger(tmp_path)
    ledger.record_evaluation(_evaluation("ev-h", "holdout_accuracy"))
    ledger.record_evaluation(
        _evaluation("ev-n", "noise_robustness", rubric_version="", raw_outputs_uri=None)
    )
    ledger.record_evaluation(_evaluation("ev-x", "holdout_accuracy", sha=OTHER_SHA))

    result = judge_provenance_complete(
        _evaluated("ev-h", "ev-n", "ev-x"), {"manifest_sha256": SHA}, ledger, PARTITION
    )
    assert not result.passed
    assert result.severity == dg.AssetCheckSeverity.ERROR
    text = result.description
    assert "ev-n (noise_robustness) is missing rubric_version, raw_outputs_uri" in text, text
    assert f"ev-x has no ledger row for checkpoint manifest {SHA}" in text, text


def test_provenance_complete_fails_when_a_required_evaluator_or_the_checkpoint_differs(
    tmp_path: Path,
) -> None:
    ledger = _ledger(tmp_path)
    ledger.record_evaluation(_evaluation("ev-h", "holdout_accuracy"))

    result = judge_provenance_complete(
        _evaluated("ev-h"), {"manifest_sha256": OTHER_SHA}, ledger, PARTITION
    )
    assert not result.passed
    assert "required evaluator noise_robustness has no evaluation" in result.description
    assert f"but committed_checkpoint is {OTHER_SHA}" in result.description


def test_restores_in_new_process_fails_blocking_naming_the_tampered_file(tmp_path: Path) -> None:
    checkpoint = small_checkpoint(tmp_path / "train")
    sha = sha256_bytes((checkpoint / "MANIFEST.json").read_bytes())
    good = judge_restores_in_new_process({"path": str(checkpoint), "manifest_sha256": sha}, "p")
    assert good.passed, good.description
    assert good.metadata["step"].value == 20

    tampered = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, tampered)
    (tampered / "optimizer.safetensors").write_bytes(b"\x00" * 16)
    bad = judge_restores_in_new_process({"path": str(tampered), "manifest_sha256": sha}, "p")
    assert not bad.passed
    assert bad.severity == dg.AssetCheckSeverity.ERROR
    assert str(tampered) in bad.description and "optimizer.safetensors" in bad.description


def test_checks_are_partitioned_run_with_both_jobs_and_block_where_they_must(
    tracks_home: Path,
) -> None:
    defs = build_definitions(TracksSettings.from_env())
    graph = defs.resolve_asset_graph()
    expected = {
        ("training_attempt", LOSS_FALLS): False,
        ("committed_checkpoint", RESTORES_IN_NEW_PROCESS): True,
        ("evaluation", PROVENANCE_COMPLETE): True,
    }
    for (asset, name), blocking in expected.items():
        node = graph.get(dg.AssetCheckKey(dg.AssetKey(asset), name))
        assert node.blocking is blocking
        assert node.partitions_def is not None and node.partitions_def.name == "snapshots"
    for job_name in ("train_evaluate_promote", "canary"):
        job = defs.resolve_job_def(job_name)
        keys = {
            (k.asset_key.path[-1], k.name) for k in job.asset_layer.asset_graph.asset_check_keys
        }
        assert set(expected) <= keys, job_name
    canary_assets = {
        k.path[-1] for k in defs.resolve_job_def("canary").asset_layer.selected_asset_keys
    }
    assert canary_assets == {
        "data_snapshot",
        "training_attempt",
        "committed_checkpoint",
        "evaluation",
    }
