"""Live preemption drill: a real ``dagster dev`` (webserver + daemon) with the sensors on.

The trainer is killed mid-run; the run continues from its last committed checkpoint with nobody
acting, and the result equals an uninterrupted run bit for bit: continued in place by the
Dagster run that saw the trainer die (the default), or, with ``continue_in_run`` off, by the
resume sensor in a Dagster run of its own.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.checkpoint.layout import MODEL_FILE
from pipeline.explain import explain
from pipeline.launch_facts import contradicted_tags
from pipeline.ledger import AttemptRecord
from tests.dagster_dev import DagsterDev, live_drill, trainer_pids, wait_for
from tests.drill_support import (
    PAUSE,
    drill_ledger,
    start_and_wait_for_commit,
    uninterrupted_final_weights,
)

pytestmark = pytest.mark.slow

# One seed for the three runs killed and continued (by the sensor after SIGKILL or SIGTERM, in
# place after SIGKILL): each must end with the weights of one uninterrupted run, trained once.
SEED = 5
RUNS_WITH_TAG = """
query($key: String!, $value: String!) {
  runsOrError(filter: {tags: [{key: $key, value: $value}]}) {
    ... on Runs { results { runId tags { key value } } }
  }
}
"""
RUN_TAGS = "query($id: ID!) { runOrError(runId: $id) { ... on Run { tags { key value } } } }"
RUN_CONFIG = "query($id: ID!) { runOrError(runId: $id) { ... on Run { runConfigYaml } } }"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DagsterDev, Path, str]]:
    with live_drill(tmp_path_factory.mktemp("drill") / "tracks", PAUSE) as live:
        yield live


@pytest.mark.parametrize(
    "kill_signal", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"]
)
def test_sensor_resumes_a_killed_trainer_to_the_uninterrupted_result(
    live: tuple[DagsterDev, Path, str], kill_signal: signal.Signals, tmp_path: Path
) -> None:
    server, home, snapshot = live
    # The resume sensor's continuation is the point: no continuing in place (see
    # test_a_sigkilled_trainer_is_continued_in_the_same_dagster_run_… for that).
    run_id = start_and_wait_for_commit(
        server, home, snapshot, {"train": {"seed": SEED}, "continue_in_run": False}
    )
    for pid in trainer_pids(run_id):
        os.kill(pid, kill_signal)

    ledger = drill_ledger(home)
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
    # The sensor's own Dagster run, carrying the launch's continue_in_run over.
    assert second.launched_by["via"] == "sensor:resume_after_preemption"
    assert second.dagster_run_id != first.dagster_run_id
    continuation = {"key": "tracks/continuation", "value": f"{run_id}:attempt-2"}
    [sensors_run] = server.graphql(RUNS_WITH_TAG, continuation)["runsOrError"]["results"]
    assert sensors_run["runId"] == second.dagster_run_id
    assert (
        server.graphql(RUN_CONFIG, {"id": second.dagster_run_id})["runOrError"][
            "runConfigYaml"
        ].count("continue_in_run: false")
        == 1
    )
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
    assert weights == uninterrupted_final_weights(second, tmp_path)


def test_a_sigkilled_trainer_is_continued_in_the_same_dagster_run_to_the_uninterrupted_result(
    live: tuple[DagsterDev, Path, str], tmp_path: Path
) -> None:
    server, home, snapshot = live
    ledger = drill_ledger(home)
    run_id = start_and_wait_for_commit(server, home, snapshot, {"train": {"seed": SEED}})
    [first_open] = ledger.attempts(run_id)
    dagster_run = first_open.dagster_run_id
    assert dagster_run is not None
    for pid in trainer_pids(run_id):
        os.kill(pid, signal.SIGKILL)

    second = wait_for(
        lambda: next(
            (a for a in ledger.attempts(run_id) if a.attempt_no == 2 and a.ended_at), None
        ),
        300,
        "attempt 2 to finish",
        interval=1.0,
    )
    first = ledger.get_attempt(run_id, 1)
    assert first.termination_reason == "preempted", first.termination_detail
    assert first.signal == "SIGKILL"
    assert first.retry_decision["action"] == "resume"
    assert second.termination_reason == "succeeded", second.termination_detail
    # The same Dagster run hosted both attempts, and says so on the receipt.
    assert second.dagster_run_id == dagster_run
    assert second.launched_by["via"] == f"in_run:{dagster_run}"
    assert second.launched_by["continues_attempt"] == "1"
    assert second.launched_by["ended_attempt"] == f"{run_id}#1"
    assert second.launched_by["termination_reason"] == "preempted"
    assert second.launched_by["rule"] == "preempted_resume"
    assert second.admission["rule"] == "preempted_resume"
    assert contradicted_tags(second.launched_by, run_id, 2) is None
    page = explain(ledger, f"{run_id}#2")
    assert (
        f"Continued in place by Dagster run {dagster_run} after attempt {run_id}#1 ended "
        "preempted, rule `preempted_resume`"
    ) in page, page
    # Killed outright: resumed from the last commit, step 200.
    assert second.resumed_from_checkpoint is not None
    assert ledger.get_checkpoint(second.resumed_from_checkpoint).step == 200

    # The whole graph went on in that one Dagster run: evaluated, a promotion decided (the
    # gate may refuse; either way its decision is recorded).
    server.wait_for_run(dagster_run, timeout=300)
    assert {e.evaluator_name for e in ledger.evaluations_for_run(run_id)} == {
        "holdout_accuracy",
        "noise_robustness",
    }
    assert len(ledger.promotions(run_id=run_id)) == 1
    # The resume sensor launched nothing for it, and no other Dagster run opened an attempt.
    continuation = {"key": "tracks/continuation", "value": f"{run_id}:attempt-2"}
    launched = server.graphql(RUNS_WITH_TAG, continuation)["runsOrError"]["results"]
    assert launched == [], launched
    assert [a.attempt_no for a in ledger.attempts_for_dagster_run(dagster_run)] == [1, 2]
    assert len(ledger.attempts(run_id)) == 2
    # The run's tags say the ledger's attempt.
    tags = server.graphql(RUN_TAGS, {"id": dagster_run})["runOrError"]["tags"]
    assert {"key": "tracks/attempt", "value": f"{run_id}#2"} in tags, tags

    final = ledger.latest_committed_checkpoint(run_id)
    assert final is not None and final.step == 400 and final.attempt_no == 2
    weights = (Path(final.path) / MODEL_FILE).read_bytes()
    assert weights == uninterrupted_final_weights(second, tmp_path)


def test_zero_budget_means_no_resume_and_the_attempt_says_why(
    live: tuple[DagsterDev, Path, str],
) -> None:
    server, home, snapshot = live
    run_id = start_and_wait_for_commit(
        server,
        home,
        snapshot,
        {"train": {"seed": 7}, "retry_policy": "preempted: {max_attempts: 0}"},
    )
    for pid in trainer_pids(run_id):
        os.kill(pid, signal.SIGKILL)
    ledger = drill_ledger(home)
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
    run_id = start_and_wait_for_commit(server, home, snapshot, {"train": {"seed": 13}})
    ledger = drill_ledger(home)
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
