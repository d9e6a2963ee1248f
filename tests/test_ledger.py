"""The ledger on SQLite and PostgreSQL: migrations, fencing, receipts, reconnects."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from pipeline.ledger import AttemptStart, Ledger, StaleFencingTokenError, UnknownAttemptError
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
