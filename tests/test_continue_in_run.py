"""Continuing in place: the Dagster step that saw its trainer die opens the next attempt itself.

The rule, unit by unit: which decisions continue in place, what the in-place attempt's receipt
says, and the sensor's side (a continuation is left to the Dagster run that hosted the ended
attempt while that run may still be executing). The live case, a SIGKILLed trainer continued
by its own Dagster run to the uninterrupted result, is in tests/test_preemption_drill.py, on
the same ``dagster dev`` as the sensor's cases.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets.launch import continued_in_run, launched_by
from pipeline.continuation import (
    IN_RUN_CLAIM_SECONDS,
    IN_RUN_MAX_BACKOFF_SECONDS,
    continues_in_run,
)
from pipeline.explain import explain
from pipeline.launch_facts import contradicted_tags, trainer_source_words
from pipeline.ledger import Ledger
from pipeline.retry import RetryAction, RetryDecision
from pipeline.states import RunStatus, TerminationReason
from tests.sensor_support import ended_attempt, resume_tick, silent_attempt


def _decision(action: RetryAction, backoff: float) -> RetryDecision:
    return RetryDecision(
        action=action, rule="r", reason="why", termination_reason=TerminationReason.PREEMPTED,
        attempt_no=1, budget_left={}, spent={}, backoff_seconds=backoff,
    )  # fmt: skip


def test_only_a_continuing_decision_with_a_short_wait_continues_in_place() -> None:
    assert continues_in_run(_decision(RetryAction.RESUME, 0.0))
    assert continues_in_run(_decision(RetryAction.ROLLBACK, IN_RUN_MAX_BACKOFF_SECONDS))
    assert not continues_in_run(_decision(RetryAction.RETRY, 30.0))  # infra_transient's wait
    for action in (RetryAction.STOP, RetryAction.NONE, RetryAction.NEWER_ATTEMPT):
        assert not continues_in_run(_decision(action, 0.0))
    assert not continues_in_run(_decision(RetryAction.RESUME, float("nan")))


def test_an_in_place_attempt_names_its_dagster_run_and_the_attempt_it_continues() -> None:
    # Launched from the UI by ana, on the run config's trainer; its tags name the first attempt.
    tags = {"dagster/user": "ana", "tracks/run_id": "r1"}
    first = launched_by(tags) | {"trainer_config": {"from": "run_config", "dagster_run_id": "d1"}}
    second = continued_in_run(first, "d1", "r1#1", 1, "preempted", "preempted_resume")
    assert second == {
        "via": "in_run:d1", "continues_attempt": "1", "ended_attempt": "r1#1",
        "termination_reason": "preempted", "rule": "preempted_resume", "user": "ana",
        "trainer_config": {"from": "run_config", "dagster_run_id": "d1"},
    }  # fmt: skip
    assert contradicted_tags(second, "r1", 2) is None
    assert trainer_source_words(second, ()).startswith(
        "launched by in_run:d1 with the resources.trainer run config of Dagster run d1"
    )
    # Nobody launches "in_run" by tag: a run tagged so was launched by hand.
    assert launched_by({"tracks/launched_by": "in_run:d9"})["via"] == "ui"


def _hosting(status: dg.DagsterRunStatus, run_config: dict[str, Any] | None = None) -> Any:
    return dg.DagsterRun(
        job_name="__ASSET_JOB", run_id="dr-host", status=status, run_config=run_config or {}
    )


def test_the_sensor_leaves_a_continuation_to_the_dagster_run_still_running_it(
    tmp_path: Path,
) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, TerminationReason.PREEMPTED, dagster_run_id="dr-host")
    assert ledger.get_run("r1").status == RunStatus.RUNNING
    for status in (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING):
        logged: list[str] = []
        result = resume_tick(ledger, root=tmp_path, dagster_runs=[_hosting(status)], logged=logged)
        assert isinstance(result, dg.SkipReason), result
        assert any(
            line.startswith("r1:attempt-2: not launched: Dagster run dr-host, which ran attempt "
                            f"r1#1, is still {status.value}")
            for line in logged
        ), logged  # fmt: skip
    # Once that run has ended (its step failed, or it did not continue in place): launched,
    # with the launch's continue_in_run carried over.
    off = {"ops": {"training_attempt": {"config": {"continue_in_run": False}}}}
    result = resume_tick(
        ledger, root=tmp_path, dagster_runs=[_hosting(dg.DagsterRunStatus.FAILURE, off)], logged=[]
    )
    assert isinstance(result, dg.SensorResult)
    [request] = result.run_requests
    assert request.run_key == "r1:attempt-2"
    assert request.run_config["ops"]["training_attempt"]["config"] == {
        "run_id": "r1",
        "continue_in_run": False,
    }


def test_a_dagster_run_unfinished_long_after_its_attempt_ended_no_longer_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its run worker died with the node and nothing marked the run failed: the sensor goes on
    (fencing makes a late second attempt lose)."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, TerminationReason.PREEMPTED, dagster_run_id="dr-host")
    assert ledger.get_run("r1").status == RunStatus.RUNNING
    ended_at = ledger.get_attempt("r1", 1).ended_at
    assert ended_at is not None and ended_at <= datetime.now(UTC)
    monkeypatch.setattr("pipeline.continuation.IN_RUN_CLAIM_SECONDS", 0.0)
    logged: list[str] = []
    result = resume_tick(
        ledger, root=tmp_path, dagster_runs=[_hosting(dg.DagsterRunStatus.STARTED)], logged=logged
    )
    assert isinstance(result, dg.SensorResult), logged
    assert [r.run_key for r in result.run_requests] == ["r1:attempt-2"]
    assert any("still STARTED" in line and "launching the continuation" in line for line in logged)


def test_a_silent_attempt_is_left_to_the_dagster_run_still_running_it(tmp_path: Path) -> None:
    """That run's step sees how the trainer ended (a trainer cut off from the ledger goes on
    training, then exits with its own reason): the sensor does not call it lost meanwhile."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    timeout = 60.0  # TRACKS_HEARTBEAT_TIMEOUT's default, which the sensor runs under here
    silent_attempt(ledger, silent_for=timedelta(seconds=timeout + 30), dagster_run_id="dr-host")
    for status in (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING):
        logged: list[str] = []
        result = resume_tick(ledger, root=tmp_path, dagster_runs=[_hosting(status)], logged=logged)
        assert isinstance(result, dg.SkipReason), result
        assert ledger.get_attempt("r1", 1).ended_at is None
        assert any(
            line.startswith("attempt r1#1: no heartbeat for ")
            and "s; left open for Dagster run dr-host, which launched it and is still "
            f"{status.value}"
            in line
            for line in logged
        ), logged
    # That run ended without ending the attempt: closed from what remains, and continued.
    result = resume_tick(
        ledger, root=tmp_path, dagster_runs=[_hosting(dg.DagsterRunStatus.FAILURE)], logged=[]
    )
    assert ledger.get_attempt("r1", 1).termination_reason == "preempted"
    assert isinstance(result, dg.SensorResult)
    assert [r.run_key for r in result.run_requests] == ["r1:attempt-2"]


def test_a_dagster_run_that_never_ends_its_silent_attempt_does_not_hold_it_or_the_next(
    tmp_path: Path,
) -> None:
    """Its run worker died with the node and nothing marked the run failed: past the claim the
    sensor closes the attempt, and launches the continuation on the same tick (the claim is
    counted from when the attempt went quiet, not from the sensor's own close)."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    quiet = 60.0 + IN_RUN_CLAIM_SECONDS + 30
    silent_attempt(ledger, silent_for=timedelta(seconds=quiet), dagster_run_id="dr-host")
    logged: list[str] = []
    result = resume_tick(
        ledger, root=tmp_path, dagster_runs=[_hosting(dg.DagsterRunStatus.STARTED)], logged=logged
    )
    attempt = ledger.get_attempt("r1", 1)
    assert attempt.termination_reason == "preempted", logged
    assert any(
        line.startswith("attempt r1#1: no heartbeat for ")
        and "s, and Dagster run dr-host, which launched it, is still STARTED" in line
        and line.endswith("without ending it; closing it here")
        for line in logged
    ), logged
    assert isinstance(result, dg.SensorResult), logged
    assert [r.run_key for r in result.run_requests] == ["r1:attempt-2"]


@pytest.mark.parametrize(
    ("status", "silent_for"),
    [
        (dg.DagsterRunStatus.CANCELED, 90.0),
        # Still being terminated long past the claim: its run worker was killed mid-cleanup.
        (dg.DagsterRunStatus.CANCELING, 60.0 + IN_RUN_CLAIM_SECONDS + 30),
    ],
)
def test_a_silent_attempt_whose_dagster_run_was_terminated_ends_cancelled_and_stops(
    tmp_path: Path, status: dg.DagsterRunStatus, silent_for: float
) -> None:
    """A person terminated the Dagster run and its run worker died before closing the receipt:
    the trainer's SIGTERM checkpoint and last words say preempted, which the sensor would
    resume. The terminated run is the evidence that decides: cancelled, and the run stops."""
    import json

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    silent_attempt(ledger, silent_for=timedelta(seconds=silent_for), dagster_run_id="dr-host")
    words = tmp_path / "tracks" / "checkpoints" / "r1" / "attempt-1.last_words.json"
    words.parent.mkdir(parents=True)
    words.write_text(json.dumps({
        "run_id": "r1", "attempt_no": 1, "reason": "preempted", "exit_code": 75, "step": 40,
        "signal": "SIGTERM", "detail": "SIGTERM received; committed step 40 and stopped",
    }))  # fmt: skip
    logged: list[str] = []
    result = resume_tick(ledger, dagster_runs=[_hosting(status)], logged=logged)
    attempt = ledger.get_attempt("r1", 1)
    assert attempt.termination_reason == "cancelled", (attempt.termination_detail, logged)
    assert attempt.termination_detail == (
        "A person terminated Dagster run dr-host, which launched this attempt, and that run "
        "ended without closing its receipt; the trainer stopped on SIGTERM; it reached step 40; "
        "no checkpoint was committed."  # the ledger holds no commit: last words are not one
    ), attempt.termination_detail
    assert (attempt.retry_decision or {}).get("action") == "stop", attempt.retry_decision
    assert ledger.get_run("r1").status == RunStatus.FAILED
    assert "Status **failed** (stopped because a person cancelled it)" in explain(ledger, "r1")
    assert isinstance(result, dg.SkipReason), result
    assert any(f"was terminated ({status.value}) without ending it" in line for line in logged)


def test_a_hosting_run_that_cannot_be_read_leaves_the_silent_attempt_to_the_heartbeat_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dagster's run storage failing for one run does not fail the tick: that attempt is closed
    from its silence, as without a hosting run, and the error is logged without its password
    (its continuation, which reads the same run, waits for a tick that can)."""

    def unreadable(self: dg.DagsterInstance, run_id: str) -> None:
        raise ConnectionError("postgresql://dagster:hunter2@db.internal/dagster is unreachable")

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    silent_attempt(ledger, silent_for=timedelta(seconds=90), dagster_run_id="dr-host")
    monkeypatch.setattr(dg.DagsterInstance, "get_run_by_id", unreadable)
    logged: list[str] = []
    result = resume_tick(ledger, logged=logged)
    assert ledger.get_attempt("r1", 1).termination_reason == "preempted"
    assert isinstance(result, dg.SkipReason), result
    assert any(line.startswith("attempt r1#1: Dagster run dr-host unreadable") for line in logged)
    assert any(line.startswith("r1:attempt-2: not launched this tick") for line in logged)
    assert all("hunter2" not in line for line in logged), logged


def _stopped_by_a_termination(ledger: Ledger, logged: list[str], reason: str) -> dict[str, Any]:
    """Attempt r1#1's decision, checked to be the stop a terminated Dagster run records (its
    reason starting with ``reason``), with run r1 failed and the sensor saying why it launched
    nothing."""
    decision = ledger.get_attempt("r1", 1).retry_decision or {}
    assert decision["action"] == "stop" and decision["rule"] == "terminated_before_continuing"
    assert decision["reason"].startswith(reason), decision["reason"]
    assert ledger.get_run("r1").status == RunStatus.FAILED
    assert any(line.startswith("r1:attempt-2: not launched: Stop: A person") for line in logged)
    return decision


def test_a_dagster_run_terminated_after_its_attempt_ended_stops_the_run(tmp_path: Path) -> None:
    """The termination landed in that run's step after the attempt ended with resume (while it
    decided whether to continue in place): the decision still says resume, but the run stops,
    as its step would have stopped it, and nothing is launched, now or on a later tick."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, TerminationReason.PREEMPTED, dagster_run_id="dr-host")
    canceled = [_hosting(dg.DagsterRunStatus.CANCELED)]
    logged: list[str] = []
    result = resume_tick(ledger, root=tmp_path, dagster_runs=canceled, logged=logged)
    assert isinstance(result, dg.SkipReason), result
    decision = _stopped_by_a_termination(
        ledger,
        logged,
        "Stop: A person terminated Dagster run dr-host after attempt r1#1 ended and before the "
        "run was continued (the resume sensor found that Dagster run CANCELED)",
    )
    assert decision["previous"]["action"] == "resume"
    page = explain(ledger, "r1")
    assert "Status **failed** (stopped because a person cancelled it)" in page, page[:600]
    assert "then **stop**: Stop: A person terminated Dagster run dr-host after attempt" in page
    assert isinstance(resume_tick(ledger, root=tmp_path, dagster_runs=canceled), dg.SkipReason)
    assert (ledger.get_attempt("r1", 1).retry_decision or {})["previous"]["action"] == "resume"


def test_a_continuation_a_person_terminated_before_it_opened_its_attempt_is_not_relaunched(
    tmp_path: Path,
) -> None:
    """The sensor's continuation, terminated while queued or starting: a person's stop, not a
    run that died on its own (those are relaunched, at most three times)."""
    from sensors.resume import CONTINUATION_TAG, SENSOR_NAME

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, TerminationReason.PREEMPTED, dagster_run_id="dr-host")
    continuation = dg.DagsterRun(
        job_name="__ASSET_JOB", run_id="dr-next", status=dg.DagsterRunStatus.CANCELED,
        tags={CONTINUATION_TAG: "r1:attempt-2", "dagster/sensor_name": SENSOR_NAME},
    )  # fmt: skip
    runs = [_hosting(dg.DagsterRunStatus.FAILURE), continuation]
    logged: list[str] = []
    result = resume_tick(ledger, root=tmp_path, dagster_runs=runs, logged=logged)
    assert isinstance(result, dg.SkipReason), result
    _stopped_by_a_termination(
        ledger,
        logged,
        "Stop: A person terminated Dagster run dr-next (the resume sensor's continuation of "
        "attempt r1#1) before it opened attempt 2; the earlier decision (resume",
    )
