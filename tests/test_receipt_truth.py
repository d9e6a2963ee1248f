"""Receipts state what happened, never what was planned.

Each case was reproduced before the fix: an attempt that died before its trainer restored
anything read "resumed from step-100, restored step 100"; a fresh retry SIGKILLed at step 50
read "reached 200" (its predecessor's commit); an attempt closed by heartbeat expiry cost 0
GPU-seconds; and the run's final checkpoint was a failed attempt's higher step.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from pipeline.attempts import PreparedAttempt, finish_attempt, prepare_attempt
from pipeline.continuation import expire_silent_attempts
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import Snapshot, create_snapshot
from pipeline.explain import explain
from pipeline.ledger import AttemptRecord, AttemptStart, Ledger
from pipeline.ledger.schema import training_attempts
from pipeline.states import TerminationReason
from pipeline.trainer.config import TrainConfig


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")


@pytest.fixture
def snapshot(tmp_path: Path) -> Snapshot:
    write_digits_landing(tmp_path / "landing")
    return create_snapshot(tmp_path / "landing", tmp_path / "snapshots")


def _config(snapshot: Snapshot, **changes: object) -> TrainConfig:
    raw = {
        "seed": 3, "max_steps": 300, "checkpoint_every_steps": 50, "batch_size": 64,
        "learning_rate": 0.003, "optimizer": "adam", "keep_last_k": 10,
        "model": {"channels": 8, "hidden": 32},
    }  # fmt: skip
    raw |= {"snapshot_dir": str(snapshot.path), **changes}
    return TrainConfig.from_dict(raw, source="test")


def _commit(ledger: Ledger, attempt: AttemptRecord, step: int) -> str:
    path = f"/ckpt/{attempt.run_id}/step-{step:010d}-a{attempt.attempt_no:02d}"
    ledger.commit_checkpoint(
        run_id=attempt.run_id, attempt_no=attempt.attempt_no, path=path,
        manifest_sha256="m" * 64, size_bytes=1, metrics=None,
        fencing_token=attempt.fencing_token, step=step,
    )  # fmt: skip
    return path


def _end(ledger: Ledger, attempt: AttemptRecord, reason: TerminationReason) -> None:
    ledger.end_attempt(
        attempt.run_id, attempt.attempt_no, termination_reason=reason, termination_detail="t"
    )


def _begin(
    ledger: Ledger, run_id: str, placement: dict | None = None, dagster_run_id: str | None = None
) -> AttemptRecord:
    start = AttemptStart(
        config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
        container_digest="env", placement=placement or {}, dagster_run_id=dagster_run_id,
    )  # fmt: skip
    return ledger.begin_attempt(run_id, start)


def _first_attempt(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path, config: TrainConfig
) -> PreparedAttempt:
    return prepare_attempt(
        ledger, snapshot=snapshot, train_config=config, work_root=tmp_path / "work"
    )


def _after_an_oom_at_step_200(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> PreparedAttempt:
    """A run whose first attempt committed step 200, then ran out of memory."""
    first = _first_attempt(ledger, snapshot, tmp_path, _config(snapshot))
    _commit(ledger, first.attempt, 200)
    _end(ledger, first.attempt, TerminationReason.OOM)
    return first


def _sigkilled(
    ledger: Ledger,
    first: PreparedAttempt,
    attempt: AttemptRecord,
    snapshot: Snapshot,
    tmp_path: Path,
) -> AttemptRecord:
    """``attempt`` of ``first``'s run (a smaller batch: another config), ended by SIGKILL."""
    prepared = PreparedAttempt(
        run=first.run,
        attempt=attempt,
        train_config=_config(snapshot, batch_size=32),
        config_path=first.config_path,
        planned_resume_from=None,
        oom_kills_before=None,
    )
    return finish_attempt(
        ledger, prepared, store=tmp_path / "store", returncode=-9, signal_name="SIGKILL"
    ).attempt


def test_an_attempt_that_dies_before_its_restore_claims_no_restore(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    config = _config(snapshot)
    first = _first_attempt(ledger, snapshot, tmp_path, config)
    planned = _commit(ledger, first.attempt, 100)
    _end(ledger, first.attempt, TerminationReason.PREEMPTED)
    second = prepare_attempt(
        ledger, snapshot=snapshot, train_config=config, work_root=tmp_path / "work",
        run_id=first.run.run_id,
    )  # fmt: skip
    assert second.planned_resume_from is not None and second.planned_resume_from.path == planned
    opened = ledger.get_attempt(second.run.run_id, second.attempt.attempt_no)
    assert (opened.resumed_from_checkpoint, opened.restored_step) == (None, None)
    # The trainer dies loading its data: it never reported a restore.
    finished = finish_attempt(
        ledger, second, store=tmp_path / "store", returncode=1, signal_name=None
    )
    assert finished.attempt.resumed_from_checkpoint is None
    assert finished.attempt.restored_step is None
    # What the trainer reports is what the receipt then says (0: a fresh start).
    ledger.set_resumed_from(second.run.run_id, second.attempt.attempt_no, None)
    assert ledger.get_attempt(second.run.run_id, second.attempt.attempt_no).restored_step == 0


def test_a_fresh_retry_does_not_reach_its_predecessors_step(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    first = _after_an_oom_at_step_200(ledger, snapshot, tmp_path)
    run_id = first.run.run_id
    # The retry starts fresh (its smaller batch is another config) and is SIGKILLed at 50.
    retry = _begin(ledger, run_id)
    ledger.set_resumed_from(run_id, retry.attempt_no, None)
    ledger.heartbeat(run_id, retry.attempt_no, step=50)
    ended = _sigkilled(ledger, first, retry, snapshot, tmp_path)
    assert ended.last_step == 50, ended.last_step
    # Its own commit does count.
    third = _begin(ledger, run_id)
    ledger.set_resumed_from(run_id, third.attempt_no, None)
    _commit(ledger, third, 80)
    assert _sigkilled(ledger, first, third, snapshot, tmp_path).last_step == 80


def test_a_silent_attempt_is_charged_its_accelerators_until_its_last_heartbeat(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    run_id = _after_an_oom_at_step_200(ledger, snapshot, tmp_path).run.run_id
    silent = _begin(ledger, run_id, placement={"accelerator_count": 2})
    ledger.set_resumed_from(run_id, silent.attempt_no, None)  # started fresh
    ledger.heartbeat(run_id, silent.attempt_no, step=50)
    now = datetime.now(UTC)
    with ledger.engine.begin() as conn:
        conn.execute(
            sa.update(training_attempts)
            .where(training_attempts.c.attempt_no == silent.attempt_no)
            .values(started_at=now - timedelta(hours=2), heartbeat_at=now - timedelta(hours=1))
        )
    (closed,) = expire_silent_attempts(ledger, 600, now=now)
    assert closed.termination_reason == "preempted"
    assert closed.gpu_seconds == pytest.approx(2 * 3600.0)
    assert closed.cpu_seconds == 0  # never measured: a silent trainer reported none
    assert closed.last_step == 50  # not attempt 1's step 200


def test_the_final_checkpoint_is_the_succeeded_attempts_not_the_highest_step(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    run_id = _after_an_oom_at_step_200(ledger, snapshot, tmp_path).run.run_id
    # Relaunched with max_steps 100: it starts fresh and succeeds at step 100.
    relaunch = _begin(ledger, run_id)
    final = _commit(ledger, relaunch, 100)
    _end(ledger, relaunch, TerminationReason.SUCCEEDED)
    chosen = ledger.latest_committed_checkpoint(run_id, final=True)
    assert chosen is not None and chosen.path == final
    # What a next attempt resumes from is still the highest step.
    assert ledger.latest_committed_checkpoint(run_id).step == 200


def test_no_final_checkpoint_without_a_succeeded_attempt(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    first = _after_an_oom_at_step_200(ledger, snapshot, tmp_path)
    assert ledger.latest_committed_checkpoint(first.run.run_id, final=True) is None


def test_a_sigkill_seen_after_the_sensor_closed_the_silent_attempt_adds_a_note_only(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    """The resume sensor found the attempt silent past the timeout and closed it, with its
    decision; then the Dagster run that launched it saw its trainer die. The first ending and
    decision stand (one decision, no second one nested under it), what the Dagster run saw is a
    note on the attempt, and the Dagster run does not carry the run on too."""
    prepared = _first_attempt(ledger, snapshot, tmp_path, _config(snapshot))
    later = datetime.now(UTC) + timedelta(hours=1)
    [closed] = expire_silent_attempts(ledger, 60, now=later)
    finished = finish_attempt(
        ledger, prepared, store=tmp_path / "store", returncode=-9, signal_name="SIGKILL"
    )
    assert not finished.ended_here
    assert finished.attempt == ledger.get_attempt(closed.run_id, 1)
    assert finished.attempt.termination_detail == closed.termination_detail
    assert finished.decision.to_json() == closed.retry_decision
    assert "previous" not in closed.retry_decision
    [note] = ledger.notes(closed.run_id)
    assert note.attempt_no == 1 and "saw this attempt's trainer end (SIGKILL" in note.text
    assert f"had ended the attempt {closed.termination_reason}" in note.text
    # Tracks' own note, not a person's, as the logbook tells it.
    assert f"**note {note.note_id}** on attempt 1 recorded by **Tracks** itself" in explain(
        ledger, closed.key
    )


def test_an_attempt_ended_by_its_launcher_while_the_sensor_judged_it_silent_stays_as_ended(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sensor read the attempt as silent; before it closed it, the Dagster run that
    launched it ended it with the exit it saw. The sensor leaves it alone."""
    prepared = _first_attempt(ledger, snapshot, tmp_path, _config(snapshot))
    later = datetime.now(UTC) + timedelta(hours=1)
    silent = ledger.silent_attempts(60, now=later)
    finished = finish_attempt(
        ledger, prepared, store=tmp_path / "store", returncode=-9, signal_name="SIGKILL"
    )
    monkeypatch.setattr(ledger, "silent_attempts", lambda *_a, **_k: silent)  # read before
    assert expire_silent_attempts(ledger, 60, now=later) == []
    assert ledger.get_attempt(prepared.run.run_id, 1) == finished.attempt
    assert finished.ended_here and finished.attempt.signal == "SIGKILL"
    assert finished.attempt.retry_decision == finished.decision.to_json()


def test_a_termination_while_waiting_to_continue_in_place_stops_the_run(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    """Attempt 1 was preempted and its Dagster run waited out the backoff to continue in place;
    a person terminated that Dagster run during the wait. The receipt says so, and the resume
    sensor finds nothing to continue (its decision was resume a moment before)."""
    from pipeline.attempts import stop_after_termination
    from pipeline.continuation import pending_continuations

    prepared = _first_attempt(ledger, snapshot, tmp_path, _config(snapshot))
    run_id = prepared.run.run_id
    finished = finish_attempt(
        ledger, prepared, store=tmp_path / "store", returncode=-15, signal_name="SIGTERM"
    )
    assert finished.decision.continues
    assert [c.run.run_id for c in pending_continuations(ledger, on_skip=print)] == [run_id]
    stop_after_termination(ledger, run_id, 1, "dagster-run-1")
    decision = ledger.get_attempt(run_id, 1).retry_decision
    assert (decision["action"], decision["rule"]) == ("stop", "terminated_before_continuing")
    assert "A person terminated Dagster run dagster-run-1 while it waited" in decision["reason"]
    assert decision["previous"] == finished.decision.to_json()
    assert ledger.get_run(run_id).status == "failed"
    assert pending_continuations(ledger, on_skip=print) == []
    page = explain(ledger, run_id)
    assert "ended **preempted**; then **stop**: Stop: A person terminated Dagster run" in page
    assert "the retry policy decided **stop**" not in page


def test_a_termination_after_the_next_attempt_opened_cancels_it_unlaunched(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    """The Dagster run had opened attempt 2 to continue in place when it was terminated, before
    the trainer launched: attempt 2 ends cancelled, saying nothing was trained, instead of
    staying open until the heartbeat timeout called it a preemption."""
    from pipeline.attempts import stop_after_termination

    prepared = _first_attempt(ledger, snapshot, tmp_path, _config(snapshot))
    run_id = prepared.run.run_id
    finish_attempt(
        ledger, prepared, store=tmp_path / "store", returncode=-15, signal_name="SIGTERM"
    )
    second = _begin(ledger, run_id, dagster_run_id="dagster-run-1")
    closed = stop_after_termination(ledger, run_id, 1, "dagster-run-1")
    assert closed.attempt_no == second.attempt_no == 2
    assert closed.termination_reason == "cancelled"
    assert "before its trainer launched; nothing was trained" in closed.termination_detail
    assert closed.retry_decision["action"] == "stop"
    assert ledger.get_attempt(run_id, 1).retry_decision["action"] == "resume"  # unchanged
    assert ledger.get_run(run_id).status == "failed"


def test_an_attempt_opened_by_a_terminated_dagster_run_before_its_launch_ends_cancelled(
    ledger: Ledger, snapshot: Snapshot, tmp_path: Path
) -> None:
    """The Dagster run was terminated while it opened its first attempt (the row written, the
    trainer not launched): that attempt ends cancelled, once; another Dagster run's open attempt
    is not touched."""
    from pipeline.attempts import cancel_unlaunched

    opened = prepare_attempt(
        ledger, snapshot=snapshot, train_config=_config(snapshot), work_root=tmp_path / "work",
        dagster_run_id="dagster-run-9",
    )  # fmt: skip
    other = prepare_attempt(
        ledger, snapshot=snapshot, train_config=_config(snapshot), work_root=tmp_path / "work",
        dagster_run_id="dagster-run-10",
    )  # fmt: skip
    [closed] = cancel_unlaunched(ledger, "dagster-run-9")
    assert closed.key == opened.attempt.key and closed.termination_reason == "cancelled"
    assert closed.termination_detail == (
        "A person terminated Dagster run dagster-run-9 after this attempt was opened and before "
        "its trainer launched; nothing was trained."
    )
    assert closed.retry_decision["action"] == "stop"
    assert ledger.get_run(opened.run.run_id).status == "failed"
    assert cancel_unlaunched(ledger, "dagster-run-9") == []
    assert ledger.get_attempt(other.run.run_id, 1).ended_at is None
