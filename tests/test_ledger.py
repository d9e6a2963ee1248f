"""The ledger on SQLite and PostgreSQL: migrations, fencing, receipts, reconnects."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from pipeline.ledger import (
    AttemptStart,
    Ledger,
    SnapshotManifestChangedError,
    StaleFencingTokenError,
    UnknownAttemptError,
)
from pipeline.ledger.schema import metadata
from pipeline.states import CheckpointState, RunStatus, TerminationReason


def _start(**overrides: object) -> AttemptStart:
    values = {
        "config_snapshot": {"lr": 0.1, "model": {"channels": 8}},
        "config_sha256": "c" * 64,
        "data_manifest_sha256": "d" * 64,
        "container_digest": "env:sha256:test",
        "placement": {"host": "test", "accelerator_count": 0},
    }
    values.update(overrides)
    return AttemptStart(**values)  # type: ignore[arg-type]


def _run(ledger: Ledger, run_id: str = "run-1") -> None:
    ledger.create_run(
        run_id=run_id,
        model_family="digits-cnn",
        owner="test",
        purpose="baseline",
        config_sha256="c" * 64,
        snapshot_id="digits-0123456789abcdef",
    )


def test_migrations_produce_exactly_the_declared_schema(ledger_url: str) -> None:
    ledger = Ledger.open(ledger_url)
    with ledger.engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={"include_name": lambda name, kind, _p: name != "tracks_ledger_version"},
        )
        diff = compare_metadata(context, metadata)
    # SQLite reports JSON/JSONB variant differences as type changes it cannot make: ignore types.
    structural = [d for d in diff if not (isinstance(d, list) and d and d[0][0] == "modify_type")]
    assert structural == []


def test_each_attempt_gets_the_next_number_and_a_fresh_fencing_token(ledger_url: str) -> None:
    ledger = Ledger.open(ledger_url)
    _run(ledger)
    first = ledger.begin_attempt("run-1", _start())
    second = ledger.begin_attempt("run-1", _start(resumed_from_checkpoint="/ckpt/step-10"))
    assert (first.attempt_no, second.attempt_no) == (1, 2)
    assert second.fencing_token > first.fencing_token
    assert second.resumed_from_checkpoint == "/ckpt/step-10"
    assert second.model_family == "digits-cnn"


def test_stale_attempt_cannot_commit_a_checkpoint(ledger_url: str) -> None:
    ledger = Ledger.open(ledger_url)
    _run(ledger)
    zombie = ledger.begin_attempt("run-1", _start())
    current = ledger.begin_attempt("run-1", _start())
    with pytest.raises(StaleFencingTokenError, match=r"run-1#1 holds fencing token 1"):
        ledger.checkpoint_writing(
            run_id="run-1", attempt_no=1, step=10, path="/c/a01", fencing_token=zombie.fencing_token
        )
    ledger.checkpoint_writing(
        run_id="run-1", attempt_no=2, step=10, path="/c/a02", fencing_token=current.fencing_token
    )
    with pytest.raises(StaleFencingTokenError):
        ledger.commit_checkpoint(
            run_id="run-1", attempt_no=1, path="/c/a02", manifest_sha256="m" * 64,
            size_bytes=1, metrics=None, fencing_token=zombie.fencing_token,
        )  # fmt: skip
    committed = ledger.commit_checkpoint(
        run_id="run-1", attempt_no=2, path="/c/a02", manifest_sha256="m" * 64,
        size_bytes=123, metrics={"loss": 0.5}, fencing_token=current.fencing_token,
    )  # fmt: skip
    assert committed.state == CheckpointState.COMMITTED
    assert [c.path for c in ledger.checkpoints("run-1")] == ["/c/a02"]


def test_ended_attempt_keeps_its_reason_and_failed_attempts_stay(ledger_url: str) -> None:
    ledger = Ledger.open(ledger_url)
    _run(ledger)
    ledger.begin_attempt("run-1", _start())
    ledger.end_attempt(
        "run-1", 1, termination_reason=TerminationReason.PREEMPTED,
        termination_detail="SIGTERM from the scheduler", exit_code=75, cpu_seconds=3.5,
    )  # fmt: skip
    ledger.begin_attempt("run-1", _start())
    ledger.end_attempt(
        "run-1", 2, termination_reason=TerminationReason.SUCCEEDED, termination_detail="done"
    )
    ledger.set_run_status("run-1", RunStatus.TRAINED)
    attempts = ledger.attempts("run-1")
    assert [(a.status, a.termination_reason) for a in attempts] == [
        ("failed", "preempted"),
        ("succeeded", "succeeded"),
    ]
    assert attempts[0].ended_at is not None and attempts[0].ended_at.tzinfo is not None
    with pytest.raises(UnknownAttemptError, match="run-1#9"):
        ledger.end_attempt(
            "run-1", 9, termination_reason=TerminationReason.CANCELLED, termination_detail="x"
        )


def test_seed_question_runs_as_written_on_postgresql(pg_database: str) -> None:
    ledger = Ledger.open(pg_database)
    _run(ledger)
    ledger.begin_attempt("run-1", _start())
    seed = """
        select termination_reason, count(*) as attempts, sum(gpu_seconds) / 3600 as gpu_hours
        from training_attempts
        where model_family = 'reasoning' and started_at >= now() - interval '7 days'
        group by termination_reason order by gpu_hours desc;
    """
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.text(seed)).all() == []


def test_ledger_survives_its_postgresql_connections_being_killed(pg_database: str) -> None:
    ledger = Ledger.open(pg_database)
    _run(ledger)
    database = sa.engine.make_url(pg_database).database
    admin = sa.create_engine(
        sa.engine.make_url(pg_database).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        killed = conn.execute(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = :db AND pid <> pg_backend_pid()"
            ),
            {"db": database},
        ).scalar()
    admin.dispose()
    assert killed >= 1
    attempt = ledger.begin_attempt("run-1", _start())
    assert attempt.attempt_no == 1


def _race_on_insert(ledger: Ledger, table: str, before_insert: Callable[[], None]) -> None:
    """Run ``before_insert`` once, from outside, just before ``ledger`` inserts into ``table``:
    another process's write landing between this one's read and its insert."""
    fired = []

    @sa.event.listens_for(ledger.engine, "before_cursor_execute")
    def _interleave(*args: object) -> None:
        statement = str(args[2])
        if not fired and statement.startswith(f"INSERT INTO {table} "):
            fired.append(statement)
            before_insert()


SNAPSHOT = {"snapshot_id": "digits-0123456789abcdef", "content_sha256": "e" * 64, "rows": 10,
            "source": "landing"}  # fmt: skip


def test_two_processes_registering_one_snapshot_at_once_both_get_its_row(
    ledger_url: str,
) -> None:
    """Two trainers starting on one new snapshot: the other's row lands between this one's read
    and its insert; the insert's unique violation is read as what it is, not an error."""
    ours, theirs = Ledger.open(ledger_url), Ledger(ledger_url)
    _race_on_insert(
        ours, "snapshots", lambda: theirs.register_snapshot(manifest_sha256="m" * 64, **SNAPSHOT)
    )
    record = ours.register_snapshot(manifest_sha256="m" * 64, **SNAPSHOT)
    assert record.manifest_sha256 == "m" * 64
    assert [s.snapshot_id for s in ours.snapshots()] == [SNAPSHOT["snapshot_id"]]


def test_a_racing_registration_of_another_manifest_is_still_refused(ledger_url: str) -> None:
    ours, theirs = Ledger.open(ledger_url), Ledger(ledger_url)
    _race_on_insert(
        ours, "snapshots", lambda: theirs.register_snapshot(manifest_sha256="n" * 64, **SNAPSHOT)
    )
    with pytest.raises(SnapshotManifestChangedError, match=r"n{64}"):
        ours.register_snapshot(manifest_sha256="m" * 64, **SNAPSHOT)


def _land_during(
    ledger: Ledger, statement_prefix: str, write: Callable[[], object]
) -> list[threading.Thread]:
    """Start ``write`` (another process's, through its own ledger) once, just before ``ledger``
    runs a statement starting with ``statement_prefix``, and give it a second to land first:
    another process's write between this one's read and its write. On SQLite it lands; on
    PostgreSQL, where this transaction's read locked the row, it waits for this one's commit.
    The returned list holds its thread once started."""
    other: list[threading.Thread] = []

    @sa.event.listens_for(ledger.engine, "before_cursor_execute")
    def _interleave(*args: object) -> None:
        if not other and str(args[2]).startswith(statement_prefix):
            other.append(threading.Thread(target=write))
            other[0].start()
            other[0].join(timeout=1.0)

    return other


def test_two_processes_merging_one_attempts_placement_at_once_keep_both_fields(
    ledger_url: str,
) -> None:
    """A read-modify-write of the placement: the other process's merge comes between this
    one's read and its write. Neither field may be lost: on SQLite this one's transaction fails
    at its write (its snapshot is stale) and runs again; on PostgreSQL its read locked the row,
    so the other merge waits for this one's commit and reads it."""
    ours, theirs = Ledger.open(ledger_url), Ledger(ledger_url)
    _run(ours)
    ours.begin_attempt("run-1", _start())
    other = _land_during(
        ours,
        "UPDATE training_attempts SET placement",
        lambda: theirs.merge_placement("run-1", 1, {"resharded_from": 2}),
    )
    ours.merge_placement("run-1", 1, {"world_size": 4})
    other[0].join(timeout=60)
    assert not other[0].is_alive()
    placement = ours.get_attempt("run-1", 1).placement
    assert placement["world_size"] == 4 and placement["resharded_from"] == 2, placement
    assert placement["host"] == "test"


def test_two_decisions_on_one_attempt_at_once_keep_each_other(ledger_url: str) -> None:
    """A decision written while another decider read the attempt is kept under ``previous``:
    neither decider's record is lost."""
    ours, theirs = Ledger.open(ledger_url), Ledger(ledger_url)
    _run(ours)
    ours.begin_attempt("run-1", _start())
    ours.end_attempt(
        "run-1", 1, termination_reason=TerminationReason.PREEMPTED, termination_detail="SIGTERM",
        retry_decision={"rule": "first"},
    )  # fmt: skip
    other = _land_during(
        ours,
        "UPDATE training_attempts SET retry_decision",
        lambda: theirs.record_retry_decision("run-1", 1, {"rule": "theirs"}),
    )
    ours.record_retry_decision("run-1", 1, {"rule": "ours"})
    other[0].join(timeout=60)
    chain, rules = ours.get_attempt("run-1", 1).retry_decision, []
    while chain:
        rules.append(chain["rule"])
        chain = chain.get("previous")
    assert sorted(rules) == ["first", "ours", "theirs"] and rules[-1] == "first", rules


def test_checks_recorded_by_two_processes_at_once_keep_the_newest_and_both_in_history(
    pg_database: str,
) -> None:
    """On PostgreSQL, deleting a check's row that is not there locks nothing, so another
    process's insert of it can land before ours. (On SQLite the delete takes the database's
    write lock: the other process waits for our commit, and no such race exists.)"""
    from datetime import UTC, datetime

    from pipeline.ledger.records import SnapshotCheckRecord

    ours, theirs = Ledger.open(pg_database), Ledger(pg_database)
    ours.register_snapshot(manifest_sha256="m" * 64, **SNAPSHOT)

    def check(passed: bool) -> SnapshotCheckRecord:
        return SnapshotCheckRecord(
            snapshot_id=SNAPSHOT["snapshot_id"], manifest_sha256="m" * 64, check_name="schema",
            blocking=True, passed=passed, checked_at=datetime.now(UTC),
        )  # fmt: skip

    _race_on_insert(
        ours,
        "snapshot_checks",
        lambda: theirs.record_snapshot_checks(SNAPSHOT["snapshot_id"], "m" * 64, [check(False)]),
    )
    record = ours.record_snapshot_checks(SNAPSHOT["snapshot_id"], "m" * 64, [check(True)])
    assert record.verdict == "passed"
    [newest] = ours.snapshot_checks(SNAPSHOT["snapshot_id"], "m" * 64)
    assert newest.passed
    history = ours.snapshot_check_history(SNAPSHOT["snapshot_id"])
    assert sorted(c.passed for c in history) == [False, True]
