"""Live preemption drill: a real ``dagster dev`` (webserver + daemon) with the sensors on.

The trainer is killed mid-run; the resume sensor continues the run from its last committed
checkpoint with nobody acting, and the result equals an uninterrupted run bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.checkpoint import is_committed
from pipeline.checkpoint.layout import MODEL_FILE
from pipeline.ledger import AttemptRecord, Ledger
from tests.dagster_dev import (
    REPO_ROOT,
    DagsterDev,
    launch_graph,
    live_drill,
    trainer_pids,
    wait_for,
)

pytestmark = pytest.mark.slow

# Slow enough to kill mid-run: the trainer pauses after step 250 (a test hook), by which time
# step 200 is committed. A stop signal ends the pause at once.
PAUSE = {"TRACKS_FAULT_SLEEP_AFTER_STEP": "8@250"}
TRAINING = {"max_steps": 400, "checkpoint_every_steps": 100, "keep_last_k": 5}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DagsterDev, Path, str]]:
    with live_drill(tmp_path_factory.mktemp("drill") / "tracks", PAUSE) as live:
        yield live


def _ledger(home: Path) -> Ledger:
    return Ledger.open(f"sqlite:///{home / 'ledger.db'}")


def _start_and_wait_for_commit(server: DagsterDev, home: Path, snapshot: str, config: dict) -> str:
    """Launch a run and return its training run id once step 200 is committed: in the ledger
    and on disk. The ledger's commit comes first (it checks the fencing token); a kill between
    the two leaves a directory without COMMITTED, which the next attempt marks corrupt."""
    dagster_run = launch_graph(
        server, snapshot, {**config, "train": {**TRAINING, **config.get("train", {})}}
    )
    ledger = _ledger(home)

    def committed_run() -> str | None:
        for attempt in ledger.list_attempts(limit=20):
            if attempt.dagster_run_id == dagster_run:
                latest = ledger.latest_committed_checkpoint(attempt.run_id)
                if (
                    latest is not None
                    and latest.step >= 200
                    and is_committed(Path(latest.path))
                    and trainer_pids(attempt.run_id)
                ):
                    return attempt.run_id
        return None

    return wait_for(committed_run, 180, "a committed checkpoint at step 200")


def _uninterrupted_final_weights(attempt: AttemptRecord, tmp_path: Path) -> bytes:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(attempt.config_snapshot))
    store = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
         "--run-id", "reference", "--store", str(store)],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("TRACKS_FAULT")},
    )  # fmt: skip
    [final] = sorted((store / "reference").glob("step-0000000400-*"))
    return (final / MODEL_FILE).read_bytes()


@pytest.mark.parametrize(
    "kill_signal", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"]
)
def test_sensor_resumes_a_killed_trainer_to_the_uninterrupted_result(
    live: tuple[DagsterDev, Path, str], kill_signal: signal.Signals, tmp_path: Path
) -> None:
    server, home, snapshot = live
    run_id = _start_and_wait_for_commit(
        server, home, snapshot, {"train": {"seed": int(kill_signal)}}
    )
    for pid in trainer_pids(run_id):
        os.kill(pid, kill_signal)

    ledger = _ledger(home)
    resumed: AttemptRecord = wait_for(
        lambda: next(
            (a for a in ledger.attempts(run_id) if a.attempt_no == 2 and a.ended_at), None
        ),
        240,
        "the resumed attempt to finish",
        interval=1.0,
    )
    first, second = ledger.attempts(run_id)
    assert first.termination_reason == "preempted", first.termination_detail
    assert first.retry_decision["action"] == "resume"
    assert second.termination_reason == "succeeded", second.termination_detail
    assert second.resumed_from_checkpoint is not None
    resumed_step = ledger.get_checkpoint(second.resumed_from_checkpoint).step
    if kill_signal == signal.SIGKILL:
        # Killed outright: the steps after the last commit are lost, and only those.
        assert resumed_step == 200
    else:
        # Asked to stop: it finished its step and committed right there; zero steps lost.
        assert "SIGTERM" in first.termination_detail
        assert resumed_step > 200
        assert resumed_step == first.last_step
    # The continuation carried on through the graph: evaluated, and a promotion decided (the
    # gate may refuse against an earlier case's champion; either way the decision is recorded).
    server.wait_for_run(resumed.dagster_run_id, timeout=180)
    assert {e.evaluator_name for e in ledger.evaluations_for_run(run_id)} == {
        "holdout_accuracy",
        "noise_robustness",
    }
    assert len(ledger.promotions(run_id=run_id)) == 1

    final = ledger.latest_committed_checkpoint(run_id)
    assert final is not None and final.step == 400 and final.attempt_no == 2
    weights = (Path(final.path) / MODEL_FILE).read_bytes()
    assert weights == _uninterrupted_final_weights(second, tmp_path)


def test_zero_budget_means_no_resume_and_the_attempt_says_why(
    live: tuple[DagsterDev, Path, str],
) -> None:
    server, home, snapshot = live
    run_id = _start_and_wait_for_commit(
        server,
        home,
        snapshot,
        {"train": {"seed": 7}, "retry_policy": "preempted: {max_attempts: 0}"},
    )
    for pid in trainer_pids(run_id):
        os.kill(pid, signal.SIGKILL)
    ledger = _ledger(home)
    wait_for(lambda: ledger.attempts(run_id)[0].ended_at, 60, "the attempt to be closed")
    time.sleep(15)  # three resume-sensor ticks
    [only] = ledger.attempts(run_id)
    assert only.termination_reason == "preempted"
    assert only.retry_decision["action"] == "stop"
    assert "budget" in only.retry_decision["reason"]
    assert ledger.get_run(run_id).status == "failed"


TERMINATE_RUN = """
mutation($id: String!) { terminateRun(runId: $id) { __typename } }
"""


def test_a_terminated_dagster_run_checkpoints_stops_and_is_not_resumed(
    live: tuple[DagsterDev, Path, str],
) -> None:
    """Terminate in the UI: the step asks the trainer to checkpoint and stop, the receipt says a
    person cancelled, and the resume sensor leaves the run alone."""
    server, home, snapshot = live
    run_id = _start_and_wait_for_commit(server, home, snapshot, {"train": {"seed": 13}})
    ledger = _ledger(home)
    [attempt] = ledger.attempts(run_id)
    terminated = server.graphql(TERMINATE_RUN, {"id": attempt.dagster_run_id})["terminateRun"]
    assert terminated["__typename"] == "TerminateRunSuccess", terminated
    assert server.wait_for_run(attempt.dagster_run_id, timeout=120) == "CANCELED"
    wait_for(lambda: not trainer_pids(run_id), 60, "the trainer to exit")
    wait_for(lambda: ledger.attempts(run_id)[0].ended_at, 60, "the attempt to be closed")
    time.sleep(10)  # two resume-sensor ticks: a cancelled run is not resumed
    [only] = ledger.attempts(run_id)
    assert only.termination_reason == "cancelled", only.termination_detail
    assert "A person cancelled the run" in only.termination_detail
    assert only.retry_decision["action"] == "stop"
    # Asked to stop, the trainer finished its step and committed right there.
    latest = ledger.latest_committed_checkpoint(run_id)
    assert latest is not None and latest.step == only.last_step > 200
