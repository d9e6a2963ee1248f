"""PostgreSQL restarted 10 times under a training run that writes its receipt there.

The server is restarted for real (``pg_ctl stop -m fast``, down for 1.5 s, ``pg_ctl start``)
with dirty buffers waiting to be flushed, so each shutdown takes a moment and the trainer's
heartbeats, checkpoint rows and commits meet a server that is shutting down, gone, or starting up.
Afterwards the ledger must tell the true story: every attempt ended with its true reason, none
left `running`, and every checkpoint committed on disk has exactly one ledger row (and no row
lacks its directory).

The server is the drill's own (tests/pg_server.py), not the shared one on 5432: restarting that
one would break every other test's connections, so the drill runs beside the rest of the suite.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from pipeline.checkpoint import checkpoint_dirs, verify_checkpoint
from pipeline.ledger import Ledger
from pipeline.states import CheckpointState
from pipeline.trainer import exit_codes
from tests.pg_server import PrivatePostgres
from tests.trainer_support import write_config

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

REPO = Path(__file__).resolve().parent.parent
RESTARTS = 10
# Seconds each restart leaves the server down: `pg_ctl -w` is back within 0.4 s here, and the
# trainer should meet a server that is gone for a while, not only one shutting down.
DOWN_SECONDS = 1.5
MAX_STEPS = 400
RUN_ID = "pg-restart-drill"


def _dirty(url: str, stop: threading.Event) -> None:
    """Keep shared buffers dirty: an UPDATE of a whole table between restarts, never flushed."""
    engine = sa.create_engine(url, pool_pre_ping=True)
    while not stop.is_set():
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("UPDATE drill_ballast SET n = n + 1"))
        except sa.exc.DBAPIError:
            time.sleep(0.2)  # the server is restarting; the drill's point
    engine.dispose()


@pytest.fixture
def drill_snapshot(tmp_path: Path) -> Path:
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    write_digits_landing(tmp_path / "landing")
    return create_snapshot(tmp_path / "landing", tmp_path / "snapshots").path


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.close()


def test_ten_restarts_lose_nothing_and_every_attempt_tells_the_truth(
    private_pg: PrivatePostgres,
    drill_snapshot: Path,
    tmp_path: Path,
) -> None:
    pg_database = private_pg.url
    ledger = Ledger.open(pg_database)
    with ledger.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE drill_ballast (id int primary key, n int, pad text)"))
        conn.execute(
            sa.text(
                "INSERT INTO drill_ballast SELECT g, 0, repeat('x', 200) "
                "FROM generate_series(1, 200000) g"
            )
        )
    store = tmp_path / "store"
    config = write_config(
        tmp_path / "config", drill_snapshot, max_steps=MAX_STEPS, checkpoint_every_steps=10,
        keep_last_k=1000, keep_best_k=0,
    )  # fmt: skip
    log = tmp_path / "trainer.log"
    env = {
        **os.environ,
        "TRACKS_HEARTBEAT_SECONDS": "0.2",
        "TRACKS_FAULT_SLEEP_AFTER_STEP": "0.1",  # every step: the run outlives 10 restarts
    }
    stop = threading.Event()
    ballast = threading.Thread(target=_dirty, args=(pg_database, stop), daemon=True)
    with open(log, "w") as out:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
             "--run-id", RUN_ID, "--store", str(store), "--ledger-url", pg_database],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        ballast.start()
        durations = []
        try:
            # The first restart lands while the trainer is still starting (importing, opening
            # the ledger): start-up must wait for the server too, not die before step 1.
            time.sleep(1.0)
            for _ in range(RESTARTS):
                if trainer.poll() is not None:
                    break
                durations.append(private_pg.restart(DOWN_SECONDS))
                time.sleep(1.0)
            returncode = trainer.wait(timeout=240)
        finally:
            stop.set()
            if trainer.poll() is None:
                trainer.kill()
    ballast.join(timeout=30)
    output = log.read_text()
    retries = output.count("retrying in")
    print(
        f"\n{len(durations)} restarts: median {statistics.median(durations):.2f} s, "
        f"max {max(durations):.2f} s; trainer exit {returncode}; "
        f"ledger transactions retried {retries} times"
    )
    assert len(durations) == RESTARTS, (
        f"the trainer ended before the restarts did:\n{output[-3000:]}"
    )

    ledger = Ledger.open(pg_database)
    attempts = ledger.attempts(RUN_ID)
    # One process, one attempt: no retried begin_attempt opened a second one.
    assert [a.attempt_no for a in attempts] == [1], [a.key for a in attempts]
    [attempt] = attempts
    assert attempt.status != "running"
    if returncode == exit_codes.SUCCEEDED:
        assert attempt.termination_reason == "succeeded", attempt.termination_detail
        assert attempt.last_step == MAX_STEPS
    else:
        # A trainer may only die of the database with the reason that says so.
        assert returncode == exit_codes.INFRA_TRANSIENT, output[-3000:]
        assert attempt.termination_reason == "infra_transient", attempt.termination_detail

    rows = ledger.checkpoints(RUN_ID)
    paths = [r.path for r in rows]
    assert len(paths) == len(set(paths)), "a checkpoint row was written twice"
    committed_rows = {r.path for r in rows if r.state == CheckpointState.COMMITTED}
    on_disk = {str(d) for d in checkpoint_dirs(store / RUN_ID)}
    for directory in on_disk:
        verify_checkpoint(directory)
    assert on_disk == committed_rows, (sorted(on_disk ^ committed_rows), output[-3000:])
    if returncode == exit_codes.SUCCEEDED:
        assert len(on_disk) == MAX_STEPS // 10
