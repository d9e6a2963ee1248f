"""The ledger under faults: which errors are retried, and a retried write never happens twice."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from pipeline.ledger import AttemptStart, Ledger
from pipeline.ledger.ledger import is_retryable
from pipeline.states import TerminationReason


class _PgError(Exception):
    def __init__(self, message: str, pgcode: str | None) -> None:
        super().__init__(message)
        self.pgcode = pgcode


def _db_error(message: str, pgcode: str | None = None, cls: type = sa.exc.OperationalError) -> Any:
    return cls("UPDATE …", {}, _PgError(message, pgcode))


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (_db_error("terminating connection due to administrator command", "57P01"), True),
        (_db_error("FATAL: the database system is shutting down", None), True),
        (_db_error("FATAL: the database system is starting up", "57P03"), True),
        (_db_error("could not serialize access", "40001"), True),
        (_db_error("deadlock detected", "40P01"), True),
        (_db_error("sorry, too many clients already", "53300"), True),
        (_db_error("connection to server was lost", "08006"), True),
        (_db_error("database is locked"), True),
        (_db_error("duplicate key value", "23505", sa.exc.IntegrityError), False),
        (_db_error("syntax error", "42601", sa.exc.ProgrammingError), False),
        (ValueError("not a database error"), False),
    ],
)
def test_which_errors_are_transient(error: Exception, retried: bool) -> None:
    assert is_retryable(error) is retried


class _LosesTheFirstCommitAnswer:
    """The server commits, then the connection drops before the client hears so."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self.lost = 0

    @contextmanager
    def begin(self) -> Iterator[sa.Connection]:
        with self._engine.begin() as conn:
            yield conn
        if not self.lost:
            self.lost += 1
            raise sa.exc.OperationalError(
                "COMMIT", {}, _PgError("server closed the connection unexpectedly", None),
                connection_invalidated=True,
            )  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_a_begin_attempt_whose_commit_answer_was_lost_is_not_repeated(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger.open(ledger_url)
    ledger.create_run(
        run_id="r1", model_family="digits-cnn", owner="t", purpose="baseline",
        config_sha256="c" * 64, snapshot_id="digits-0123456789abcdef",
    )  # fmt: skip
    flaky = _LosesTheFirstCommitAnswer(ledger.engine)
    monkeypatch.setattr(ledger, "engine", flaky)
    record = ledger.begin_attempt(
        "r1",
        AttemptStart(config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
                     container_digest="env"),
    )  # fmt: skip
    assert flaky.lost == 1  # the first answer really was lost, and the call was retried
    assert [a.attempt_no for a in ledger.attempts("r1")] == [1] == [record.attempt_no]
    assert ledger.get_run("r1").fencing_token == 1  # bumped once, not twice


def test_last_step_is_the_step_reached_and_never_goes_down(tmp_path: Path) -> None:
    ledger = _one_open_attempt(f"sqlite:///{tmp_path / 'l.db'}")
    ledger.heartbeat("r1", 1, step=140)
    ledger.heartbeat("r1", 1, step=120)  # a late, older heartbeat
    ended = ledger.end_attempt(
        "r1", 1, termination_reason=TerminationReason.PREEMPTED, termination_detail="SIGKILL",
        last_step=100,  # the last commit
    )  # fmt: skip
    assert ended.last_step == 140


def _one_open_attempt(ledger_url: str) -> Ledger:
    ledger = Ledger.open(ledger_url)
    ledger.create_run(
        run_id="r1", model_family="digits-cnn", owner="t", purpose="baseline",
        config_sha256="c" * 64, snapshot_id="digits-0123456789abcdef",
    )  # fmt: skip
    ledger.begin_attempt(
        "r1",
        AttemptStart(config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
                     container_digest="env"),
    )  # fmt: skip
    return ledger


def test_an_end_whose_commit_answer_was_lost_is_its_own_and_not_a_second_closer(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried end finds the attempt ended by its own first try: that is success, not
    another process's ending."""
    ledger = _one_open_attempt(ledger_url)
    flaky = _LosesTheFirstCommitAnswer(ledger.engine)
    monkeypatch.setattr(ledger, "engine", flaky)
    ended = ledger.end_attempt(
        "r1", 1, termination_reason=TerminationReason.PREEMPTED, termination_detail="SIGTERM",
        retry_decision={"action": "resume", "rule": "preempted_resume"},
    )  # fmt: skip
    assert flaky.lost == 1
    assert ended.termination_reason == "preempted"
    assert ended.retry_decision == {"action": "resume", "rule": "preempted_resume"}


def test_an_attempt_another_process_ended_keeps_that_ending(ledger_url: str) -> None:
    """The resume sensor closed a silent attempt; its launcher's late ending is refused, and
    the first ending and decision stand whole."""
    from pipeline.ledger import AttemptAlreadyEndedError

    ledger = _one_open_attempt(ledger_url)
    first = ledger.end_attempt(
        "r1", 1, termination_reason=TerminationReason.PREEMPTED,
        termination_detail="heartbeat lost", retry_decision={"action": "resume"},
    )  # fmt: skip
    with pytest.raises(AttemptAlreadyEndedError, match=r"r1#1 was already ended \(preempted"):
        Ledger(ledger_url).end_attempt(
            "r1", 1, termination_reason=TerminationReason.USER_CODE_ERROR,
            termination_detail="exit code 1", exit_code=1,
        )  # fmt: skip
    assert ledger.get_attempt("r1", 1) == first
