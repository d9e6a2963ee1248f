"""MLflow mirrors the ledger: each attempt's reason, sentence and Dagster run; no run left RUNNING.

Reproduced before the fix: every ``tracks.attempt.N.dagster_run_id`` tag was empty; a run whose
attempt was preempted, ran out of memory or went silent stayed RUNNING in MLflow forever; and a
resumed attempt logged its restored commit's ``checkpoint.step`` a second time whenever the
commit fell between two logged steps. The tracker logs live, from its own thread: the tests
wait for it (``flush``) where a trainer's commit would.
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
    """A tracker whose thread has found (or made) the MLflow run and set it RUNNING."""
    tracker = TrainingTracker(
        tracking_uri=uri, artifact_root=str(tmp_path / "artifacts"), run_id="r1",
        attempt_no=attempt_no, config={"max_steps": 60, "model": {"hidden": 32}},
        tags={"restored_step": str(restored_step), "dagster_run_id": ""}, warn=_fail,
        run_dir=tmp_path / "store" / "r1", restored_step=restored_step,
    )  # fmt: skip
    assert tracker.mlflow_run_id is not None
    return tracker


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
    # The way back to Dagster (TRACKS_DAGSTER_URL, by default the local `dagster dev`).
    url = "http://127.0.0.1:3000/runs/dagster-run-1"
    assert run.data.tags["tracks.attempt.1.dagster_run_url"] == url
    assert run.data.tags["tracks.dagster_run_url"] == url
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


def test_a_resumed_attempt_logs_each_step_once_and_a_rollback_says_which_values_it_kept(
    tmp_path: Path,
) -> None:
    """Steps are logged every 10 and at the kill; the commit at 15 falls between two of them."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _tracker(uri, tmp_path, 1, 0)
    first.step(10, STEP)
    first.committed(15, {"eval_loss": 0.5})
    first.step(17, STEP)
    assert first.flush(60)  # live: MLflow has step 17, which no checkpoint covers
    # SIGKILLed after step 17: no goodbye. The next attempt restores step 15 and trains step 17
    # again (bit-exact: the value MLflow holds), then on.
    second = _tracker(uri, tmp_path, 2, 15)
    second.step(17, STEP)
    second.step(20, {**STEP, "loss": 0.5})
    second.committed(20, {"eval_loss": 0.4})
    assert second.flush(60)
    client = MlflowClient(tracking_uri=uri)
    run_id = second.mlflow_run_id
    assert _steps(client, run_id, "loss") == [10, 17, 20]
    assert _steps(client, run_id, "checkpoint.step") == [15, 20]
    assert _steps(client, run_id, "checkpoint.eval_loss") == [15, 20]
    tags = client.get_run(run_id).data.tags
    assert tags["tracks.checkpoint_path"] == str(tmp_path / "store" / "r1" / "step-0000000020-a02")
    assert tags["tracks.checkpoint_step"] == "20"

    # A rollback: attempt 3 restores step 15, behind the commit at 20, and trains 16-20 on
    # other batches. MLflow keeps the first value of each step, and a tag says so.
    third = _tracker(uri, tmp_path, 3, 15)
    third.step(20, {**STEP, "loss": 9.0})
    third.step(25, STEP)
    third.finished(3, "succeeded", final=True)
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert sorted(history) == [10, 17, 20, 25] and history[20] == 0.5
    rollback = client.get_run(run_id).data.tags["tracks.rollback.15"]
    assert rollback.startswith("attempt 3 restored step 15, behind the commit at step 20")
    assert rollback.endswith("steps 16-20 keep the values first logged")


def test_steps_an_attempt_could_not_log_reach_mlflow_from_its_journal(tmp_path: Path) -> None:
    """MLflow was unreachable for attempt 1 (it trained steps 1-20 and committed 20 anyway);
    attempt 2 restores step 20, which it never trains again: the journal fills them in."""
    warnings: list[str] = []
    (tmp_path / "a-file").write_text("")  # no store can be made below a file
    down = TrainingTracker(
        tracking_uri=f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}",
        artifact_root=None, run_id="r1", attempt_no=1, config={"max_steps": 60},
        tags={}, warn=warnings.append, run_dir=tmp_path / "store" / "r1", restored_step=0,
    )  # fmt: skip
    assert down.mlflow_run_id is None
    for step in range(10, 21, 10):
        down.step(step, {**STEP, "loss": 1.0 / step})
    down.committed(20, {"eval_loss": 0.5})
    down.finished(1, "preempted", final=False)
    assert len(warnings) == 1 and warnings[0].startswith("MLflow tracking is off for this attempt")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    up = _tracker(uri, tmp_path, 2, 20)
    up.step(30, STEP)
    up.finished(2, "succeeded", final=True)
    client = MlflowClient(tracking_uri=uri)
    history = {m.step: m.value for m in client.get_metric_history(up.mlflow_run_id, "loss")}
    assert history == {10: 0.1, 20: 0.05, 30: STEP["loss"]}
    assert _steps(client, up.mlflow_run_id, "checkpoint.step") == [20]  # its restored commit
    assert _steps(client, up.mlflow_run_id, "checkpoint.eval_loss") == [20]  # from the journal


def _steps(client: MlflowClient, mlflow_run_id: str, metric: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(mlflow_run_id, metric))


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
