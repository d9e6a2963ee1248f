"""MLflow mirrors the ledger: each attempt's reason, sentence and Dagster run; no run left RUNNING.

Reproduced before the fix: every ``tracks.attempt.N.dagster_run_id`` tag was empty; a run whose
attempt was preempted, ran out of memory or went silent stayed RUNNING in MLflow forever; and a
resumed attempt logged its restored commit's ``checkpoint.step`` a second time whenever the
commit fell between two logged steps.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from mlflow import MlflowClient

from pipeline.ledger import AttemptStart, Ledger
from pipeline.settings import TracksSettings
from pipeline.states import TerminationReason
from pipeline.tracking import TrainingTracker, mirror_attempt, mlflow_status, training_run_of
from tests.receipt_support import SMALL, make_snapshot, train_alone

STEP = {"loss": 1.0, "lr": 0.01, "examples_per_second": 100.0}


def _fail(message: str) -> None:
    raise AssertionError(f"the tracker warned: {message}")


def _tracker(uri: str, tmp_path: Path, attempt_no: int, restored_step: int) -> TrainingTracker:
    return TrainingTracker(
        tracking_uri=uri, artifact_root=str(tmp_path / "artifacts"), run_id="r1",
        attempt_no=attempt_no, config={"max_steps": 60, "model": {"hidden": 32}},
        tags={"restored_step": str(restored_step), "dagster_run_id": ""}, warn=_fail,
        run_dir=tmp_path / "store" / "r1", restored_step=restored_step,
    )  # fmt: skip


def _attempt(ledger: Ledger, dagster_run_id: str) -> int:
    return ledger.begin_attempt(
        "r1",
        AttemptStart(
            config_snapshot={"max_steps": 60}, config_sha256="c" * 64,
            data_manifest_sha256="d" * 64, container_digest="env", dagster_run_id=dagster_run_id,
        ),
    ).attempt_no  # fmt: skip


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("succeeded", "FINISHED"),
        ("preempted", "KILLED"),
        ("cancelled", "KILLED"),
        ("fenced", "KILLED"),
        ("oom", "FAILED"),
        ("timeout", "FAILED"),
        ("user_code_error", "FAILED"),
    ],
)
def test_each_termination_reason_has_the_honest_mlflow_status(reason: str, status: str) -> None:
    assert mlflow_status(reason) == status


def test_the_mlflow_run_follows_each_attempt_the_ledger_closes(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.create_run(
        run_id="r1", model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="c" * 64, snapshot_id="digits-00000000000000aa",
    )  # fmt: skip
    client = MlflowClient(tracking_uri=uri)

    first = _attempt(ledger, "dagster-run-1")
    tracker = _tracker(uri, tmp_path, first, 0)
    tags = client.get_run(tracker.mlflow_run_id).data.tags
    assert "tracks.attempt.1.dagster_run_id" not in tags  # no empty tag while unknown
    # The trainer saw a SIGTERM; the ledger classified it preempted.
    tracker.finished(first, "preempted", final=False)
    assert client.get_run(tracker.mlflow_run_id).info.status == "KILLED"
    detail = "Stopped on SIGTERM after step 40 of 60 and committed a checkpoint at step 40."
    ledger.end_attempt("r1", first, termination_reason=TerminationReason.PREEMPTED,
                       termination_detail=detail)  # fmt: skip
    assert mirror_attempt(ledger, "r1", first, tracking_uri=uri) is None
    run = client.get_run(tracker.mlflow_run_id)
    assert run.info.status == "KILLED"  # preempted: not FAILED
    assert run.data.tags["tracks.attempt.1"] == "preempted"
    assert run.data.tags["tracks.attempt.1.dagster_run_id"] == "dagster-run-1"
    assert run.data.tags["tracks.attempt.1.termination_detail"] == detail
    assert run.data.tags["tracks.termination_reason"] == "preempted"
    assert run.data.tags["tracks.termination_detail"] == detail

    # The next attempt runs: the run is RUNNING again, and an older attempt's late close
    # (attempt 1 mirrored again) does not end it.
    second = _attempt(ledger, "dagster-run-2")
    _tracker(uri, tmp_path, second, 40)
    assert client.get_run(tracker.mlflow_run_id).info.status == "RUNNING"
    assert mirror_attempt(ledger, "r1", first, tracking_uri=uri) is None
    assert client.get_run(tracker.mlflow_run_id).info.status == "RUNNING"
    # It ran out of memory, whatever the trainer itself said on its way out.
    ledger.end_attempt("r1", second, termination_reason=TerminationReason.OOM,
                       termination_detail="CUDA out of memory at step 41.")  # fmt: skip
    assert mirror_attempt(ledger, "r1", second, tracking_uri=uri) is None
    run = client.get_run(tracker.mlflow_run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["tracks.termination_reason"] == "oom"
    assert run.data.tags["tracks.attempt.2.dagster_run_id"] == "dagster-run-2"
    assert run.data.tags["tracks.attempt.1"] == "preempted"  # each attempt keeps its own


def test_a_resumed_attempt_does_not_log_its_restored_commit_again(tmp_path: Path) -> None:
    """Steps are logged every 10; the commit at 15 falls between two of them."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _tracker(uri, tmp_path, 1, 0)
    first.step(10, STEP)
    first.committed(15, {"eval_loss": 0.5})
    # SIGKILLed at step 17: no goodbye. The next attempt restores step 15.
    second = _tracker(uri, tmp_path, 2, 15)
    second.step(20, STEP)
    second.committed(20, {"eval_loss": 0.4})
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(second.mlflow_run_id, "checkpoint.step")
    assert sorted(m.step for m in history) == [15, 20]
    losses = client.get_metric_history(second.mlflow_run_id, "checkpoint.eval_loss")
    assert sorted(m.step for m in losses) == [15, 20]


@pytest.mark.slow
def test_an_attempt_that_ran_out_of_memory_leaves_its_mlflow_run_failed_in_the_ledgers_words(
    tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = TracksSettings.from_env()
    snapshot = make_snapshot(settings)
    monkeypatch.setenv("TRACKS_FAULT_OOM_ABOVE_BATCH", "32")  # a drill hook: batch 64 "OOMs"
    with dg.DagsterInstance.get() as instance:
        result = train_alone(settings, instance, snapshot.snapshot_id, SMALL)
    assert not result.success
    ledger = Ledger.open(settings.ledger_url)
    [attempt] = ledger.attempts_for_dagster_run(result.run_id)
    assert attempt.termination_reason == "oom", attempt.termination_detail
    client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
    mlflow_run_id = training_run_of(client, attempt.run_id)
    assert mlflow_run_id is not None
    run = client.get_run(mlflow_run_id)
    assert run.info.status == "FAILED"
    tags = run.data.tags
    assert tags["tracks.attempt.1"] == "oom"
    assert tags["tracks.attempt.1.dagster_run_id"] == result.run_id
    assert tags["tracks.termination_reason"] == "oom"
    assert tags["tracks.termination_detail"] == attempt.termination_detail
