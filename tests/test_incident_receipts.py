"""An incident built through the real paths, and every receipt sentence checked against it.

A real ``dagster dev`` (webserver + daemon, the resume sensor on), runs launched through GraphQL
as the UI's launchpad sends them, the trainer as two ranks under torchrun, and signals sent at
chosen moments to chosen ranks. The test knows the truth it injected (which rank got which
signal at which step, what was committed, who launched what) and holds the ledger, ``tracks
explain`` and the cost query to it:

- run A: rank 1 SIGKILLed at step 150 (last commit 100); the sensor's continuation is SIGTERMed
  on both ranks at step 150 (committed there); the next continuation finishes.
- run B: killed at step 150, then a person's continuation on one rank, carrying tags copied from
  run A, races the sensor's two-rank continuation: one fences the other out. Then a person
  presses "Re-execute from failure" on the first Dagster run of B.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.explain import explain
from pipeline.ledger import AttemptRecord, Ledger
from tests.dagster_dev import (
    DagsterDev,
    launch_graph,
    live_drill,
    reexecute,
    trainer_ranks,
    wait_for,
)

pytestmark = pytest.mark.slow

# The ranks pause after step 150 (a drill hook), by which time step 100 is committed: the
# moment the signals land. A stop signal ends the pause at once.
PAUSE_STEP, COMMIT_EVERY = 150, 100
HOOKS = {"TRACKS_FAULT_SLEEP_AFTER_STEP": f"6@{PAUSE_STEP}"}
TRAINING = {
    "max_steps": 200, "checkpoint_every_steps": COMMIT_EVERY, "keep_last_k": 5,
    "model": {"channels": 8, "hidden": 32},
}  # fmt: skip
TWO_RANKS = {"trainer": {"config": {"backend": "torchrun", "nproc_per_node": 2}}}
ONE_RANK = {"trainer": {"config": {"backend": "local"}}}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DagsterDev, Path, str]]:
    with live_drill(tmp_path_factory.mktemp("incident") / "tracks", HOOKS) as live:
        yield live


def _ledger(home: Path) -> Ledger:
    return Ledger.open(f"sqlite:///{home / 'ledger.db'}")


def _attempt(ledger: Ledger, run_id: str, attempt_no: int) -> AttemptRecord | None:
    return next((a for a in ledger.attempts(run_id) if a.attempt_no == attempt_no), None)


def _run_of(ledger: Ledger, dagster_run_id: str) -> str | None:
    return next(
        (a.run_id for a in ledger.list_attempts(limit=50) if a.dagster_run_id == dagster_run_id),
        None,
    )


def _start(server: DagsterDev, home: Path, snapshot: str, seed: int) -> tuple[str, str]:
    # The resume sensor's continuations are the point: no continuing in place (carried over).
    dagster_run = launch_graph(
        server,
        snapshot,
        {"train": {**TRAINING, "seed": seed}, "continue_in_run": False},
        resources=TWO_RANKS,
    )
    ledger = _ledger(home)
    run_id = wait_for(lambda: _run_of(ledger, dagster_run), 120, "the run's first attempt")
    return dagster_run, run_id


def _wait_paused(home: Path, run_id: str, attempt_no: int, ranks: int = 2) -> dict[int, int]:
    ledger = _ledger(home)
    wait_for(
        lambda: (
            _attempt(ledger, run_id, attempt_no) is not None
            and ledger.latest_committed_checkpoint(run_id) is not None
            and len(trainer_ranks(run_id)) == ranks
            and _heartbeat_step(ledger, run_id, attempt_no) >= PAUSE_STEP
        ),
        240,
        f"attempt {attempt_no} of {run_id} to pause at step {PAUSE_STEP}",
        interval=0.5,
    )
    return trainer_ranks(run_id)


def _heartbeat_step(ledger: Ledger, run_id: str, attempt_no: int) -> int:
    # The drill hook beats the heart as the pause begins: the ledger then says step 150.
    attempt = _attempt(ledger, run_id, attempt_no)
    return (attempt.last_step or 0) if attempt is not None and attempt.ended_at is None else 0


def _ended(home: Path, run_id: str, attempt_no: int, timeout: float = 240) -> AttemptRecord:
    """The attempt once its orchestrator has ended it and recorded the retry decision (two
    writes: a read between them sees an ended attempt whose decision is still to come)."""
    ledger = _ledger(home)
    return wait_for(
        lambda: (
            (a := _attempt(ledger, run_id, attempt_no)) is not None
            and a.ended_at
            and a.retry_decision is not None
            and a
        ),
        timeout,
        f"attempt {attempt_no} of {run_id} to end with a retry decision",
        interval=1.0,
    )


def _committed_steps(ledger: Ledger, run_id: str, attempt_no: int) -> list[int]:
    return sorted(
        c.step
        for c in ledger.checkpoints(run_id)
        if c.attempt_no == attempt_no and c.committed_at is not None
    )


def _said_committed(sentence: str) -> list[int]:
    return [int(s) for s in re.findall(r"last committed checkpoint is step (\d+)", sentence)]


def test_an_incident_at_two_ranks_is_told_as_it_happened(
    live: tuple[DagsterDev, Path, str],
) -> None:
    server, home, snapshot = live
    ledger = _ledger(home)

    # --- Run A, attempt 1: rank 1 SIGKILLed in the pause after step 150; step 100 committed.
    _, run_a = _start(server, home, snapshot, seed=21)
    ranks = _wait_paused(home, run_a, 1)
    os.kill(ranks[1], signal.SIGKILL)
    a1 = _ended(home, run_a, 1)
    assert _committed_steps(ledger, run_a, 1) == [COMMIT_EVERY]
    assert a1.termination_reason == "preempted", a1.termination_detail
    assert a1.signal == "SIGKILL", (a1.signal, a1.termination_detail)
    assert "rank 1" in a1.termination_detail.lower(), a1.termination_detail
    assert a1.last_step == PAUSE_STEP, a1.last_step
    # "The last committed checkpoint" is the commit, never the step reached.
    assert _said_committed(a1.termination_detail) in ([], [COMMIT_EVERY]), a1.termination_detail
    assert f"step {PAUSE_STEP}" not in " ".join(
        re.findall(r"last commit\w* checkpoint is step \d+", a1.termination_detail)
    )
    # Rank 0 died of its peer's death: collateral, never "failed first" on its own account.
    assert not re.search(r"rank 0 failed first", a1.termination_detail, re.I), a1.termination_detail

    # --- Attempt 2, launched by the resume sensor on two ranks: SIGTERM to both in the pause.
    ranks = _wait_paused(home, run_a, 2)
    a2_open = _attempt(ledger, run_a, 2)
    assert a2_open is not None and a2_open.launched_by["via"].startswith("sensor:")
    for pid in ranks.values():
        os.kill(pid, signal.SIGTERM)
    a2 = _ended(home, run_a, 2)
    assert a2.termination_reason == "preempted", a2.termination_detail
    assert a2.exit_code == 75, (a2.exit_code, a2.termination_detail)
    assert a2.signal == "SIGTERM", a2.signal
    assert _committed_steps(ledger, run_a, 2) == [PAUSE_STEP]
    assert re.search(r"both ranks stopped on SIGTERM at step 150", a2.termination_detail), (
        a2.termination_detail
    )
    assert "failed first" not in a2.termination_detail, a2.termination_detail

    # --- Attempt 3 finishes from the preemption checkpoint; the graph goes on.
    a3 = _ended(home, run_a, 3, timeout=300)
    assert a3.termination_reason == "succeeded", a3.termination_detail
    assert a3.restored_step == PAUSE_STEP
    page = explain(ledger, run_a)
    for attempt in (a1, a2):
        assert attempt.termination_detail.split(";")[0] in page
    # The page never says a committed step that is not a commit.
    committed = {c.step for c in ledger.checkpoints(run_a) if c.committed_at is not None}
    assert set(_said_committed(page)) <= committed, page
    # Drill hooks active in the trainers' environment are on the receipt.
    assert a1.placement.get("fault_hooks") == HOOKS, a1.placement
    assert "TRACKS_FAULT_SLEEP_AFTER_STEP" in page

    # --- Run B: killed at step 150 on both ranks. The sensor's two-rank continuation is held
    # (SIGSTOP) in its pause while a person continues the run on one rank from the launchpad,
    # with tags copied from run A: the person's attempt takes the fencing token, and the
    # sensor's, let go, is fenced out at its next commit.
    first_b, run_b = _start(server, home, snapshot, seed=22)
    ranks = _wait_paused(home, run_b, 1)
    for pid in ranks.values():
        os.kill(pid, signal.SIGKILL)
    b1 = _ended(home, run_b, 1)
    assert b1.signal == "SIGKILL", b1.termination_detail
    assert server.wait_for_run(first_b, timeout=120) == "FAILURE"
    held = _wait_paused(home, run_b, 2)
    for pid in held.values():
        os.kill(pid, signal.SIGSTOP)
    copied = {"tracks/run_id": run_a, "tracks/continuation": f"{run_a}:attempt-1"}
    try:
        person_run = launch_graph(
            server,
            snapshot,
            {"train": {**TRAINING, "seed": 22}, "run_id": run_b},
            assets=["training_attempt"],
            resources=ONE_RANK,
            tags=copied,
        )
        wait_for(lambda: _attempt(ledger, run_b, 3), 120, "the person's attempt to open")
    finally:
        for pid in held.values():
            os.kill(pid, signal.SIGCONT)
    b2, b3 = _ended(home, run_b, 2), _ended(home, run_b, 3, timeout=300)
    assert b3.dagster_run_id == person_run and b3.run_id == run_b
    assert b3.launched_by["via"] == "ui", b3.launched_by
    assert b3.termination_reason == "succeeded", b3.termination_detail
    assert all(a.dagster_run_id != person_run for a in ledger.attempts(run_a))
    # Fenced out by the person's attempt: its own reason, naming who took over and how.
    assert b2.termination_reason == "fenced", b2.termination_detail
    assert b2.exit_code == 80, b2.exit_code
    assert "attempt 3" in b2.termination_detail and "ui" in b2.termination_detail
    assert "cancel" not in b2.termination_detail.lower()
    assert b2.retry_decision["action"] != "resume", b2.retry_decision
    # The copied tags claim run A; the ledger says run B, and the page says both.
    page_b = explain(ledger, run_b)
    assert run_a in page_b and "claim" in page_b, page_b
    assert person_run not in explain(ledger, run_a)
    # The placements differ (one rank against two), and the receipt says so.
    assert (b2.placement.get("world_size"), b3.placement.get("world_size") or 1) == (2, 1)
    assert re.search(r"[Aa]ttempt 3 ran on 1 rank where attempt 2 ran on 2", page_b), page_b

    # --- "Re-execute from failure" of run B's first Dagster run: never a new ledger run.
    runs_before = {a.run_id for a in ledger.list_attempts(limit=200)}
    again = reexecute(server, first_b)
    server.wait_for_run(again, timeout=300)
    runs_after = {a.run_id for a in ledger.list_attempts(limit=200)}
    assert runs_after == runs_before, runs_after - runs_before
    [reexecuted] = [a for a in ledger.attempts(run_b) if a.dagster_run_id == again]
    assert reexecuted.launched_by["via"] == f"reexecution:{first_b}", reexecuted.launched_by
    assert reexecuted.admission and reexecuted.admission.get("rule") != "new run"

    # --- Cost: lost steps are counted under the reason that lost them: 50 for each SIGKILL
    # at step 150 after the commit at 100, none for the SIGTERM that committed where it stood.
    lost = ledger.cost_by_reason_lost_steps("digits-cnn", days=1)
    assert lost.get("preempted") == 2 * (PAUSE_STEP - COMMIT_EVERY), lost
    assert lost.get("fenced", 0) > 0, lost
