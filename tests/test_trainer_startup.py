"""A trainer's start-up: what it imports, and its split on the receipt (startup.py).

A preempted run is back once its next attempt has trained a step, so the trainer imports only
what its loop needs, and its receipt says where the time to that first step went.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.trainer.startup import PARTS
from tests.trainer_support import REPO, Trainer, write_config

# Libraries a trainer on a checked snapshot never needs before its first step: the data checks
# (pandera, great-expectations), MLflow (the tracker imports it on a thread of its own), the
# ledger's and MLflow's database layers (a trainer without a ledger has none), Dagster.
HEAVY = (
    "alembic",
    "dagster",
    "great_expectations",
    "mlflow",
    "pandas",
    "pandera",
    "pyarrow",
    "sklearn",
    "sqlalchemy",
)
# Everything the trainer process imports up to its loop, and what the loop reads a snapshot
# and a checkpoint with.
LOOP_MODULES = (
    "pipeline.trainer.__main__",
    "pipeline.trainer.startup",
    "pipeline.trainer.train",
    "pipeline.trainer.data",
    "pipeline.checkpoint",
    "pipeline.data.columns",
    "pipeline.data.dataset",
    "pipeline.data.gate",
    "pipeline.data.snapshot",
    "pipeline.tracking",
)


def test_the_loop_modules_import_no_library_the_loop_does_not_need() -> None:
    probe = (
        "import importlib, json, sys\n"
        f"for name in {LOOP_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "top = {m.split('.')[0] for m in sys.modules}\n"
        f"print(json.dumps(sorted(top & set({HEAVY!r}))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


class _StopAtStep:
    """A reporter that asks the trainer to stop once it reports ``step`` (as SIGTERM would)."""

    def __init__(self, stop: Any, step: int) -> None:
        self.stop, self.at = stop, step

    def step(self, fields: dict[str, Any]) -> None:
        if fields["step"] >= self.at:
            self.stop.signal_name = "SIGTERM"

    def checkpoint_committed(self, fields: dict[str, Any]) -> None: ...

    def event(self, name: str, fields: dict[str, Any], level: str = "info") -> None: ...

    def close(self) -> None: ...


def test_a_resumed_attempt_puts_its_startup_split_on_the_receipt(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    from pipeline.explain import explain
    from pipeline.ledger import Ledger
    from pipeline.trainer import exit_codes, run_training
    from pipeline.trainer.stop import StopRequest

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    config = write_config(
        tmp_path / "config", snapshot_dir, max_steps=12, checkpoint_every_steps=100
    )
    # Attempt 1, in this process: preempted after step 6, which it commits.
    stop = StopRequest()
    code = run_training(
        config, run_id="r1", store=tmp_path / "store", ledger_url=url,
        reporter=_StopAtStep(stop, 6), stop=stop,
    )  # fmt: skip
    assert code == exit_codes.PREEMPTED
    # Attempt 2, a trainer process of its own: restores step 6 and trains to 12.
    resumed = Trainer(config, tmp_path / "store", "r1", "--ledger-url", url).wait()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ledger = Ledger(url)
    first, second = ledger.attempts("r1")
    assert second.restored_step == 6

    split = second.timings["startup"]
    assert set(split) == {*PARTS, "total"}
    assert all(value >= 0 for value in split.values())
    # What the process measured, from its own start: one after the other (one rank: nothing
    # runs beside the data's load), every part ended before the first step did.
    assert split["restore"] > 0 and split["data"] > 0 and split["first_step"] > 0
    assert sum(split[part] for part in PARTS) <= split["total"] + 0.01  # each rounded to 1 ms
    process = second.timings["trainer_process_seconds"]  # from run_training to the end
    assert split["total"] <= split["process_start"] + split["imports"] + process
    # In-process there is no main(): the split says only what run_training measured.
    assert {"process_start", "imports"}.isdisjoint(first.timings["startup"])
    assert "first_step" in first.timings["startup"]

    page = explain(ledger, "r1#2")
    line = next(line for line in page.splitlines() if line.startswith("- **Start-up**"))
    assert f"{split['total']:.1f}s to the first step's end" in line
    for words in ("process start", "imports", "ledger", "data", "restore", "first step", "rest"):
        assert words in line


def test_a_trainer_that_stops_before_its_first_step_has_no_total(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    from pipeline.trainer import exit_codes, run_training
    from pipeline.trainer.reporting import StdoutReporter

    # Nothing left to train: the final checkpoint is committed, the attempt restores it and
    # ends; its split has the restore but no first step, and no total.
    config = write_config(tmp_path / "config", snapshot_dir, max_steps=4)
    stdout = io.StringIO()
    for _ in range(2):
        code = run_training(
            config, run_id="r1", store=tmp_path / "store", reporter=StdoutReporter(stdout)
        )
        assert code == exit_codes.SUCCEEDED
    finished = [
        json.loads(line) for line in stdout.getvalue().splitlines() if "attempt_finished" in line
    ]
    split = finished[-1]["timings"]["startup"]
    assert "restore" in split and "data" in split
    assert "first_step" not in split and "total" not in split


# What a whole trainer run may load, not only its modules at import: reading the snapshot's
# parquet files needs pandas and pyarrow, nothing else here. A trainer that ran the data checks
# again, or opened a tracker it was not given, pays their import at every launch (seen
# 2026-11-27: great_expectations, 7.9 s of a digits trainer's start-up under load), and the
# drills launch hundreds of trainers.
NEVER_AT_RUNTIME = tuple(sorted({*HEAVY, "scipy"} - {"pandas", "pyarrow"}))
# torch's compiler: nothing in Tracks compiles, and importing TorchDynamo costs as much CPU as
# importing torch (torch.optim's own classes import it on first use: pipeline/trainer/optimizers).
NEVER_SUBMODULES = ("torch._dynamo", "torch._inductor")


def test_a_trainer_run_loads_no_library_its_steps_do_not_use(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "config", snapshot_dir, max_steps=2)
    probe = (
        "import atexit, json, runpy, sys\n"
        "atexit.register(lambda: print('LOADED ' + json.dumps(sorted("
        f"({{m.split('.')[0] for m in sys.modules}} & set({NEVER_AT_RUNTIME!r}))"
        f" | (set(sys.modules) & set({NEVER_SUBMODULES!r}))))))\n"
        "sys.argv = ['pipeline.trainer', *sys.argv[1:]]\n"
        "runpy.run_module('pipeline.trainer', run_name='__main__', alter_sys=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKS_", "DAGSTER_"))}
    done = subprocess.run(
        [sys.executable, "-c", probe, "--config", str(config), "--run-id", "r1",
         "--store", str(tmp_path / "store")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [loaded] = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert json.loads(loaded.removeprefix("LOADED ")) == [], done.stdout[-3000:]
