"""Stopping together at two ranks: real torchrun (gloo, CPU), real signals.

A SIGTERM to every rank, to one rank or to the launcher ends the attempt with exit 75 and one
preemption checkpoint, at one step, holding every rank's shard; a stop during start-up ends it
there, having trained and saved nothing, the newest commit standing. The drill lands 30 such
SIGTERMs at seeded random moments on one long run (each stop one attempt, each next attempt
resuming from the last). The focused tests land a signal where it went wrong before: inside
the stop agreement, while a rank waits for a peer that will never join, before the launcher
started any rank, and during a preemption save whose peer is killed.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.kill_drill import make_snapshot
from bench.kill_drill import write_config as write_drill_config
from pipeline.checkpoint import checkpoint_dirs, parse_checkpoint_dir_name, verify_checkpoint
from pipeline.checkpoint.layout import COMMITTED_FILE, MANIFEST_FILE
from pipeline.trainer import exit_codes
from pipeline.trainer.train import FAULT_SLEEP_AFTER_STEP, FAULT_SLEEP_BEFORE_AGREEMENT
from tests.distributed_support import (
    LaunchedRanks,
    catches_signal,
    launch_ranks,
    log_events,
    trainer_rank_pids,
    wait_for_ranks_catching_sigterm,
)

MAX_STEPS = 100_000  # never reached: every attempt here ends in a stop
SIGTERMS = 30
# The 30 are landed on three runs of 10, side by side on the suite's workers: one run of 30
# attempts one after another was the suite's longest test (6-10 minutes). Each chunk has its
# own seed; with these, 24 of the 30 moments fall while training, 12 with the agreement held.
CHUNKS = 3
PER_CHUNK = SIGTERMS // CHUNKS
TARGETS = ("all ranks", "one rank", "the launcher")
START_UP = "during start-up"  # how a rank's sentence says it stopped before training a step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_snapshot(tmp_path_factory.mktemp("stop-drill") / "data")


@pytest.fixture(scope="module")
def config(snapshot: Path) -> Path:
    # No interval saves: the one checkpoint an attempt commits is its preemption checkpoint.
    return write_drill_config(
        snapshot.parent.parent / "config",
        snapshot,
        max_steps=MAX_STEPS,
        checkpoint_every_steps=MAX_STEPS,
        keep_last_k=2,
    )


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _stepped(launched: LaunchedRanks, step: int) -> bool:
    """Whether rank 0 of the launched attempt (its own log) reached ``step``."""
    events = log_events(launched.log)
    return any(e.get("event") == "step" and e["step"] >= step for e in events)


def _newest(run_dir: Path) -> tuple[int, str] | None:
    """Step and directory name of the newest committed checkpoint, if any."""
    newest = checkpoint_dirs(run_dir)[:1]
    if not newest:
        return None
    parsed = parse_checkpoint_dir_name(newest[0].name)
    assert parsed is not None
    return parsed[0], newest[0].name


def _join_thread_alive(pid: int) -> bool:
    """Whether a rank is waiting for its peers to join (the trainer names that thread)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "comm").read_text().startswith("tracks-join"):
                return True
        except OSError:
            continue
    return False


def test_a_sigterm_inside_the_stop_agreement_is_acted_on_by_every_rank_at_the_next_step(
    config: Path, tmp_path: Path
) -> None:
    """Rank 1 lingers inside the agreement after step 5 while rank 0 waits in the reduction;
    rank 0's SIGTERM lands there. The agreement said "go on": both ranks train step 6, agree
    then, and save step 6 together (before, rank 0 saved alone and the attempt broke)."""
    store, run_id = tmp_path / "store", "inside-agreement"
    env = {FAULT_SLEEP_BEFORE_AGREEMENT: "3@5@1"}
    launched = launch_ranks(config, store, run_id, env=env)
    try:
        _wait_until(lambda: _stepped(launched, 5), "step 5")
        time.sleep(1.0)  # rank 0 is in the reduction, rank 1 sleeps in the agreement for 2 s more
        os.kill(trainer_rank_pids(launched.process.pid)[0], signal.SIGTERM)
        code = launched.process.wait(timeout=90)
    finally:
        if launched.process.poll() is None:
            os.killpg(launched.process.pid, signal.SIGKILL)
    tail = launched.log.read_text()[-3000:]
    assert code == exit_codes.PREEMPTED, tail
    outcomes = launched.outcomes()
    assert {r: (o["exit_code"], o["reason"], o["step"]) for r, o in outcomes.items()} == {
        0: (exit_codes.PREEMPTED, "preempted", 6),
        1: (exit_codes.PREEMPTED, "preempted", 6),
    }, tail
    assert outcomes[0]["detail"].startswith("Stopped on SIGTERM after step 6 ")
    assert outcomes[1]["detail"].startswith("Stopped on a stop another rank received after step 6")
    assert _newest(store / run_id) == (6, "step-0000000006-a01")
    info = verify_checkpoint(store / run_id / "step-0000000006-a01")
    assert info.world_size == 2 and info.step == 6


def test_a_rank_killed_before_it_joins_does_not_hold_its_peer_for_the_grace_period(
    config: Path, tmp_path: Path
) -> None:
    """Rank 1 is frozen before it can join the process groups, rank 0 waits for it there, then
    rank 1 is killed. torchrun's agent SIGTERMs rank 0, which gives up the join at once and
    says so (before, it stayed in the join until the agent SIGKILLed it 30 s later)."""
    store, run_id = tmp_path / "store", "peer-never-joins"
    launched = launch_ranks(config, store, run_id)
    try:
        ranks: dict[int, int] = {}

        def rank_1_frozen() -> bool:
            ranks.update(trainer_rank_pids(launched.process.pid))
            if 1 in ranks:
                os.kill(ranks[1], signal.SIGSTOP)
            return 1 in ranks and 0 in ranks

        _wait_until(rank_1_frozen, "both ranks")
        started = time.monotonic()
        # Waiting to join, or (code that has no such thread) surely there after 10 s.
        _wait_until(
            lambda: _join_thread_alive(ranks[0]) or time.monotonic() - started > 10,
            "rank 0 waiting to join",
        )
        time.sleep(0.5)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        code = launched.process.wait(timeout=90)
        took = time.monotonic() - killed
    finally:
        if launched.process.poll() is None:
            os.killpg(launched.process.pid, signal.SIGKILL)
    tail = launched.log.read_text()[-3000:]
    assert took < 10, f"the launcher took {took:.1f} s after rank 1 died:\n{tail}"
    assert code == 128 + signal.SIGKILL, tail  # the rank that was killed is the story
    survivor = launched.outcomes()[0]
    assert (survivor["exit_code"], survivor["reason"]) == (exit_codes.PREEMPTED, "preempted")
    assert "while waiting for the other ranks to join" in survivor["detail"], survivor
    assert "trained no step and saved nothing" in survivor["detail"]
    assert checkpoint_dirs(store / run_id) == []


def test_a_sigterm_to_the_launcher_before_it_starts_a_rank_ends_preempted_at_once(
    config: Path, tmp_path: Path
) -> None:
    """The launcher catches SIGTERM from its first moments: no rank is started for a stop that
    came first, and it exits 75 (before, it died of the signal, or told its just-started ranks
    to stop before they could listen)."""
    store, run_id = tmp_path / "store", "stopped-early"
    launched = launch_ranks(config, store, run_id)
    try:
        _wait_until(lambda: catches_signal(launched.process.pid), "the launcher's handler", 30)
        os.kill(launched.process.pid, signal.SIGTERM)
        code = launched.process.wait(timeout=60)
    finally:
        if launched.process.poll() is None:
            os.killpg(launched.process.pid, signal.SIGKILL)
    log = launched.log.read_text()
    assert code == exit_codes.PREEMPTED, log[-3000:]
    assert "stopped on SIGTERM before any rank started" in log
    assert launched.outcomes() == {} and not (store / run_id).exists()


def test_a_peer_killed_during_the_preemption_save_leaves_the_previous_commit_and_says_so(
    snapshot: Path, tmp_path: Path
) -> None:
    """Both ranks are SIGTERMed after step 4 and save it together; rank 0 is killed after the
    shards are written, before COMMITTED. Step 4 is not committed, step 3 stands, and rank 1
    says it stopped on SIGTERM and that its peer died during the save, naming step 3
    (before, rank 1 read as an infrastructure failure, exit 74)."""
    config = write_drill_config(
        tmp_path / "config", snapshot, max_steps=MAX_STEPS, checkpoint_every_steps=3, keep_last_k=2
    )
    store, run_id = tmp_path / "store", "peer-dies-in-save"
    env = {FAULT_SLEEP_AFTER_STEP: "60@4", "TRACKS_FAULT_SLEEP_BEFORE_COMMIT": "60@4"}
    launched = launch_ranks(config, store, run_id, env=env)
    step_4 = store / run_id / "step-0000000004-a01"
    try:
        _wait_until(lambda: _stepped(launched, 4), "step 4")
        ranks = trainer_rank_pids(launched.process.pid)
        for pid in ranks.values():
            os.kill(pid, signal.SIGTERM)
        _wait_until((step_4 / MANIFEST_FILE).exists, "step 4's shards and manifest")
        os.kill(ranks[0], signal.SIGKILL)
        code = launched.process.wait(timeout=90)
    finally:
        if launched.process.poll() is None:
            os.killpg(launched.process.pid, signal.SIGKILL)
    tail = launched.log.read_text()[-3000:]
    # The process-level fact is a SIGKILLed rank; its peer's own account is a stop.
    assert code in (exit_codes.PREEMPTED, 128 + signal.SIGKILL), tail
    assert not (step_4 / COMMITTED_FILE).exists()
    assert _newest(store / run_id) == (3, "step-0000000003-a01")
    peer = launched.outcomes()[1]
    assert (peer["exit_code"], peer["reason"], peer["step"]) == (
        exit_codes.PREEMPTED,
        "preempted",
        4,
    ), peer
    detail = peer["detail"]
    assert detail.startswith("Stopped on SIGTERM after step 4 "), detail
    assert "a peer rank died or became unreachable while committing" in detail, detail
    assert "the preemption checkpoint at step 4 was not committed" in detail, detail
    assert detail.endswith("The newest committed checkpoint is step 3 (step-0000000003-a01)."), (
        detail
    )


def _signal(target: str, launched: LaunchedRanks, ranks: dict[int, int], rng: random.Random) -> str:
    if target == "the launcher":
        os.kill(launched.process.pid, signal.SIGTERM)
        return target
    victims = sorted(ranks) if target == "all ranks" else [rng.choice(sorted(ranks))]
    for rank in victims:
        os.kill(ranks[rank], signal.SIGTERM)
    return ", ".join(f"rank {r}" for r in victims)


def _check_stop(
    launched: LaunchedRanks,
    code: int,
    run_dir: Path,
    before: tuple[int, str] | None,
    said: str,
) -> str:
    """One attempt's stop: exit 75, every rank preempted, and one preemption checkpoint at the
    step every rank names, or (stopped during start-up) nothing new. Returns where it landed."""
    tail = launched.log.read_text(errors="replace")[-3000:]
    assert code == exit_codes.PREEMPTED, f"{said}: exit {code}\n{tail}"
    outcomes = launched.outcomes()
    assert sorted(outcomes) == [0, 1], f"{said}: {outcomes}\n{tail}"
    stopped = {r: o for r, o in outcomes.items() if o["reason"] == "preempted"}
    assert all(o["exit_code"] == exit_codes.PREEMPTED for o in stopped.values()), outcomes
    newest = _newest(run_dir)
    if stopped and all(START_UP in o["detail"] for o in stopped.values()):
        # A rank whose peer stopped while they were joining may see it only as a peer gone.
        for rank in set(outcomes) - set(stopped):
            collateral = (outcomes[rank]["exit_code"], outcomes[rank]["detail"])
            assert collateral[0] == exit_codes.INFRA_TRANSIENT, (said, rank, collateral)
            assert "a peer rank is gone" in collateral[1], (said, rank, collateral)
        assert newest == before, f"{said}: a start-up stop changed the commits {before} -> {newest}"
        return "start-up"
    assert stopped == outcomes, f"{said}: not every rank stopped: {outcomes}"
    steps = {o["step"] for o in outcomes.values()}
    assert len(steps) == 1, f"{said}: the ranks stopped at different steps: {outcomes}"
    (step,) = steps
    numbers = {o["attempt_no"] for o in outcomes.values()}
    assert len(numbers) == 1, f"{said}: the ranks disagree on the attempt: {outcomes}"
    (attempt_no,) = numbers
    expected = f"step-{step:010d}-a{attempt_no:02d}"
    if any("a peer rank died" in o["detail"] for o in outcomes.values()) and newest == before:
        return "training, a peer lost during the save"  # the previous commit stands, as said
    # One preemption checkpoint, every rank's shard in it, and nothing else from this attempt.
    assert newest == (step, expected), f"{said}: newest {newest}, expected {expected}"
    assert before is None or step > before[0]
    info = verify_checkpoint(run_dir / expected)
    assert (info.step, info.world_size) == (step, 2)
    own = [d for d in run_dir.glob(f"step-*-a{attempt_no:02d}") if (d / COMMITTED_FILE).exists()]
    assert [d.name for d in own] == [expected], f"{said}: {own}"
    return "training"


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_thirty_sigterms_at_random_moments_each_end_in_one_preemption_checkpoint(
    config: Path, tmp_path: Path, chunk: int
) -> None:
    """Three long runs of 10 attempts (30 in all), each attempt stopped by one SIGTERM (to
    every rank, to one rank, or to the launcher, in turn) at a seeded random moment: during
    start-up, or while training (every other attempt with rank 1 lingering in each stop
    agreement, so that a signal most likely lands inside it; the first test lands one there
    for sure). Each attempt resumes from the checkpoint the one before committed."""
    rng = random.Random(21 + chunk)
    store, run_id = tmp_path / "store", f"drill-{chunk}"
    run_dir = store / run_id
    landed: Counter[str] = Counter()
    began = time.monotonic()
    for n in range(chunk * PER_CHUNK, (chunk + 1) * PER_CHUNK):
        target = TARGETS[n % len(TARGETS)]
        held = n % 2 == 1  # rank 0 then spends nearly all its time waiting in the agreement
        env = {FAULT_SLEEP_BEFORE_AGREEMENT: "0.15@@1"} if held else {}
        before = _newest(run_dir)
        log = store / "logs" / f"attempt-{n}.log"  # one each: polled while it is written
        launched = launch_ranks(config, store, run_id, env=env, log=log)
        try:
            ranks = wait_for_ranks_catching_sigterm(launched)
            if rng.random() < 0.3:
                # Start-up: joining, loading the data, restoring the newest checkpoint.
                time.sleep(rng.uniform(0.0, 1.5))
            else:
                _wait_until(functools.partial(_stepped, launched, 1), "a first step")
                time.sleep(rng.uniform(0.0, 0.6))
            said = f"SIGTERM {n} to {_signal(target, launched, ranks, rng)}"
            code = launched.process.wait(timeout=90)
        finally:
            if launched.process.poll() is None:
                os.killpg(launched.process.pid, signal.SIGKILL)
        where = _check_stop(launched, code, run_dir, before, said)
        landed[f"{where}, agreement held open" if held and where == "training" else where] += 1
        started = [e for e in log_events(log) if e["event"] == "attempt_started"]
        if started:  # the attempt resumed from the newest commit
            resumed = started[0]["resumed_from"]
            assert (Path(resumed).name if resumed else None) == (before[1] if before else None)
    took = time.monotonic() - began
    print(f"stop drill {chunk}: {PER_CHUNK} SIGTERMs in {took:.0f} s, landed {dict(landed)}")
    # Half of them while training, two or more inside a held agreement: 15 and 6 of the 30.
    assert landed["training"] + landed["training, agreement held open"] >= PER_CHUNK // 2
    assert landed["training, agreement held open"] >= 2
