"""Launching the trainer as ranks under torchrun (``python -m pipeline.distributed.launch``),
finding its rank processes, and reading what each rank said on its way out; the drills' config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.kill_drill import TEXT_DRILL, make_snapshot, make_text_snapshot
from bench.kill_drill import write_config as write_drill_config

REPO = Path(__file__).resolve().parents[1]


def drill_config(
    workdir: Path, *, max_steps: int, interval: int, keep_last_k: int, family: str = "digits-cnn"
) -> Path:
    """A snapshot of ``family``'s data under ``workdir/data`` and the kill drill's trainer
    config on it in ``workdir/config``, checkpointing every ``interval`` steps; the config's
    path. text-lm: the kill drill's tiny model and batch (``TEXT_DRILL``)."""
    overrides: dict[str, Any] = {}
    if family == "text-lm":
        snapshot = make_text_snapshot(workdir / "data")
        overrides = TEXT_DRILL
    else:
        snapshot = make_snapshot(workdir / "data")
    return write_drill_config(
        workdir / "config",
        snapshot,
        max_steps=max_steps,
        checkpoint_every_steps=interval,
        keep_last_k=keep_last_k,
        **overrides,
    )


@dataclass(frozen=True)
class LaunchedRanks:
    """A launcher process, the log it writes to and the directory its ranks report in."""

    process: subprocess.Popen
    log: Path
    log_dir: Path

    def outcomes(self) -> dict[int, dict[str, Any]]:
        """Each rank's own outcome file (``outcome-<rank>.json``), by rank."""
        found = {}
        for path in sorted((self.log_dir / "outcomes").glob("outcome-*.json")):
            payload = json.loads(path.read_text())
            found[int(payload["rank"])] = payload
        return found


def launch_ranks(
    config: Path,
    store: Path,
    run_id: str,
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> LaunchedRanks:
    """Start ``nproc`` ranks training ``run_id`` under ``store``, in a session of their own."""
    log_dir = store / "launch-logs" / f"{run_id}-{time.monotonic_ns()}"
    command = [
        sys.executable, "-m", "pipeline.distributed.launch", "--nproc-per-node", str(nproc),
        "--log-dir", str(log_dir), "--",
        "--config", str(config), "--run-id", run_id, "--store", str(store),
    ]  # fmt: skip
    log = log or store / f"{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return LaunchedRanks(process=process, log=log, log_dir=log_dir)


def _children(pid: int) -> list[int]:
    """The live children of process ``pid`` (every thread's ``children`` file in /proc)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # gone
        return found
    for task in tasks:
        try:
            found.extend(int(child) for child in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def trainer_rank_pids(launcher_pid: int) -> dict[int, int]:
    """The trainer ranks a launcher started, by RANK (read from each process's environment).

    Only the launcher's children are read (torchrun's agent starts the ranks itself): the
    drills poll this every few milliseconds, and reading every process on the machine cost a
    share of a core while hundreds of them were alive.
    """
    ranks: dict[int, int] = {}
    for pid in _children(launcher_pid):
        try:
            if b"pipeline.trainer" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                continue
            environ = dict(
                item.split(b"=", 1)
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if b"=" in item
            )
        except OSError:  # gone, or not ours to read
            continue
        if environ.get(b"TRACKS_LAUNCHER_PID") == str(launcher_pid).encode() and b"RANK" in environ:
            ranks[int(environ[b"RANK"])] = pid
    return ranks


def catches_signal(pid: int, signum: int = signal.SIGTERM) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (``SigCgt`` in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def wait_for_ranks_catching_sigterm(
    launched: LaunchedRanks, nproc: int = 2, timeout: float = 120.0
) -> dict[int, int]:
    """Rank pids, once every rank has its SIGTERM handler installed (a signal is a stop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = trainer_rank_pids(launched.process.pid)
        if len(ranks) == nproc and all(catches_signal(pid) for pid in ranks.values()):
            return ranks
        if launched.process.poll() is not None:
            raise AssertionError(f"the launcher exited {launched.process.returncode} early")
        time.sleep(0.01)
    raise AssertionError(f"{nproc} ranks catching SIGTERM never appeared under the launcher")


def log_events(log: Path) -> list[dict[str, Any]]:
    """The JSON events rank 0 wrote to the launcher's log (torchrun's own lines left out)."""
    found = []
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines(keepends=True):
        if not (line.startswith("{") and line.endswith("\n")):
            continue  # the agent's log lines, or a line still being written
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found
