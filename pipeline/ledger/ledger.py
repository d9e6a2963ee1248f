"""The ledger: SQLAlchemy Core over SQLite (default) or PostgreSQL (production).

Writes are short transactions. Disconnects (a restarted PostgreSQL) and SQLite lock contention
are retried here, because Dagster's own storage does not reconnect and a trainer must not die
because the database blinked.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError

from pipeline import envvars, ids, redact
from pipeline.ledger import schema
from pipeline.ledger.errors import (
    AttemptAlreadyEndedError,
    SnapshotManifestChangedError,
    StaleFencingTokenError,
    UnknownAttemptError,
    UnknownEvaluationError,
    UnknownRunError,
    UnknownSnapshotError,
)
from pipeline.ledger.notes import (
    MAX_AUTHOR_CHARS,
    MAX_SOURCE_CHARS,
    note_text,
    one_line_name,
)
from pipeline.ledger.records import (
    AttemptRecord,
    AttemptStart,
    CheckpointRecord,
    CostRow,
    EvaluationRecord,
    NoteRecord,
    PromotionRecord,
    RunRecord,
    SnapshotCheckRecord,
    SnapshotRecord,
    as_utc,
)
from pipeline.states import (
    AttemptStatus,
    CheckpointState,
    PromotionDecision,
    Purpose,
    RunStatus,
    TerminationReason,
    attempt_status,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R", RunRecord, AttemptRecord, CheckpointRecord, EvaluationRecord, PromotionRecord)

# How long a transaction keeps being retried across a database restart or failover before the
# error is raised (TRACKS_LEDGER_RETRY_SECONDS, default 60 s): long enough for a PostgreSQL
# restart with dirty buffers to flush.
# SQLSTATEs worth a retry: connection exceptions (08xxx), admin/crash shutdown and "cannot
# connect now" while starting (57P01-57P03), serialization failure and deadlock, too many
# connections.
_RETRYABLE_SQLSTATES = ("57P01", "57P02", "57P03", "40001", "40P01", "53300")
_RETRYABLE_TEXT = (
    "database is locked",
    "server closed",
    "terminating connection",
    "could not connect",
    "connection refused",
    "connection reset",
    "the database system is shutting down",
    "the database system is starting up",
    "the database system is in recovery mode",
    "connection already closed",
    "ssl connection has been closed",
    "no connection to the server",
)
_MIGRATIONS = Path(__file__).with_name("migrations")
_REVISION_LINE = re.compile(r"^(down_revision|revision)\s*=\s*['\"]([^'\"]+)['\"]", re.M)


@functools.cache
def head_revision() -> str | None:
    """The newest migration, read from the files without importing Alembic (it is slow to load).

    tests/test_cost.py checks this agrees with Alembic's own idea of the head.
    """
    revisions, parents = set(), set()
    for path in (_MIGRATIONS / "versions").glob("*.py"):
        found = dict(_REVISION_LINE.findall(path.read_text()))
        if "revision" in found:
            revisions.add(found["revision"])
        if "down_revision" in found:
            parents.add(found["down_revision"])
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def utcnow() -> datetime:
    return datetime.now(UTC)


def normalise_url(url: str) -> str:
    """``postgresql://`` with the driver that is installed (psycopg2 here; SQLAlchemy 2.1
    defaults to psycopg 3)."""
    if url.startswith(("postgresql://", "postgres://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None:
            return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def _make_engine(url: str) -> Engine:
    url = normalise_url(url)
    if url.startswith("sqlite"):
        database = sa.engine.make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # pysqlite's own transaction handling emits BEGIN only before an INSERT, UPDATE or
            # DELETE: every SELECT ran outside the transaction that followed it, so a read and
            # the write it decided could straddle another process's commit (two trainers both
            # found a new snapshot unregistered, 2026-11-28). Off, so that SQLAlchemy's
            # transactions are SQLite's (the ``begin`` listener below), as SQLAlchemy's SQLite
            # dialect documents for serializable isolation.
            dbapi_conn.isolation_level = None
            cursor = dbapi_conn.cursor()
            # WAL lets the trainer write heartbeats while the webserver reads.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @sa.event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            # Deferred: a transaction that reads, then writes after another process committed,
            # fails "database is locked" at its write (WAL's stale snapshot) and is run again
            # whole by Ledger._retry, reading what the other one wrote. Writers wait for each
            # other under busy_timeout; readers never wait.
            conn.exec_driver_sql("BEGIN")

        return engine
    return sa.create_engine(url, pool_pre_ping=True, pool_recycle=1800)


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is transient: the same transaction may succeed once the server is back."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    code = getattr(exc.orig, "pgcode", None)
    if isinstance(code, str) and (code.startswith("08") or code in _RETRYABLE_SQLSTATES):
        return True
    if isinstance(exc, IntegrityError):
        return False
    text = str(exc.orig).lower()
    return any(marker in text for marker in _RETRYABLE_TEXT)


def _retry_budget() -> float:
    # Read per transaction, not at import: a SettingError names a bad value.
    return envvars.TRACKS_LEDGER_RETRY_SECONDS.get()


def _raised(column: sa.Column[Any], value: int) -> Any:
    """``column`` raised to ``value``, never lowered (the step an attempt reached only grows)."""
    return sa.case((column.is_(None), value), (column < value, value), else_=column)


def _step_of_checkpoint(path: str | None) -> int | None:
    from pipeline.checkpoint.layout import parse_checkpoint_dir_name

    if path is None:
        return 0
    parsed = parse_checkpoint_dir_name(Path(path).name)
    return parsed[0] if parsed else None


class Ledger:
    """Receipts for runs, attempts, checkpoints, evaluations and promotions."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = _make_engine(url)

    @classmethod
    def open(cls, url: str) -> Ledger:
        """Connect and bring the schema to the newest migration.

        A URL that cannot be used (unparseable, a port outside 1-65535) is refused first with
        :class:`~pipeline.settings.DatabaseUrlError`, its password masked.
        """
        from pipeline.settings import check_database_url

        check_database_url(url)
        ledger = cls(url)
        head = head_revision()
        # Under the same retry budget as every transaction: a trainer that starts while the
        # server restarts must wait for it, not die before its first step.
        if head is None or ledger._retry(ledger.schema_revision) != head:
            ledger._retry(ledger.upgrade)
        return ledger

    def schema_revision(self) -> str | None:
        """The ledger's migration revision, or None for an empty database.

        Read with one query, so a ledger already at head opens without importing Alembic
        (it costs a CLI call more than the query itself).
        """
        try:
            with self.engine.connect() as conn:
                return conn.execute(
                    sa.text("SELECT version_num FROM tracks_ledger_version")
                ).scalar()
        except DBAPIError as exc:
            if is_retryable(exc):
                raise  # the server is away, not the table: the caller retries
            return None

    def upgrade(self, revision: str = "head") -> None:
        """Migrate to ``revision``, one process at a time.

        Processes that start together on a new ledger (a Dagster run worker, the daemon's
        sensor and a trainer on a fresh home) would each find it empty and each create its
        tables: the second fails with "table ... already exists" (seen 2026-11-27). So the
        migration holds a lock, a transaction-scoped advisory lock on PostgreSQL and an
        exclusive ``flock`` on ``<file>.lock`` beside a SQLite file, and Alembic reads the
        revision inside it: whoever comes second finds the head and does nothing.
        """
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(_MIGRATIONS))
        with _file_lock(self.engine), self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                lock = sa.text("SELECT pg_advisory_xact_lock(:key)")
                conn.execute(lock, {"key": _MIGRATION_LOCK})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)

    def dispose(self) -> None:
        self.engine.dispose()

    # -- plumbing ---------------------------------------------------------------------------

    def _tx(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one transaction, retrying the whole transaction while it is transient.

        Retried for up to ``TRACKS_LEDGER_RETRY_SECONDS`` (60 s): a server restart, a failover,
        a deadlock. A transaction whose COMMIT was sent but whose answer was lost may have
        happened: every write is idempotent (keyed by identity, or by a uid made once per
        call), so running it again finds what the first run did instead of doing it twice.
        """

        def _once() -> T:
            with self.engine.begin() as conn:
                return fn(conn)

        return self._retry(_once)

    def _tx_after_a_lost_race(self, fn: Callable[[Connection], T]) -> T:
        """:meth:`_tx`, run once more where its insert lost a race on a unique key: another
        process wrote the same row between ``fn``'s read and its insert, and ``fn``, run again,
        reads that row (PostgreSQL's READ COMMITTED lets a transaction read before another's
        insert commits and insert after it; deleting an absent row locks nothing either)."""
        try:
            return self._tx(fn)
        except IntegrityError:
            return self._tx(fn)

    def _retry(self, fn: Callable[[], T]) -> T:
        """``fn()``, run again while it fails with a transient database error, within budget."""
        deadline = time.monotonic() + _retry_budget()
        delay = 0.1
        self.retries = getattr(self, "retries", 0)
        while True:
            try:
                return fn()
            except DBAPIError as exc:
                if not is_retryable(exc) or time.monotonic() + delay > deadline:
                    raise
                self.retries += 1
                log.warning("ledger transaction failed (%s); retrying in %.1fs", _first(exc), delay)
                if not self.url.startswith("sqlite"):
                    # A restart invalidates every pooled connection at once: drop them all.
                    self.engine.dispose()
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _records(self, query: sa.Select[Any], record: type[R]) -> list[R]:
        """Every row ``query`` returns, as ``record``s."""
        rows = self._tx(lambda conn: conn.execute(query).all())
        return [record.from_row(r) for r in rows]

    # -- runs -------------------------------------------------------------------------------

    def create_run(
        self,
        *,
        run_id: str,
        model_family: str,
        owner: str,
        purpose: Purpose | str,
        config_sha256: str,
        snapshot_id: str,
        code_commit: str | None = None,
        retry_policy: dict[str, Any] | None = None,
    ) -> RunRecord:
        values = {
            # The ledger is an entry point too: an id it accepts becomes a folder elsewhere.
            "run_id": ids.run_id(run_id),
            "model_family": ids.model_family(model_family),
            "owner": owner,
            "purpose": str(Purpose(purpose)),
            "config_sha256": config_sha256,
            "snapshot_id": snapshot_id,
            "code_commit": code_commit,
            "created_at": utcnow(),
            "status": str(RunStatus.RUNNING),
            "fencing_token": 0,
            "retry_policy": retry_policy,
        }
        self._tx(lambda conn: conn.execute(sa.insert(schema.training_runs).values(**values)))
        return self.get_run(run_id)

    def get_run(self, run_id: str) -> RunRecord:
        row = self._tx(
            lambda conn: conn.execute(
                sa.select(schema.training_runs).where(schema.training_runs.c.run_id == run_id)
            ).first()
        )
        if row is None:
            raise UnknownRunError(run_id)
        return RunRecord.from_row(row)

    def find_runs(
        self,
        *,
        snapshot_id: str | None = None,
        model_family: str | None = None,
        status: RunStatus | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        """Runs, newest first, filtered by snapshot, family and status."""
        t = schema.training_runs
        query = sa.select(t).order_by(t.c.created_at.desc(), t.c.run_id.desc()).limit(limit)
        if snapshot_id is not None:
            query = query.where(t.c.snapshot_id == snapshot_id)
        if model_family is not None:
            query = query.where(t.c.model_family == model_family)
        if status is not None:
            query = query.where(t.c.status == str(status))
        return self._records(query, RunRecord)

    def set_run_status(self, run_id: str, status: RunStatus) -> None:
        t = schema.training_runs
        self._tx(
            lambda conn: conn.execute(
                sa.update(t).where(t.c.run_id == run_id).values(status=str(status))
            )
        )

    # -- attempts ---------------------------------------------------------------------------

    def begin_attempt(self, run_id: str, start: AttemptStart) -> AttemptRecord:
        """Open the next attempt of ``run_id`` and hand it a fresh fencing token.

        Bumping the run's token here is what makes every older attempt stale: their
        checkpoint commits are refused from now on.

        ``start.resumed_from_checkpoint`` must be a restore that happened (a self-owned trainer
        begins after restoring). Without one, restored_step stays empty, not 0: an orchestrator
        begins before the trainer restored anything, and the trainer reports it
        (:meth:`set_resumed_from`, which records 0 for a fresh start).
        """
        ids.run_id(run_id)
        runs, attempts = schema.training_runs, schema.training_attempts
        # Made once per call: a retried transaction whose first COMMIT did land finds its row.
        uid = str(uuid.uuid4())

        def _begin(conn: Connection) -> int:
            done = conn.execute(
                sa.select(attempts.c.attempt_no).where(attempts.c.attempt_uid == uid)
            ).scalar()
            if done is not None:
                return int(done)
            bumped = conn.execute(
                sa.update(runs)
                .where(runs.c.run_id == run_id)
                .values(fencing_token=runs.c.fencing_token + 1, status=str(RunStatus.RUNNING))
                .returning(runs.c.fencing_token, runs.c.model_family)
            ).first()
            if bumped is None:
                raise UnknownRunError(run_id)
            token, family = bumped
            last = conn.execute(
                sa.select(sa.func.max(attempts.c.attempt_no)).where(attempts.c.run_id == run_id)
            ).scalar()
            attempt_no = (last or 0) + 1
            now = utcnow()
            conn.execute(
                sa.insert(attempts).values(
                    run_id=run_id,
                    attempt_no=attempt_no,
                    model_family=family,
                    dagster_run_id=start.dagster_run_id,
                    started_at=now,
                    heartbeat_at=now,
                    status=str(AttemptStatus.RUNNING),
                    config_snapshot=start.config_snapshot,
                    config_sha256=start.config_sha256,
                    data_manifest_sha256=start.data_manifest_sha256,
                    container_digest=start.container_digest,
                    placement=start.placement,
                    code_commit=start.code_commit,
                    resumed_from_checkpoint=start.resumed_from_checkpoint,
                    restored_step=(
                        _step_of_checkpoint(start.resumed_from_checkpoint)
                        if start.resumed_from_checkpoint
                        else None
                    ),
                    fencing_token=token,
                    attempt_uid=uid,
                    launched_by=start.launched_by,
                    admission=start.admission,
                )
            )
            return attempt_no

        attempt_no = self._tx(_begin)
        return self.get_attempt(run_id, attempt_no)

    def get_attempt(self, run_id: str, attempt_no: int) -> AttemptRecord:
        t = schema.training_attempts
        row = self._tx(
            lambda conn: conn.execute(
                sa.select(t).where(t.c.run_id == run_id, t.c.attempt_no == attempt_no)
            ).first()
        )
        if row is None:
            raise UnknownAttemptError(run_id, attempt_no)
        return AttemptRecord.from_row(row)

    def attempts(self, run_id: str) -> list[AttemptRecord]:
        t = schema.training_attempts
        return self._records(
            sa.select(t).where(t.c.run_id == run_id).order_by(t.c.attempt_no),
            AttemptRecord,
        )

    def attempts_for_dagster_run(self, dagster_run_id: str) -> list[AttemptRecord]:
        """Attempts one Dagster run started, oldest first."""
        t = schema.training_attempts
        return self._records(
            sa.select(t).where(t.c.dagster_run_id == dagster_run_id).order_by(t.c.started_at),
            AttemptRecord,
        )

    def latest_attempt(self, run_id: str) -> AttemptRecord | None:
        found = self.attempts(run_id)
        return found[-1] if found else None

    def list_attempts(
        self,
        *,
        model_family: str | None = None,
        termination_reason: TerminationReason | str | None = None,
        status: AttemptStatus | str | None = None,
        since: datetime | None = None,
        limit: int = 50,
        run_id: str | None = None,
    ) -> list[AttemptRecord]:
        """Attempts, newest first, with optional filters."""
        t = schema.training_attempts
        query = (
            sa.select(t)
            .order_by(t.c.started_at.desc(), t.c.run_id.desc(), t.c.attempt_no.desc())
            .limit(limit)
        )
        if model_family is not None:
            query = query.where(t.c.model_family == model_family)
        if termination_reason is not None:
            query = query.where(t.c.termination_reason == str(termination_reason))
        if status is not None:
            query = query.where(t.c.status == str(status))
        if since is not None:
            query = query.where(t.c.started_at >= since)
        if run_id is not None:
            query = query.where(t.c.run_id == run_id)
        return self._records(query, AttemptRecord)

    def cost_by_reason(
        self, model_family: str, days: float, *, now: datetime | None = None
    ) -> list[CostRow]:
        """The seed question: attempts and GPU-hours per termination reason, most GPU-hours first.

        Same answer as the seed SQL in docs/receipts.md, on SQLite and PostgreSQL; the window
        starts ``days`` before ``now`` (computed here, so both databases compare against the same
        instant).
        """
        query = cost_by_reason_query(model_family, (now or utcnow()) - timedelta(days=days))
        rows = self._tx(lambda conn: conn.execute(query).all())
        return [
            CostRow(
                termination_reason=r[0],
                attempts=int(r[1]),
                gpu_hours=float(r[2] or 0.0),
                cpu_hours=float(r[3] or 0.0),
            )
            for r in rows
        ]

    def cost_by_reason_lost_steps(
        self, model_family: str, days: float, *, now: datetime | None = None
    ) -> dict[str | None, int]:
        """Steps trained and lost, per termination reason, in :meth:`cost_by_reason`'s window.

        An attempt's lost steps are those it reached past its own last commit (past the step it
        restored, when it committed nothing): a fenced or killed attempt's work nobody resumes.
        Reasons that lost nothing are left out.
        """
        t, c = schema.training_attempts, schema.checkpoints
        own_commit = sa.func.max(c.c.step).label("own_commit")
        query = (
            sa.select(t.c.termination_reason, t.c.last_step, t.c.restored_step, own_commit)
            .select_from(
                t.outerjoin(
                    c,
                    sa.and_(
                        c.c.run_id == t.c.run_id,
                        c.c.attempt_no == t.c.attempt_no,
                        c.c.committed_at.is_not(None),
                    ),
                )
            )
            .where(
                t.c.model_family == model_family,
                t.c.started_at >= (now or utcnow()) - timedelta(days=days),
                t.c.last_step.is_not(None),
                t.c.ended_at.is_not(None),  # a running attempt has lost nothing yet
            )
            .group_by(t.c.run_id, t.c.attempt_no, t.c.termination_reason)
            .group_by(t.c.last_step, t.c.restored_step)
        )
        lost: dict[str | None, int] = {}
        rows = self._tx(lambda conn: conn.execute(query).all())
        for reason, reached, restored, committed in rows:
            base = committed if committed is not None else (restored or 0)
            if reached > base:
                lost[reason] = lost.get(reason, 0) + reached - base
        return lost

    def silent_attempts(
        self, heartbeat_timeout_seconds: float, *, now: datetime | None = None
    ) -> list[AttemptRecord]:
        """Attempts still marked running whose heartbeat is older than the timeout.

        Alive-but-silent: the resume sensor classifies these as preempted (heartbeat expired).
        """
        t = schema.training_attempts
        cutoff = (now or utcnow()) - timedelta(seconds=heartbeat_timeout_seconds)
        query = (
            sa.select(t)
            # A literal, not a bound parameter: SQLite uses the partial index only then.
            .where(sa.text("training_attempts.status = 'running'"), t.c.heartbeat_at < cutoff)
            .order_by(t.c.heartbeat_at)
        )
        return self._records(query, AttemptRecord)

    def heartbeat(self, run_id: str, attempt_no: int, *, step: int | None = None) -> None:
        t = schema.training_attempts
        values: dict[str, Any] = {"heartbeat_at": utcnow()}
        if step is not None:
            values["last_step"] = _raised(t.c.last_step, step)
        self._tx(
            lambda conn: conn.execute(
                sa.update(t)
                .where(t.c.run_id == run_id, t.c.attempt_no == attempt_no)
                .values(**values)
            )
        )

    def end_attempt(
        self,
        run_id: str,
        attempt_no: int,
        *,
        termination_reason: TerminationReason,
        termination_detail: str,
        exit_code: int | None = None,
        signal: str | None = None,
        gpu_seconds: float = 0.0,
        cpu_seconds: float = 0.0,
        last_step: int | None = None,
        retry_decision: dict[str, Any] | None = None,
    ) -> AttemptRecord:
        """Close an attempt with exactly one termination reason and one honest sentence.

        Only an open attempt is closed: one that another process ended first (the resume
        sensor closing a silent attempt while the Dagster run that launched it sees its trainer
        exit) raises :class:`AttemptAlreadyEndedError`, and the first ending stands. With
        ``retry_decision``, the decision lands in the same write, so no reader sees the
        attempt ended without it.
        """
        t = schema.training_attempts
        ended_at = utcnow()  # once per call: a retried write whose COMMIT landed knows its own
        values: dict[str, Any] = {
            "ended_at": ended_at,
            "status": str(attempt_status(termination_reason)),
            "termination_reason": str(termination_reason),
            # The sentence may quote an error that quotes a URL: stored without its password.
            "termination_detail": redact.text(termination_detail),
            "exit_code": exit_code,
            "signal": signal,
            "gpu_seconds": gpu_seconds,
            "cpu_seconds": cpu_seconds,
            "retry_decision": retry_decision,
        }
        if last_step is not None:
            # The step reached: a commit at a lower step never hides the steps trained past it.
            values["last_step"] = _raised(t.c.last_step, last_step)
        this = (t.c.run_id == run_id, t.c.attempt_no == attempt_no)

        def _end(conn: Connection) -> None:
            closed = conn.execute(
                sa.update(t).where(*this, t.c.ended_at.is_(None)).values(**values)
            ).rowcount
            if closed == 1:
                return
            row = conn.execute(sa.select(t.c.ended_at, t.c.termination_reason).where(*this)).first()
            if row is None:
                raise UnknownAttemptError(run_id, attempt_no)
            # Equal: this call's own write, retried after its COMMIT's answer was lost.
            if as_utc(row.ended_at) != ended_at:
                raise AttemptAlreadyEndedError(
                    run_id, attempt_no, row.termination_reason, row.ended_at
                )

        self._tx(_end)
        return self.get_attempt(run_id, attempt_no)

    def set_resumed_from(self, run_id: str, attempt_no: int, path: str | None) -> None:
        """Where the attempt's trainer actually resumed from (None: it started fresh)."""
        t = schema.training_attempts
        self._tx(
            lambda conn: conn.execute(
                sa.update(t)
                .where(t.c.run_id == run_id, t.c.attempt_no == attempt_no)
                .values(resumed_from_checkpoint=path, restored_step=_step_of_checkpoint(path))
            )
        )

    def merge_placement(self, run_id: str, attempt_no: int, fields: dict[str, Any]) -> None:
        """Add what only the trainer knows to the attempt's placement (world size, resharding)."""
        t = schema.training_attempts

        def _merge(conn: Any) -> None:
            # Read and rewritten in one transaction, the row locked on PostgreSQL (FOR UPDATE;
            # SQLite's transaction is serializable): a merge by another process in between
            # would otherwise be overwritten with what this one read before it.
            current = conn.execute(
                sa.select(t.c.placement)
                .where(t.c.run_id == run_id, t.c.attempt_no == attempt_no)
                .with_for_update()
            ).scalar_one_or_none()
            conn.execute(
                sa.update(t)
                .where(t.c.run_id == run_id, t.c.attempt_no == attempt_no)
                .values(placement={**(current or {}), **fields})
            )

        self._tx(_merge)

    def set_timings(self, run_id: str, attempt_no: int, timings: dict[str, Any]) -> None:
        """What the trainer's clocks measured (process, set-up, training loop), in seconds."""
        t = schema.training_attempts
        self._tx(
            lambda conn: conn.execute(
                sa.update(t)
                .where(t.c.run_id == run_id, t.c.attempt_no == attempt_no)
                .values(timings=timings)
            )
        )

    def set_attempt_health(self, run_id: str, attempt_no: int, health: dict[str, Any]) -> None:
        """The attempt's loss-spike settings and history, whole (the trainer rewrites it at
        every event)."""
        t = schema.training_attempts
        self._tx(
            lambda conn: conn.execute(
                sa.update(t)
                .where(t.c.run_id == run_id, t.c.attempt_no == attempt_no)
                .values(health=health)
            )
        )

    def record_retry_decision(
        self, run_id: str, attempt_no: int, decision: dict[str, Any]
    ) -> dict[str, Any]:
        """Write ``decision`` on an ended attempt, keeping any earlier one under ``previous``;
        returns what was written.

        Read and written in one transaction (the row locked on PostgreSQL): two deciders at
        once each keep the other's decision, neither is lost.
        """
        t = schema.training_attempts
        this = (t.c.run_id == run_id, t.c.attempt_no == attempt_no)

        def _record(conn: Connection) -> dict[str, Any]:
            row = conn.execute(sa.select(t.c.retry_decision).where(*this).with_for_update()).first()
            if row is None:
                raise UnknownAttemptError(run_id, attempt_no)
            written = dict(decision)
            if row.retry_decision:
                written["previous"] = row.retry_decision
            conn.execute(sa.update(t).where(*this).values(retry_decision=written))
            return written

        return self._tx(_record)

    # -- checkpoints ------------------------------------------------------------------------

    def _require_current_token(
        self, conn: Connection, run_id: str, attempt_no: int, token: int
    ) -> None:
        # A no-op UPDATE guarded by the token: it both checks and takes the row's write lock,
        # on SQLite and PostgreSQL alike, so no new attempt can slip in before we commit.
        runs = schema.training_runs
        matched = conn.execute(
            sa.update(runs)
            .where(runs.c.run_id == run_id, runs.c.fencing_token == token)
            .values(fencing_token=runs.c.fencing_token)
        ).rowcount
        if matched != 1:
            current = conn.execute(
                sa.select(runs.c.fencing_token).where(runs.c.run_id == run_id)
            ).scalar()
            if current is None:
                raise UnknownRunError(run_id)
            raise StaleFencingTokenError(run_id, attempt_no, token, current)

    def checkpoint_writing(
        self,
        *,
        run_id: str,
        attempt_no: int,
        step: int,
        path: str,
        fencing_token: int,
        parent_path: str | None = None,
    ) -> None:
        values = {
            "path": path,
            "run_id": run_id,
            "attempt_no": attempt_no,
            "step": step,
            "state": str(CheckpointState.WRITING),
            # A save under the name of a checkpoint a loss spike's rollback superseded starts a
            # record of its own: not the old one's "rolled back past it".
            "state_detail": None,
            "created_at": utcnow(),
            "parent_path": parent_path,
            "fencing_token": fencing_token,
        }
        t = schema.checkpoints

        def _insert(conn: Connection) -> None:
            self._require_current_token(conn, run_id, attempt_no, fencing_token)
            try:
                with conn.begin_nested():
                    conn.execute(sa.insert(t).values(**values))
            except IntegrityError:
                # A retried save of the same directory: start its record over.
                conn.execute(sa.update(t).where(t.c.path == path).values(**values))

        self._tx(_insert)

    def commit_checkpoint(
        self,
        *,
        run_id: str,
        attempt_no: int,
        path: str,
        manifest_sha256: str,
        size_bytes: int,
        metrics: dict[str, Any] | None,
        fencing_token: int,
        step: int | None = None,
        parent_path: str | None = None,
    ) -> CheckpointRecord:
        """Mark a checkpoint committed, refusing a stale attempt's commit."""
        t = schema.checkpoints

        def _commit(conn: Connection) -> None:
            self._require_current_token(conn, run_id, attempt_no, fencing_token)
            values = {
                "manifest_sha256": manifest_sha256,
                "bytes": size_bytes,
                "metrics": metrics,
                "state": str(CheckpointState.COMMITTED),
                "committed_at": utcnow(),
                "fencing_token": fencing_token,
            }
            updated = conn.execute(sa.update(t).where(t.c.path == path).values(**values)).rowcount
            if updated == 0:
                if step is None:
                    raise ValueError(f"checkpoint {path} was never recorded as writing; pass step")
                conn.execute(
                    sa.insert(t).values(
                        path=path,
                        run_id=run_id,
                        attempt_no=attempt_no,
                        step=step,
                        created_at=utcnow(),
                        parent_path=parent_path,
                        **values,
                    )
                )

        self._tx(_commit)
        return self.get_checkpoint(path)

    def set_checkpoint_state(
        self, run_id: str, path: str, state: CheckpointState, detail: str | None = None
    ) -> int:
        """Set the state of run ``run_id``'s checkpoint at ``path``; returns the rows changed.

        Keyed by the run as well as the path: one run can never mark another run's checkpoints,
        whatever path it was handed.
        """
        t = schema.checkpoints
        return self._tx(
            lambda conn: (
                conn.execute(
                    sa.update(t)
                    .where(t.c.path == path, t.c.run_id == run_id)
                    .values(
                        state=str(state), state_detail=redact.text(detail) if detail else detail
                    )
                ).rowcount
            )
        )

    def get_checkpoint(self, path: str) -> CheckpointRecord:
        t = schema.checkpoints
        row = self._tx(lambda conn: conn.execute(sa.select(t).where(t.c.path == path)).first())
        if row is None:
            raise LookupError(f"checkpoint {path} is not in the ledger")
        return CheckpointRecord.from_row(row)

    def checkpoints(
        self, run_id: str, states: Iterable[CheckpointState] | None = None
    ) -> list[CheckpointRecord]:
        """Checkpoints of a run, oldest step first."""
        t = schema.checkpoints
        query = sa.select(t).where(t.c.run_id == run_id).order_by(t.c.step, t.c.attempt_no)
        if states is not None:
            query = query.where(t.c.state.in_([str(s) for s in states]))
        return self._records(query, CheckpointRecord)

    def latest_committed_checkpoint(
        self, run_id: str, *, final: bool = False
    ) -> CheckpointRecord | None:
        """The run's committed checkpoint at the highest step (what a next attempt resumes).

        ``final``: the run's result instead, the newest succeeded attempt's last commit (or,
        when it committed none because it resumed at max_steps, the one it restored); None if
        no attempt succeeded. The highest step is not the result: a failed attempt may have
        committed past the max_steps a relaunch then lowered.
        """
        committed = self.checkpoints(run_id, [CheckpointState.COMMITTED])
        if not final:
            return committed[-1] if committed else None
        succeeded = [
            a
            for a in self.attempts(run_id)
            if a.termination_reason == str(TerminationReason.SUCCEEDED)
        ]
        if not succeeded:
            return None
        newest = succeeded[-1]
        own = [c for c in committed if c.attempt_no == newest.attempt_no]
        if own:
            return own[-1]
        return next((c for c in committed if c.path == newest.resumed_from_checkpoint), None)

    def referenced_checkpoint_paths(self) -> set[str]:
        """Checkpoints an evaluation or promotion points at: retention must keep these."""
        rows = self._tx(
            lambda conn: conn.execute(
                sa.union(
                    sa.select(schema.evaluations.c.checkpoint_path),
                    sa.select(schema.promotions.c.checkpoint_path),
                )
            ).all()
        )
        return {r[0] for r in rows}

    # -- evaluations and promotions --------------------------------------------------------------

    def record_evaluation(self, record: EvaluationRecord) -> EvaluationRecord:
        from dataclasses import replace

        # The detail may quote an evaluator's error, and a path or URI may carry credentials:
        # stored (and handed back) without any password.
        record = replace(
            record,
            detail=redact.text(record.detail) if record.detail else record.detail,
            checkpoint_path=redact.url(record.checkpoint_path),
            raw_outputs_uri=redact.url(record.raw_outputs_uri) if record.raw_outputs_uri else None,
            failures_uri=redact.url(record.failures_uri) if record.failures_uri else None,
        )
        values = _record_values(record, schema.evaluations)
        self._tx(lambda conn: conn.execute(sa.insert(schema.evaluations).values(**values)))
        return record

    def evaluations_for_checkpoint(self, manifest_sha256: str) -> list[EvaluationRecord]:
        t = schema.evaluations
        return self._records(
            sa.select(t)
            .where(t.c.checkpoint_manifest_sha256 == manifest_sha256)
            .order_by(t.c.started_at),
            EvaluationRecord,
        )

    def get_evaluation(self, evaluation_id: str) -> EvaluationRecord:
        t = schema.evaluations
        found = self._records(
            sa.select(t).where(t.c.evaluation_id == evaluation_id), EvaluationRecord
        )
        if not found:
            raise UnknownEvaluationError(evaluation_id)
        return found[0]

    def evaluations_for_run(self, run_id: str) -> list[EvaluationRecord]:
        t = schema.evaluations
        return self._records(
            sa.select(t).where(t.c.run_id == run_id).order_by(t.c.started_at),
            EvaluationRecord,
        )

    # -- snapshots ----------------------------------------------------------------------------

    def register_snapshot(
        self,
        *,
        snapshot_id: str,
        manifest_sha256: str,
        content_sha256: str | None,
        rows: int | None,
        source: str | None,
        dagster_run_id: str | None = None,
    ) -> SnapshotRecord:
        """The snapshot's row, created once (snapshots are immutable); repeating it is a no-op.

        A row for the same id with another manifest digest means the manifest was edited after
        it was registered: refused, naming both digests.
        """
        ids.snapshot_id(snapshot_id)
        t = schema.snapshots

        def _register(conn: Connection) -> None:
            found = conn.execute(
                sa.select(t.c.manifest_sha256).where(t.c.snapshot_id == snapshot_id)
            ).scalar()
            if found is None:
                conn.execute(
                    sa.insert(t).values(
                        snapshot_id=snapshot_id, manifest_sha256=manifest_sha256,
                        content_sha256=content_sha256, rows=rows, source=source,
                        created_at=utcnow(), verdict="unchecked", dagster_run_id=dagster_run_id,
                    )
                )  # fmt: skip
            elif found != manifest_sha256:
                raise SnapshotManifestChangedError(snapshot_id, found, manifest_sha256)

        # Two trainers starting on one new snapshot: the other's row stands, if it names the
        # same manifest.
        self._tx_after_a_lost_race(_register)
        return self.get_snapshot(snapshot_id)

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        t = schema.snapshots
        row = self._tx(
            lambda conn: conn.execute(sa.select(t).where(t.c.snapshot_id == snapshot_id)).first()
        )
        if row is None:
            raise UnknownSnapshotError(snapshot_id)
        return SnapshotRecord.from_row(row)

    def snapshots(
        self, *, verdict: str | None = None, since: datetime | None = None
    ) -> list[SnapshotRecord]:
        t = schema.snapshots
        query = sa.select(t).order_by(t.c.created_at)
        if verdict is not None:
            query = query.where(t.c.verdict == verdict)
        if since is not None:
            query = query.where(t.c.created_at >= since)
        return self._records(query, SnapshotRecord)

    def record_snapshot_checks(
        self,
        snapshot_id: str,
        manifest_sha256: str,
        checks: Sequence[SnapshotCheckRecord],
    ) -> SnapshotRecord:
        """Record check outcomes for one exact manifest and derive the snapshot's verdict.

        A check recorded again replaces its earlier row in ``snapshot_checks`` (the newest
        verdict, which the gate reads); every evaluation is also appended to
        ``snapshot_check_history``, which keeps them all.
        """
        t, s, history = schema.snapshot_checks, schema.snapshots, schema.snapshot_check_history

        def _record(conn: Connection) -> None:
            registered = conn.execute(
                sa.select(s.c.manifest_sha256).where(s.c.snapshot_id == snapshot_id)
            ).scalar()
            if registered is None:
                raise UnknownSnapshotError(snapshot_id)
            if registered != manifest_sha256:
                raise SnapshotManifestChangedError(snapshot_id, registered, manifest_sha256)
            for check in checks:
                conn.execute(
                    sa.delete(t).where(
                        t.c.snapshot_id == snapshot_id,
                        t.c.manifest_sha256 == manifest_sha256,
                        t.c.check_name == check.check_name,
                    )
                )
                conn.execute(sa.insert(t).values(**_record_values(check, t)))
                conn.execute(sa.insert(history).values(**_record_values(check, history)))
            rows = conn.execute(
                sa.select(t.c.blocking, t.c.passed).where(
                    t.c.snapshot_id == snapshot_id, t.c.manifest_sha256 == manifest_sha256
                )
            ).all()
            blocked = any(blocking and not passed for blocking, passed in rows)
            conn.execute(
                sa.update(s)
                .where(s.c.snapshot_id == snapshot_id)
                .values(verdict="blocked" if blocked else "passed", verdict_at=utcnow())
            )

        # Done again after another process's insert: the newest verdict (ours) replaces its
        # rows, and both stay in the history.
        self._tx_after_a_lost_race(_record)
        return self.get_snapshot(snapshot_id)

    def snapshot_checks(self, snapshot_id: str, manifest_sha256: str) -> list[SnapshotCheckRecord]:
        t = schema.snapshot_checks
        return self._records(
            sa.select(t)
            .where(t.c.snapshot_id == snapshot_id, t.c.manifest_sha256 == manifest_sha256)
            .order_by(t.c.check_name),
            SnapshotCheckRecord,
        )

    def snapshot_check_history(self, snapshot_id: str) -> list[SnapshotCheckRecord]:
        """Every check evaluation of the snapshot, on any manifest, oldest first."""
        t = schema.snapshot_check_history
        return self._records(
            sa.select(t)
            .where(t.c.snapshot_id == snapshot_id)
            .order_by(t.c.checked_at, t.c.check_run_id),
            SnapshotCheckRecord,
        )

    def snapshots_with_content(self, content_sha256: str) -> list[SnapshotRecord]:
        """Every snapshot whose files hold byte-identical data (whatever their names)."""
        t = schema.snapshots
        return self._records(
            sa.select(t).where(t.c.content_sha256 == content_sha256).order_by(t.c.created_at),
            SnapshotRecord,
        )

    def record_promotion(self, record: PromotionRecord) -> PromotionRecord:
        """Record the decision and, in the same transaction, the run's status it implies."""
        values = _record_values(record, schema.promotions)
        status = {
            PromotionDecision.PROMOTED: RunStatus.PROMOTED,
            PromotionDecision.REFUSED: RunStatus.REFUSED,
        }.get(PromotionDecision(record.decision))  # unchanged: the run keeps its status
        runs, promotions = schema.training_runs, schema.promotions

        def _record(conn: Connection) -> None:
            # Keyed by promotion id: a retried transaction that already landed is not repeated.
            exists = conn.execute(
                sa.select(promotions.c.promotion_id).where(
                    promotions.c.promotion_id == record.promotion_id
                )
            ).first()
            if exists is None:
                conn.execute(sa.insert(promotions).values(**values))
            if status is None:
                return
            update = sa.update(runs).where(runs.c.run_id == record.run_id)
            if status == RunStatus.REFUSED:
                # A run whose checkpoint once became the champion stays "promoted": a later
                # refusal (the gate run again against a newer champion) is a row of its own.
                update = update.where(runs.c.status != str(RunStatus.PROMOTED))
            conn.execute(update.values(status=str(status)))

        self._tx(_record)
        return record

    def promotions(
        self,
        *,
        model_name: str | None = None,
        run_id: str | None = None,
        decision: PromotionDecision | None = None,
    ) -> list[PromotionRecord]:
        """Promotion decisions, newest first."""
        t = schema.promotions
        query = sa.select(t).order_by(t.c.decided_at.desc())
        if model_name is not None:
            query = query.where(t.c.model_name == model_name)
        if run_id is not None:
            query = query.where(t.c.run_id == run_id)
        if decision is not None:
            query = query.where(t.c.decision == str(decision))
        return self._records(query, PromotionRecord)

    def current_champion(self, model_name: str) -> PromotionRecord | None:
        promoted = self.promotions(model_name=model_name, decision=PromotionDecision.PROMOTED)
        return promoted[0] if promoted else None

    # -- the logbook ---------------------------------------------------------------------------

    def add_note(
        self,
        run_id: str,
        text: str,
        *,
        author: str,
        source: str,
        attempt_no: int | None = None,
    ) -> NoteRecord:
        """Append a note to run ``run_id`` (or to its attempt ``attempt_no``); never edits one.

        Refused before anything is written: an invalid id, text that is empty, longer than
        2000 characters or holds a control character other than a newline, an empty author or
        source (:class:`~pipeline.ledger.notes.InvalidNoteError`); a run or attempt the ledger
        does not hold (:class:`UnknownRunError`, :class:`UnknownAttemptError`). URL passwords
        in the text are masked.
        """
        ids.run_id(run_id)
        if attempt_no is not None:
            ids.attempt_no(attempt_no)
        values = {
            "run_id": run_id,
            "attempt_no": attempt_no,
            "text": note_text(text),
            "author": one_line_name(author, "author", MAX_AUTHOR_CHARS),
            "source": one_line_name(source, "source", MAX_SOURCE_CHARS),
            # Made once per call: a retried transaction whose first COMMIT did land finds it.
            "note_uid": str(uuid.uuid4()),
        }
        t, runs, attempts = schema.notes, schema.training_runs, schema.training_attempts

        def _add(conn: Connection) -> Any:
            done = conn.execute(sa.select(t).where(t.c.note_uid == values["note_uid"])).first()
            if done is not None:
                return done
            run = conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run_id)).first()
            if run is None:
                raise UnknownRunError(run_id)
            if attempt_no is not None:
                found = conn.execute(
                    sa.select(attempts.c.attempt_no).where(
                        attempts.c.run_id == run_id, attempts.c.attempt_no == attempt_no
                    )
                ).first()
                if found is None:
                    raise UnknownAttemptError(run_id, attempt_no)
            conn.execute(sa.insert(t).values(created_at=utcnow(), **values))
            return conn.execute(sa.select(t).where(t.c.note_uid == values["note_uid"])).one()

        return NoteRecord.from_row(self._tx(_add))

    def notes(self, run_id: str) -> list[NoteRecord]:
        """Every note on run ``run_id`` and on its attempts, oldest first."""
        t = schema.notes
        return self._records(
            sa.select(t).where(t.c.run_id == run_id).order_by(t.c.created_at, t.c.note_id),
            NoteRecord,
        )


def _first(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", exc)).strip().splitlines()
    return redact.text(lines[0] if lines else type(exc).__name__)


def cost_by_reason_query(model_family: str, since: datetime) -> sa.Select[Any]:
    """The seed question as a SQLAlchemy query (``Ledger.cost_by_reason``; the benchmark's plan)."""
    t = schema.training_attempts
    gpu_hours = (sa.func.sum(t.c.gpu_seconds) / 3600.0).label("gpu_hours")
    cpu_hours = (sa.func.sum(t.c.cpu_seconds) / 3600.0).label("cpu_hours")
    return (
        sa.select(t.c.termination_reason, sa.func.count().label("attempts"), gpu_hours, cpu_hours)
        .where(t.c.model_family == model_family, t.c.started_at >= since)
        .group_by(t.c.termination_reason)
        .order_by(gpu_hours.desc(), t.c.termination_reason.asc().nulls_last())
    )


def _record_values(record: Any, table: sa.Table) -> dict[str, Any]:
    names: Sequence[str] = [c.name for c in table.columns]
    return {name: getattr(record, name) for name in names if hasattr(record, name)}


# pg_advisory_xact_lock's key for ledger migrations: any fixed 64-bit number Tracks owns.
_MIGRATION_LOCK = 0x7472_6163_6B73  # "tracks"


@contextlib.contextmanager
def _file_lock(engine: sa.Engine) -> Iterator[None]:
    """An exclusive ``flock`` on ``<database>.lock`` for a SQLite file; nothing otherwise."""
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database or database == ":memory:":
        yield
        return
    from pipeline.durable import exclusive_lock

    with exclusive_lock(Path(f"{database}.lock")):
        yield
