"""Test helpers for the trainer: its config, ``python -m pipeline.trainer`` as a process whose
JSON events we poll, and a small checkpoint trained in-process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.kill_drill import TEXT_DRILL

REPO = Path(__file__).resolve().parent.parent
MAX_STEPS = 60
CONFIG: dict[str, Any] = {
    "seed": 0,
    "max_steps": MAX_STEPS,
    "checkpoint_every_steps": 10,
    "batch_size": 32,
    "learning_rate": 0.01,
    "optimizer": "adam",
    "lr_schedule": {"kind": "cosine"},
    "model": {"channels": 8, "hidden": 32, "dropout": 0.1},  # dropout: the RNG must resume too
    "keep_last_k": 3,
    "keep_best_k": 1,
    "log_every_steps": 1,
}


@dataclass
class Finished:
    """A trainer process that ended: its exit code, the events it wrote, its stderr."""

    returncode: int
    events: list[dict[str, Any]]
    stderr: str

    def losses(self) -> dict[int, float]:
        """The loss of every step it logged, by step."""
        return {e["step"]: e["loss"] for e in self.events if e["event"] == "step"}

    def committed(self) -> list[dict[str, Any]]:
        """Its ``checkpoint_committed`` events, in order."""
        return [e for e in self.events if e["event"] == "checkpoint_committed"]


class Trainer:
    """One ``python -m pipeline.trainer`` process whose stdout goes to a file we can poll."""

    def __init__(self, config: Path, store: Path, run_id: str, *args: str,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.log = store.parent / f"{run_id}-{time.monotonic_ns()}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "pipeline.trainer",
            "--config", str(config), "--run-id", run_id, "--store", str(store), *args,
        ]  # fmt: skip
        self._stdout = open(self.log, "w")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=self._stdout,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def events(self) -> list[dict[str, Any]]:
        """The events written so far (a line still being written is left out)."""
        return parse_events(self.log.read_text())

    def wait_until(self, condition: Callable[[], bool], timeout: float = 60.0) -> None:
        """Poll until ``condition`` holds; fails if the trainer exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                raise AssertionError(f"trainer exited {self.process.returncode} first: "
                                     f"{self.process.stderr.read()[-3000:]}")  # type: ignore[union-attr]  # fmt: skip
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError("timed out waiting for the trainer")
            time.sleep(0.02)

    def wait_for_step(self, step: int) -> None:
        """Wait until the trainer has logged ``step``."""
        self.wait_until(lambda: step in {e["step"] for e in self.events() if e["event"] == "step"})

    def wait(self, timeout: float = 120.0) -> Finished:
        """Wait for the process to end; what it did."""
        _, stderr = self.process.communicate(timeout=timeout)
        self._stdout.close()
        return Finished(self.process.returncode, self.events(), stderr)


def parse_events(text: str) -> list[dict[str, Any]]:
    """The JSON events in a trainer's stdout, up to the first line not yet finished."""
    events = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # still being written
        events.append(json.loads(line))
    return events


def write_config(directory: Path, snapshot_dir: Path, **overrides: Any) -> Path:
    """``CONFIG`` on ``snapshot_dir`` (``overrides`` replace or add keys) as
    ``directory/train.yaml``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "train.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "snapshot_dir": str(snapshot_dir), **overrides}))
    return path


def small_checkpoint(root: Path) -> Path:
    """Train 20 steps of a tiny model without Dagster or a ledger; the final checkpoint's path."""
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot
    from pipeline.trainer.config import TrainConfig
    from pipeline.trainer.reporting import StdoutReporter
    from pipeline.trainer.train import run_training

    write_digits_landing(root / "landing")
    snapshot = create_snapshot(root / "landing", root / "snapshots")
    config = TrainConfig.from_dict(
        {
            "seed": 0,
            "max_steps": 20,
            "checkpoint_every_steps": 10,
            "batch_size": 32,
            "learning_rate": 0.003,
            "optimizer": "adam",
            "lr_schedule": {"kind": "cosine"},
            "model": {"channels": 4, "hidden": 16},
            "snapshot_dir": str(snapshot.path),
        }
    )
    code = run_training(
        config, run_id="r1", store=root / "store", reporter=StdoutReporter(io.StringIO())
    )
    assert code == 0
    return root / "store" / "r1" / "step-0000000020-a01"


def train_in_process(
    config: Path, store: Path, run_id: str, *, ledger_url: str | None = None
) -> Finished:
    """``run_training`` in this process, its events captured as a trainer process's stdout.

    No interpreter start-up (seconds per run on a busy machine): for drills whose subject is
    the loop, not the process. Drill hooks are read from ``os.environ`` (monkeypatch them).
    """
    from pipeline.trainer.reporting import StdoutReporter
    from pipeline.trainer.train import run_training

    out = io.StringIO()
    code = run_training(
        config, run_id=run_id, store=store, ledger_url=ledger_url, reporter=StdoutReporter(out)
    )
    return Finished(code, parse_events(out.getvalue()), "")


# -- text-lm ----------------------------------------------------------------------------------

# A tiny text-lm run: the kill drill's text-lm model and batch (bench/kill_drill.py).
TEXT_CONFIG: dict[str, Any] = {**CONFIG, **TEXT_DRILL, "learning_rate": 0.003}


def sigkill_then_resume_is_bit_exact(
    server: Any, config: Path, reference: Any, store: Path, *, moment: str, seed: int,
    interval: int, keep_last_k: int,
) -> None:  # fmt: skip
    """One kill-drill case (bench/kill_drill.py) for any family's config: one SIGKILL at
    ``moment``, then a new process finishes the run; every resume and the final weights are
    bit-exact against ``reference`` and no checkpoint is left half-written."""
    from bench.kill_drill import Drill
    from pipeline.trainer import exit_codes

    drill = Drill(
        server, config, store, reference, seed=seed, interval=interval,
        keep_last_k=keep_last_k, modes={moment: 1.0},
    )  # fmt: skip
    finished = drill.kill_once("case")
    assert not finished and drill.stats.kills == 1, "the process ended before its SIGKILL"
    assert drill.finish("case") == exit_codes.SUCCEEDED
    stats = drill.stats
    assert stats.runs_finished == 1 and stats.processes == 2
    assert stats.clean, stats.problems
    if moment in ("mid_file", "before_commit"):
        assert stats.landed == {"checkpoint write": 1}
