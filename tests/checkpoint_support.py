"""Test helpers: re-sign a tampered checkpoint the way an attacker with write access would, and
a small run (data, state, ledger, a one-rank world) to write checkpoints from."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import CheckpointConfig, CheckpointManager, TrainingState
from pipeline.checkpoint.layout import COMMITTED_FILE, MANIFEST_FILE
from pipeline.digests import FILE_DIGEST, file_digest, sha256_bytes
from pipeline.distributed.world import Groups, World
from pipeline.ledger import AttemptStart, Ledger
from pipeline.trainer.data import EpochSampler, TrainingData
from pipeline.trainer.model import build_model
from pipeline.trainer.train import train_step


def resign(
    directory: Path, *names: str, edit: Callable[[dict[str, Any]], None] | None = None
) -> None:
    """Make changed files look legitimately committed: each named file's size and digest are
    written into MANIFEST.json (``edit`` may change more), and COMMITTED names the new
    manifest's sha256. Only what the checkpoint's bytes say can then catch the change."""
    manifest = json.loads((directory / MANIFEST_FILE).read_bytes())
    for entry in manifest["files"]:
        if entry["name"] in names:
            path = directory / entry["name"]
            entry.update(
                size=path.stat().st_size,
                algorithm=FILE_DIGEST.value,
                digest=file_digest(path, FILE_DIGEST),
            )
    if edit is not None:
        edit(manifest)
    raw = json.dumps(manifest, sort_keys=True, indent=1).encode()
    (directory / MANIFEST_FILE).write_bytes(raw)
    committed = json.loads((directory / COMMITTED_FILE).read_bytes())
    committed["manifest_sha256"] = sha256_bytes(raw)
    (directory / COMMITTED_FILE).write_text(json.dumps(committed))


def recommit_in_ledger(ledger: Ledger, directory: Path, fencing_token: int) -> None:
    """Make the ledger's committed row for ``directory`` name its manifest as it is now, as if
    the writer itself had committed these bytes (a bad probe written honestly, say): the
    ledger then vouches for it, and only the checks past the manifest can refuse it."""
    record = ledger.get_checkpoint(str(directory))
    ledger.commit_checkpoint(
        run_id=record.run_id,
        attempt_no=record.attempt_no,
        path=record.path,
        manifest_sha256=sha256_bytes((directory / MANIFEST_FILE).read_bytes()),
        size_bytes=record.bytes or 0,
        metrics=record.metrics,
        fencing_token=fencing_token,
    )


# -- a small run to checkpoint (shared by tests that must not import another test module) --------

RUN_ID = "run-ckpt"
MODEL_CONFIG = {"channels": 4, "hidden": 16, "dropout": 0.1}


def training_data(n: int = 96) -> TrainingData:
    """Random 8x8 'digits', the same every call."""
    generator = torch.Generator().manual_seed(1234)
    images = torch.rand(n, 1, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (n,), generator=generator)
    return TrainingData(
        "snap-test", "f" * 64, images, labels, images[:24], labels[:24], family="digits-cnn"
    )


def training_state(data: TrainingData, *, seed: int = 0, optimizer: str = "adam") -> TrainingState:
    """A small CNN with ``optimizer`` ("adam", or SGD with momentum) and a cosine schedule,
    initialised from ``seed``."""
    torch.manual_seed(seed)
    model = build_model(MODEL_CONFIG)
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return TrainingState(
        model=model,
        optimizer=opt,
        data_cursor=EpochSampler(data.num_train_examples, 16, seed=7),
        config={"model": MODEL_CONFIG, "optimizer": optimizer},
        config_sha256="c" * 64,
        probe_inputs=data.eval_inputs[:8],
        lr_scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50),
        data_manifest_sha256=data.manifest_sha256,
        snapshot_id=data.snapshot_id,
    )


def train_to(state: TrainingState, data: TrainingData, step: int) -> None:
    """Train ``state`` on ``data`` until it reaches ``step``."""
    while state.step < step:
        train_step(state, data)
        state.step += 1


def train_steps(state: TrainingState, data: TrainingData, count: int) -> list[float]:
    """Train ``state`` ``count`` more steps; the loss of each."""
    losses = []
    for _ in range(count):
        losses.append(train_step(state, data))
        state.step += 1
    return losses


def checkpoint_manager(
    tmp_path: Path,
    *,
    ledger: Ledger | None = None,
    attempt: int = 1,
    token: int | None = None,
    **config: object,
) -> CheckpointManager:
    """A manager for run ``RUN_ID`` under ``tmp_path/store``, bound to ``attempt``: saves every
    10 steps, keeps the last 10 (``config`` overrides either, or sets more)."""
    manager = CheckpointManager(
        tmp_path / "store" / RUN_ID,
        CheckpointConfig(**{"interval_steps": 10, "keep_last_k": 10, **config}),  # type: ignore[arg-type]
        run_id=RUN_ID,
        ledger=ledger,
    )
    manager.bind_attempt(attempt, token)
    return manager


def save_at(manager: CheckpointManager, state: TrainingState, data: TrainingData,
            steps: list[int], metrics: dict[int, float] | None = None) -> list[Path]:  # fmt: skip
    """Train to each of ``steps`` in turn and save there (eval_loss from ``metrics``, else 1.0);
    the checkpoints' paths."""
    paths = []
    for target in steps:
        train_steps(state, data, target - state.step)
        loss = (metrics or {}).get(target, 1.0)
        paths.append(manager.save(state, metrics={"eval_loss": loss}).path)
    return paths


def ledger_with_run(path: Path, run_id: str) -> Ledger:
    """A SQLite ledger at ``path`` holding run ``run_id`` (config "c" * 64)."""
    ledger = Ledger.open(f"sqlite:///{path}")
    ledger.create_run(
        run_id=run_id, model_family="digits-cnn", owner="test", purpose="baseline",
        config_sha256="c" * 64, snapshot_id="snap-test",
    )  # fmt: skip
    return ledger


def begin_attempt(ledger: Ledger, run_id: str = RUN_ID) -> tuple[int, int]:
    """Begin the next attempt of ``run_id``: its number and fencing token."""
    record = ledger.begin_attempt(
        run_id,
        AttemptStart(config_snapshot={}, config_sha256="c" * 64,
                     data_manifest_sha256="f" * 64, container_digest="test"),
    )  # fmt: skip
    return record.attempt_no, record.fencing_token


@dataclass(frozen=True)
class LedgerRun:
    """A SQLite ledger holding run ``RUN_ID``, and the attempt begun on it."""

    ledger: Ledger
    attempt_no: int
    token: int


def ledger_run(tmp_path: Path) -> LedgerRun:
    """Run ``RUN_ID`` in a ledger at ``tmp_path/ledger.db``, with its first attempt begun."""
    ledger = ledger_with_run(tmp_path / "ledger.db", RUN_ID)
    return LedgerRun(ledger, *begin_attempt(ledger, RUN_ID))


@contextmanager
def gloo_world_of_one() -> Iterator[Groups]:
    """This process as a one-rank gloo world: what a sharded checkpoint manager talks on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        groups = Groups(World(), torch.device("cpu"))
        try:
            yield groups
        finally:
            groups.close()
