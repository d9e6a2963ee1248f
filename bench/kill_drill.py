"""Kill drill: N random SIGKILLs across training runs; every resume must be bit-exact.

    .venv/bin/python bench/kill_drill.py --kills 500 --seed 0     # the documented run
    .venv/bin/python bench/kill_drill.py --kills 60 --seed 1      # a quick one
    python bench/kill_drill.py --kills 40 --device cuda            # on a GPU, where one is

One uninterrupted reference run (``python -m pipeline.trainer``, a fresh interpreter) gives the
loss at every step and the final model.safetensors. Then runs of the same config are trained
by processes started one after another: each run gets 10 SIGKILLs (``--per-run``) aimed at
sorted, uniformly random steps of the run, each next process resuming from what the killed
one left; a last process, not killed, finishes the run, which is then compared with the
reference. Runs follow each other until N kills are done.

Kill moments, chosen by the seeded RNG for each process:

- ``random``: once the target step is trained (at once, if the resume is already past it),
  plus up to 15 ms; saves are async and frequent, so many of these land while the
  background writer is writing, or while the training thread stages;
- ``startup``: within 0.15 s of the fork (loading data, verifying and restoring a checkpoint);
- ``mid_file``: halfway through writing optimizer.safetensors of the first checkpoint at or
  after the target (``TRACKS_FAULT_SLEEP_DURING_WRITE``), the final synchronous one included;
- ``before_commit``: the same, after MANIFEST.json and before COMMITTED
  (``TRACKS_FAULT_SLEEP_BEFORE_COMMIT``).

Checked after every kill and every process:

- corrupt resumes: a process that found a committed checkpoint failing verification or the
  probe, or that resumed from anything but the newest committed checkpoint, or that failed;
- lost committed checkpoints: a checkpoint seen committed that is gone or no longer verifies,
  unless retention superseded it (``keep_last_k`` newer committed checkpoints exist);
- non-bit-exact resumes: a process that logged a loss differing from the reference at that
  step, and a finished run whose final model.safetensors differs from the reference's.

Importing torch costs ~2-3 s per interpreter, so trainer processes are forked from a "zygote"
that imported the trainer once and never trained: each is still a new process (new pid, no
memory shared with the process it replaces) running ``pipeline.trainer``'s ``main``, and all
it knows comes from the checkpoint directory. The test suite runs the same code with a few
kills (tests/test_kill_drill.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline import envvars  # noqa: E402
from pipeline.checkpoint import (  # noqa: E402
    CorruptCheckpointError,
    checkpoint_dirs,
    is_committed,
    parse_checkpoint_dir_name,
    verify_checkpoint,
)
from pipeline.trainer.attempt import next_standalone_attempt_no  # noqa: E402

DRILL_CONFIG: dict[str, Any] = {
    "seed": 0,
    "max_steps": 120,
    "checkpoint_every_steps": 2,
    "batch_size": 32,
    "learning_rate": 0.01,
    "optimizer": "adam",
    "lr_schedule": {"kind": "cosine"},
    "model": {"channels": 4, "hidden": 16, "dropout": 0.1},  # dropout: RNG must resume too
    "keep_last_k": 2,
    "keep_best_k": 0,
    "log_every_steps": 1,
    "async_save": True,
    "device": "cpu",
}
# text-lm in the drill (--family text-lm): one block of width 32 over 32-byte contexts, a few
# milliseconds a step, dropout on (its RNG must resume too); batch_size splits over two ranks.
TEXT_DRILL: dict[str, Any] = {
    "model_family": "text-lm",
    "batch_size": 16,
    "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "dropout": 0.1},
}
FAMILIES = ("digits-cnn", "text-lm")
MODES = {"random": 0.6, "startup": 0.1, "mid_file": 0.15, "before_commit": 0.15}
HOOK_SECONDS = 20.0  # the hooked process waits this long for its SIGKILL
MODEL_FILE = "model.safetensors"

_ZYGOTE = r"""
import json, os, sys, traceback
import pipeline.trainer.train  # torch and numpy, imported once for every fork
import pipeline.data.dataset, pipeline.data.snapshot  # pandas and pyarrow
from pipeline.trainer.__main__ import main

reply = sys.stdout
for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "spawn":
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sys.stdin.close()
                for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(target, fd)
                    os.close(target)
                os.environ.update(request["env"])
                code = main(request["argv"])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        answer = {"pid": pid}
    else:
        done, status = os.waitpid(request["pid"], 0 if request["op"] == "wait" else os.WNOHANG)
        answer = {"returncode": os.waitstatus_to_exitcode(status) if done else None}
    reply.write(json.dumps(answer) + "\n")
    reply.flush()
"""


class ForkServer:
    """Forks trainer processes from an interpreter that imported the trainer once."""

    def __init__(self) -> None:
        # A CUDA check through the runtime would initialize the driver in the zygote, and a
        # forked child could then not use CUDA at all; NVML's check leaves it untouched.
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self._process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit {self._process.poll()})")
        return json.loads(line)

    def spawn(self, argv: list[str], log: Path, err: Path, env: dict[str, str]) -> int:
        """Fork ``python -m pipeline.trainer ARGV``; stdout to ``log``, stderr to ``err``."""
        answer = self._ask(
            {"op": "spawn", "argv": argv, "stdout": str(log), "stderr": str(err), "env": env}
        )
        return int(answer["pid"])

    def poll(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["returncode"]

    def wait(self, pid: int, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll(pid)) is None:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                return self._ask({"op": "wait", "pid": pid})["returncode"]
            time.sleep(0.01)
        return code

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            self._process.wait(timeout=30)


def parse_events(text: str) -> list[dict[str, Any]]:
    """The JSON lines a trainer wrote so far (a half-written last line is left out)."""
    events = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


@dataclass
class Child:
    """One trainer process of the drill and what it wrote."""

    pid: int
    log: Path
    err: Path
    spawned_at: float
    returncode: int | None = None

    def events(self) -> list[dict[str, Any]]:
        return parse_events(self.log.read_text()) if self.log.exists() else []

    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.events() if e["event"] == "step"}

    def started(self) -> dict[str, Any] | None:
        return next((e for e in self.events() if e["event"] == "attempt_started"), None)


@dataclass
class Reference:
    """The uninterrupted run: loss at every step, final model bytes, time spent training."""

    losses: dict[int, float]
    final_model: bytes
    train_seconds: float
    max_steps: int


@dataclass
class DrillStats:
    kills: int = 0
    processes: int = 0
    runs_finished: int = 0
    kill_moments: Counter = field(default_factory=Counter)  # plan mode
    landed: Counter = field(default_factory=Counter)  # where the kill actually landed
    corrupt_resumes: int = 0
    lost_committed: int = 0
    non_bit_exact_resumes: int = 0
    non_bit_exact_runs: int = 0
    checkpoints_verified: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (
            self.corrupt_resumes
            or self.lost_committed
            or self.non_bit_exact_resumes
            or self.non_bit_exact_runs
        )


def write_config(directory: Path, snapshot_dir: Path, **overrides: Any) -> Path:
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "drill.yaml"
    config = {**DRILL_CONFIG, "snapshot_dir": str(snapshot_dir), **overrides}
    path.write_text(yaml.safe_dump(config))
    return path


def make_snapshot(root: Path) -> Path:
    """A digits snapshot under ``root``, its blocking checks passed and recorded (as the
    data_snapshot asset leaves it); its path.

    Checked here, once: a trainer handed an unchecked snapshot checks it itself, so every rank
    of a drill's first attempt would import great-expectations and run the suites.
    """
    from pipeline.data.gate import ensure_checks_passed
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    write_digits_landing(root / "landing")
    snapshot = create_snapshot(root / "landing", root / "snapshots")
    ensure_checks_passed(snapshot, snapshot_root=snapshot.path.parent)
    return snapshot.path


def make_text_snapshot(
    root: Path, *, train_documents: int | None = 24, eval_documents: int | None = 4
) -> Path:
    """A text-lm snapshot of the corpus's first documents of each split under ``root``, its
    blocking checks passed and recorded (as the data_snapshot asset leaves it); its path.
    Both counts None: the whole corpus, landed as ``tracks landing text`` lands it.

    Few documents: evaluating every checkpoint then takes milliseconds, not a second.
    """
    from pipeline.data.gate import ensure_checks_passed
    from pipeline.data.snapshot import create_snapshot
    from pipeline.textlm.corpus import build_documents
    from pipeline.textlm.landing import write_text_landing

    chosen = None
    if train_documents is not None or eval_documents is not None:
        documents, _ = build_documents()
        chosen = [d for d in documents if d.split == "train"][:train_documents]
        chosen += [d for d in documents if d.split == "eval"][:eval_documents]
    write_text_landing(root / "landing", documents=chosen)
    snapshot = create_snapshot(root / "landing", root / "snapshots", family="text-lm")
    ensure_checks_passed(snapshot, snapshot_root=snapshot.path.parent)
    return snapshot.path


def run_reference(config: Path, store: Path, run_id: str = "reference") -> Reference:
    """``python -m pipeline.trainer`` uninterrupted, in a fresh interpreter."""
    import yaml

    store.mkdir(parents=True, exist_ok=True)
    log, err = store / f"{run_id}.log", store / f"{run_id}.err"
    # stderr to a file: a pipe nobody reads while polling can fill and stall the trainer.
    with open(log, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
             "--run-id", run_id, "--store", str(store)],
            cwd=REPO, stdout=stdout, stderr=stderr, text=True,
        )  # fmt: skip
        started = None
        while process.poll() is None:
            if started is None and '"attempt_started"' in log.read_text():
                started = time.monotonic()
            time.sleep(0.005)
    finished = time.monotonic()
    if process.returncode != 0:
        said = "\n".join([*log.read_text().splitlines()[-5:], *err.read_text().splitlines()[-20:]])
        raise RuntimeError(f"reference run failed (exit {process.returncode}):\n{said}")
    max_steps = int(yaml.safe_load(config.read_text())["max_steps"])
    losses = {e["step"]: e["loss"] for e in parse_events(log.read_text()) if e["event"] == "step"}
    (final,) = (store / run_id).glob(f"step-{max_steps:010d}-a*")
    return Reference(
        losses=losses,
        final_model=(final / MODEL_FILE).read_bytes(),
        train_seconds=finished - (started or finished),
        max_steps=max_steps,
    )


class Drill:
    """Kills trainer processes at seeded random moments and checks every resume."""

    def __init__(
        self,
        server: ForkServer,
        config: Path,
        store: Path,
        reference: Reference,
        *,
        seed: int,
        interval: int,
        keep_last_k: int,
        modes: dict[str, float] | None = None,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.server = server
        self.config = config
        self.store = store
        self.reference = reference
        self.rng = random.Random(seed)
        self.interval = interval
        self.keep_last_k = keep_last_k
        self.modes = modes or MODES
        self.log = log
        self.stats = DrillStats()
        self._seen_committed: dict[str, set[Path]] = {}

    # -- one process -----------------------------------------------------------------------

    def spawn(self, run_id: str, env: dict[str, str] | None = None) -> Child:
        logs = self.store / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        name = f"{run_id}-{self.stats.processes:04d}"
        child = Child(
            pid=0, log=logs / f"{name}.log", err=logs / f"{name}.err", spawned_at=time.monotonic()
        )
        argv = ["--config", str(self.config), "--run-id", run_id, "--store", str(self.store)]
        child.pid = self.server.spawn(argv, child.log, child.err, env or {})
        self.stats.processes += 1
        return child

    def plan(
        self, run_id: str, target: int | None = None
    ) -> tuple[str, dict[str, str], int | None]:
        """A kill mode, the fault-hook environment it needs, and the step it aims at.

        ``target`` (a step of the run) places the kill; without one, a step is drawn from
        what is left of the run (but its last four steps, so the kill comes before the end).
        """
        mode = self.rng.choices(list(self.modes), weights=list(self.modes.values()))[0]
        newest = self.newest_step(run_id)
        if target is None:
            target = self.rng.randint(newest, max(newest, self.reference.max_steps - 4))
        if mode not in ("mid_file", "before_commit"):
            return mode, {}, target
        # The first checkpoint this process writes at or after the target (the final one last).
        steps = range(max(newest + 1, target), self.reference.max_steps + 1)
        candidates = [s for s in steps if s % self.interval == 0 or s == self.reference.max_steps]
        if not candidates:
            return "random", {}, target
        step = candidates[0]
        hook = (
            envvars.TRACKS_FAULT_SLEEP_DURING_WRITE
            if mode == "mid_file"
            else envvars.TRACKS_FAULT_SLEEP_BEFORE_COMMIT
        )
        return mode, {hook.name: f"{HOOK_SECONDS}@{step}"}, step

    def newest_step(self, run_id: str) -> int:
        committed = checkpoint_dirs(self.store / run_id)
        return parse_checkpoint_dir_name(committed[0].name)[0] if committed else 0  # type: ignore[index]

    def kill_once(self, run_id: str, target: int | None = None) -> bool:
        """Start a process on ``run_id``, SIGKILL it per plan, check; True if the run finished."""
        run_dir = self.store / run_id
        newest_before = checkpoint_dirs(run_dir)[:1]
        mode, env, step = self.plan(run_id, target)
        attempt_no = next_standalone_attempt_no(run_dir)  # the number the child will take
        child = self.spawn(run_id, env)
        started = self._wait_for_moment(child, mode, run_dir, step, attempt_no)
        if child.returncode is None:
            os.kill(child.pid, signal.SIGKILL)
            child.returncode = self.server.wait(child.pid)
        finished = child.returncode == 0
        if child.returncode == -signal.SIGKILL:
            self.stats.kills += 1
            self.stats.kill_moments[mode] += 1
            self.stats.landed[self._where(child, run_dir, started)] += 1
        elif not finished:
            self._problem(
                f"{child.log.name}: exited {child.returncode}: {child.err.read_text()[-800:]}",
                "corrupt_resumes",
            )
        self.check_process(child, run_id, newest_before[0] if newest_before else None)
        self.check_committed(run_id)
        if finished:
            self.check_finished_run(run_id)
        return finished

    def _wait_for_moment(
        self, child: Child, mode: str, run_dir: Path, step: int | None, attempt_no: int
    ) -> bool:
        """Sleep until the planned moment (or the child's exit); True if training had begun."""
        deadline = time.monotonic() + 60 + HOOK_SECONDS
        if mode == "startup":
            until = child.spawned_at + self.rng.uniform(0.0, 0.15)
            while time.monotonic() < until and self._alive(child):
                time.sleep(0.002)
            return child.started() is not None
        if mode in ("mid_file", "before_commit"):
            marker = "optimizer.safetensors" if mode == "mid_file" else "MANIFEST.json"
            pattern = f"step-{step:010d}-a{attempt_no:02d}/{marker}"
            while self._alive(child) and time.monotonic() < deadline:
                if any(p.stat().st_size > 0 for p in run_dir.glob(pattern)):
                    time.sleep(self.rng.uniform(0.0, 0.02))
                    break
                time.sleep(0.002)
            return True
        # "random": once the target step is trained (at once if the resume is past it), plus
        # up to 15 ms: into the next step, a staging or a background write.
        while self._alive(child) and time.monotonic() < deadline:
            events = child.events()
            begun = next((e for e in events if e["event"] == "attempt_started"), None)
            trained = [e["step"] for e in events if e["event"] == "step"]
            target = step or 0
            if (begun and begun["step"] >= target) or (trained and trained[-1] >= target):
                time.sleep(self.rng.uniform(0.0, 0.015))
                break
            time.sleep(0.002)
        return True

    def _alive(self, child: Child) -> bool:
        if child.returncode is None:
            child.returncode = self.server.poll(child.pid)
        return child.returncode is None

    def _where(self, child: Child, run_dir: Path, started: bool) -> str:
        if not started or child.started() is None:
            return "start-up or resume"
        attempt_no = child.started()["attempt_no"]  # type: ignore[index]
        for directory in checkpoint_dirs(run_dir, committed_only=False):
            key = parse_checkpoint_dir_name(directory.name)
            if key and key[1] == attempt_no and not is_committed(directory):
                return "checkpoint write"
        return "training step"

    # -- checks ----------------------------------------------------------------------------

    def _problem(self, text: str, counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self.stats.problems.append(text)
        self.log(f"PROBLEM ({counter}): {text}")

    def check_process(self, child: Child, run_id: str, newest_before: Path | None) -> None:
        events = child.events()
        for event in events:
            if event["event"] == "checkpoint_corrupt":
                self._problem(f"{child.log.name}: {event['detail']}", "corrupt_resumes")
        started = child.started()
        if started is not None:
            expected = str(newest_before.resolve()) if newest_before else None
            if started["resumed_from"] != expected:
                self._problem(
                    f"{child.log.name}: resumed from {started['resumed_from']}, "
                    f"the newest committed checkpoint was {expected}",
                    "corrupt_resumes",
                )
        losses = child.losses()
        wrong = [s for s, loss in losses.items() if loss != self.reference.losses.get(s)]
        if wrong:
            self._problem(
                f"{child.log.name}: losses differ from the reference at steps {wrong[:5]}",
                "non_bit_exact_resumes",
            )
        if started is not None and losses and min(losses) != started["step"] + 1:
            self._problem(
                f"{child.log.name}: resumed at step {started['step']} but trained "
                f"step {min(losses)} first",
                "non_bit_exact_resumes",
            )
        for event in events:
            if event["event"] == "checkpoint_committed":
                self._seen_committed.setdefault(run_id, set()).add(Path(event["path"]))

    def check_committed(self, run_id: str) -> None:
        """Every committed checkpoint verifies; none seen committed went missing."""
        run_dir = self.store / run_id
        committed = checkpoint_dirs(run_dir)
        seen = self._seen_committed.setdefault(run_id, set())
        for directory in committed:
            try:
                verify_checkpoint(directory)
                self.stats.checkpoints_verified += 1
            except CorruptCheckpointError as exc:
                self._problem(f"committed checkpoint fails verification: {exc}", "lost_committed")
            seen.add(directory.resolve())
        present = {d.resolve() for d in committed}
        for directory in sorted(seen - present):
            step = parse_checkpoint_dir_name(directory.name)[0]  # type: ignore[index]
            newer = [d for d in committed if parse_checkpoint_dir_name(d.name)[0] > step]  # type: ignore[index]
            if len(newer) < self.keep_last_k:
                self._problem(
                    f"{directory} was committed and is gone, with only {len(newer)} "
                    f"newer committed checkpoints (keep_last_k={self.keep_last_k})",
                    "lost_committed",
                )
            seen.discard(directory)  # superseded by retention (or reported once)

    def check_finished_run(self, run_id: str) -> None:
        self.stats.runs_finished += 1
        final = sorted((self.store / run_id).glob(f"step-{self.reference.max_steps:010d}-a*"))
        finals = [d for d in final if is_committed(d)]
        if len(finals) != 1 or (finals[0] / MODEL_FILE).read_bytes() != self.reference.final_model:
            self._problem(
                f"run {run_id}: final model.safetensors differs from the reference",
                "non_bit_exact_runs",
            )
        logged: set[int] = set()
        for log in (self.store / "logs").glob(f"{run_id}-*.log"):
            logged |= set(Child(0, log, log, 0.0).losses())
        missing = set(range(1, self.reference.max_steps + 1)) - logged
        if missing:
            self._problem(
                f"run {run_id}: steps {sorted(missing)[:5]} were never trained",
                "non_bit_exact_runs",
            )

    def finish(self, run_id: str) -> int:
        """Resume ``run_id`` in a new process, let it finish, and check it; its exit code."""
        newest = checkpoint_dirs(self.store / run_id)[:1]
        child = self.spawn(run_id)
        child.returncode = self.server.wait(child.pid)
        self.check_process(child, run_id, newest[0] if newest else None)
        self.check_committed(run_id)
        if child.returncode == 0:
            self.check_finished_run(run_id)
        else:
            self._problem(
                f"{child.log.name}: exited {child.returncode}: {child.err.read_text()[-800:]}",
                "corrupt_resumes",
            )
        return child.returncode

    # -- the drill -------------------------------------------------------------------------

    def run(self, kills: int, *, per_run: int = 10) -> DrillStats:
        """``kills`` SIGKILLs, ``per_run`` to a run at sorted uniformly random steps; each run
        is then finished by a process nobody kills, and compared with the reference."""
        started = time.monotonic()
        run_no = 0
        while self.stats.kills < kills:
            run_id = f"drill-{run_no:04d}"
            count = min(per_run, kills - self.stats.kills)
            targets = sorted(self.rng.randint(1, self.reference.max_steps) for _ in range(count))
            finished = False
            for target in targets:
                if self.stats.processes > 3 * kills + 20:
                    self._problem("too many processes ended unkilled", "corrupt_resumes")
                    return self.stats
                if finished := self.kill_once(run_id, target):
                    break
            if not finished:
                self.finish(run_id)
            run_no += 1
            if run_no % 5 == 0:
                self.log(
                    f"{self.stats.kills} kills, {self.stats.runs_finished} runs finished, "
                    f"{len(self.stats.problems)} problems, {time.monotonic() - started:.0f}s"
                )
        self.stats.seconds = time.monotonic() - started
        return self.stats


def summary_table(stats: DrillStats, *, seed: int, config: dict[str, Any]) -> str:
    rows = [
        ("SIGKILLs delivered", stats.kills, ""),
        ("trainer processes", stats.processes, ""),
        ("runs finished and compared", stats.runs_finished, ""),
        ("committed checkpoints verified", stats.checkpoints_verified, "after every kill"),
        ("corrupt resumes", stats.corrupt_resumes, "must be 0"),
        ("lost committed checkpoints", stats.lost_committed, "must be 0"),
        ("non-bit-exact resumes", stats.non_bit_exact_resumes, "must be 0"),
        ("non-bit-exact finished runs", stats.non_bit_exact_runs, "must be 0"),
        ("wall time", f"{stats.seconds:.0f} s", ""),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [
        f"kill drill: seed {seed}, {config.get('model_family', 'digits-cnn')} on "
        f"{config['device']}, "
        f"max_steps {config['max_steps']}, checkpoint every "
        f"{config['checkpoint_every_steps']} steps, async_save {config['async_save']}, "
        f"keep_last_k {config['keep_last_k']}",
        "",
    ]
    lines += [f"{name:<{width}}  {value!s:>8}  {note}".rstrip() for name, value, note in rows]
    lines += [
        "",
        "kill moments planned: " + _counts(stats.kill_moments),
        "kills landed during:  " + _counts(stats.landed),
        "",
        "RESULT: " + ("PASS" if stats.clean else "FAIL"),
    ]
    return "\n".join(lines)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(counter.items())) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=500, help="SIGKILLs to deliver (500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-run", type=int, default=10, help="SIGKILLs per run (10)")
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: a temp dir)")
    parser.add_argument("--max-steps", type=int, default=DRILL_CONFIG["max_steps"])
    parser.add_argument(
        "--checkpoint-every", type=int, default=DRILL_CONFIG["checkpoint_every_steps"]
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=DRILL_CONFIG["device"],
        help="train on this device (cuda: resumes bit-exact on the same GPU)",
    )
    parser.add_argument(
        "--family", choices=FAMILIES, default="digits-cnn", help="the model family to train"
    )
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tracks-kill-drill-"))
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = {
        "max_steps": args.max_steps,
        "checkpoint_every_steps": args.checkpoint_every,
        "device": args.device,
        **(TEXT_DRILL if args.family == "text-lm" else {}),
    }
    config_values = {**DRILL_CONFIG, **overrides}
    print(
        f"kill drill in {workdir}: {args.kills} kills, seed {args.seed}, {args.family}", flush=True
    )
    data = workdir / "data"
    snapshot = make_text_snapshot(data) if args.family == "text-lm" else make_snapshot(data)
    config = write_config(workdir, snapshot, **overrides)
    reference = run_reference(config, workdir / "reference")
    print(
        f"reference: {reference.max_steps} steps, {reference.train_seconds:.2f} s of training",
        flush=True,
    )
    server = ForkServer()
    try:
        drill = Drill(
            server,
            config,
            workdir / "store",
            reference,
            seed=args.seed,
            interval=args.checkpoint_every,
            keep_last_k=DRILL_CONFIG["keep_last_k"],
            log=lambda line: print(line, flush=True),
        )
        stats = drill.run(args.kills, per_run=args.per_run)
    finally:
        server.close()
    print()
    print(summary_table(stats, seed=args.seed, config=config_values))
    for problem in stats.problems[:20]:
        print("  -", problem)
    if args.workdir is None and stats.clean:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if stats.clean else 1


if __name__ == "__main__":
    sys.exit(main())
