"""SIGKILL and SIGTERM at seeded random moments; every resume, in a new process, is bit-exact.

The machinery is ``bench/kill_drill.py`` (its 500-kill run is a script, not a test). Trainer
processes are forked from a zygote that imported the trainer once, so a case costs a fraction
of a second instead of an interpreter start; each is still a new process whose only knowledge
of the run is the checkpoint directory. The uninterrupted reference run is a plain
``python -m pipeline.trainer``. Each case kills one process at its planned moment, then resumes
the run in another process to the end and compares: the loss at every step either process
trained, the final model.safetensors bytes, that every committed checkpoint still verifies,
and that the resume started from the newest committed checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.kill_drill import Drill, ForkServer, Reference, run_reference
from pipeline.checkpoint import verify_checkpoint
from pipeline.trainer import exit_codes
from tests.distributed_support import drill_config
from tests.trainer_support import sigkill_then_resume_is_bit_exact

MAX_STEPS = 60
INTERVAL = 2
KEEP_LAST_K = 2
GRACE_SECONDS = 30.0

# 20 SIGKILL cases: (kill moment, seed). "mid_file" and "before_commit" land inside a
# checkpoint write for sure; "random" ones often do (saves are async, every other step).
KILL_CASES = [
    *(("random", seed) for seed in range(10)),
    *(("mid_file", seed) for seed in range(4)),
    *(("before_commit", seed) for seed in range(4)),
    *(("startup", seed) for seed in range(2)),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kill-drill")


@pytest.fixture(scope="module")
def config(workdir: Path) -> Path:
    return drill_config(workdir, max_steps=MAX_STEPS, interval=INTERVAL, keep_last_k=KEEP_LAST_K)


@pytest.fixture(scope="module")
def reference(config: Path, workdir: Path) -> Reference:
    """The uninterrupted run, in a fresh ``python -m pipeline.trainer``."""
    return run_reference(config, workdir / "reference")


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


def _drill(server: ForkServer, config: Path, reference: Reference, store: Path, seed: int,
           modes: dict[str, float] | None = None) -> Drill:  # fmt: skip
    return Drill(
        server, config, store, reference, seed=seed, interval=INTERVAL,
        keep_last_k=KEEP_LAST_K, modes=modes,
    )  # fmt: skip


@pytest.mark.parametrize(("moment", "seed"), KILL_CASES, ids=[f"{m}-{s}" for m, s in KILL_CASES])
def test_sigkill_then_resume_in_a_new_process_is_bit_exact(
    server: ForkServer, config: Path, reference: Reference, tmp_path: Path, moment: str, seed: int
) -> None:
    sigkill_then_resume_is_bit_exact(
        server, config, reference, tmp_path / "store", moment=moment, seed=seed,
        interval=INTERVAL, keep_last_k=KEEP_LAST_K,
    )  # fmt: skip


def test_many_sigkills_across_one_run_lose_nothing_and_every_resume_is_bit_exact(
    server: ForkServer, config: Path, reference: Reference, tmp_path: Path
) -> None:
    drill = _drill(server, config, reference, tmp_path / "store", seed=1234)
    stats = drill.run(kills=12)
    assert stats.kills == 12 and stats.runs_finished >= 1
    assert stats.clean, stats.problems
    assert stats.checkpoints_verified > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigterm_at_a_random_step_commits_that_step_and_the_resume_loses_none(
    server: ForkServer, config: Path, reference: Reference, tmp_path: Path, seed: int
) -> None:
    store = tmp_path / "store"
    drill = _drill(server, config, reference, store, seed)
    target = random.Random(seed).randint(3, MAX_STEPS - 10)
    child = drill.spawn("term")
    deadline = time.monotonic() + 60
    while target not in child.losses():
        assert server.poll(child.pid) is None, child.err.read_text()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    signalled = time.monotonic()
    os.kill(child.pid, signal.SIGTERM)
    returncode = server.wait(child.pid, timeout=GRACE_SECONDS)
    took = time.monotonic() - signalled
    assert returncode == exit_codes.PREEMPTED, child.err.read_text()[-2000:]
    assert took < GRACE_SECONDS
    events = child.events()
    last_step = max(child.losses())  # every step is logged: the last one it completed
    committed = [e for e in events if e["event"] == "checkpoint_committed"]
    assert committed[-1]["step"] == last_step, "the preemption checkpoint lost steps"
    assert verify_checkpoint(committed[-1]["path"]).step == last_step
    finished = next(e for e in events if e["event"] == "attempt_finished")
    assert finished["reason"] == "preempted" and finished["step"] == last_step
    drill.check_process(child, "term", None)

    resumed = drill.spawn("term")
    assert server.wait(resumed.pid) == exit_codes.SUCCEEDED, resumed.err.read_text()[-2000:]
    assert resumed.started()["resumed_from"] == committed[-1]["path"]  # type: ignore[index]
    assert min(resumed.losses()) == last_step + 1
    drill.check_process(resumed, "term", Path(committed[-1]["path"]))
    drill.check_finished_run("term")
    assert drill.stats.clean, drill.stats.problems
