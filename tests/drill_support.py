"""Live drills on a killed trainer: launch a run, wait for its commit, and the reference weights.

Shared by the preemption drill (the resume sensor continues the run) and the in-place
continuation (the Dagster run that saw the trainer die continues it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from pipeline.checkpoint import is_committed
from pipeline.checkpoint.layout import MODEL_FILE
from pipeline.digests import sha256_json
from pipeline.ledger import AttemptRecord, Ledger
from tests.dagster_dev import REPO_ROOT, DagsterDev, launch_graph, trainer_pids, wait_for

# Slow enough to kill mid-run: the trainer pauses after step 250 (a test hook), by which time
# step 200 is committed. A stop signal ends the pause at once.
PAUSE = {"TRACKS_FAULT_SLEEP_AFTER_STEP": "8@250"}
TRAINING = {"max_steps": 400, "checkpoint_every_steps": 100, "keep_last_k": 5}


def drill_ledger(home: Path) -> Ledger:
    return Ledger.open(f"sqlite:///{home / 'ledger.db'}")


def start_and_wait_for_commit(server: DagsterDev, home: Path, snapshot: str, config: dict) -> str:
    """Launch a run and return its training run id once step 200 is committed: in the ledger
    and on disk. The ledger's commit comes first (it checks the fencing token); a kill between
    the two leaves a directory without COMMITTED, which the next attempt marks corrupt."""
    dagster_run = launch_graph(
        server, snapshot, {**config, "train": {**TRAINING, **config.get("train", {})}}
    )
    ledger = drill_ledger(home)

    def committed_run() -> str | None:
        for attempt in ledger.list_attempts(limit=20):
            if attempt.dagster_run_id == dagster_run:
                latest = ledger.latest_committed_checkpoint(attempt.run_id)
                if (
                    latest is not None
                    and latest.step >= 200
                    and is_committed(Path(latest.path))
                    and trainer_pids(attempt.run_id)
                ):
                    return attempt.run_id
        return None

    return wait_for(committed_run, 180, "a committed checkpoint at step 200")


# The reference weights by the digest of the config that trained them: the trainer is
# deterministic, so the drills that train one config (killed in different ways) share one run.
_REFERENCES: dict[str, bytes] = {}


def uninterrupted_final_weights(attempt: AttemptRecord, tmp_path: Path) -> bytes:
    """The final model.safetensors of ``attempt``'s config trained by one uninterrupted
    trainer process (a fresh interpreter, no fault hooks)."""
    key = sha256_json(attempt.config_snapshot)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_uninterrupted(attempt, tmp_path)
    return _REFERENCES[key]


def _train_uninterrupted(attempt: AttemptRecord, tmp_path: Path) -> bytes:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(attempt.config_snapshot))
    store = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
         "--run-id", "reference", "--store", str(store)],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("TRACKS_FAULT")},
    )  # fmt: skip
    [final] = sorted((store / "reference").glob("step-0000000400-*"))
    return (final / MODEL_FILE).read_bytes()
