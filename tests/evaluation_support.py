"""Shared pieces of the evaluation and promotion tests (no tests here).

A real digits snapshot, a DigitsCNN trained in-process, checkpoints written in the committed
layout by hand (so these tests do not depend on the trainer), and one MLflow store on SQLite
per test session (its migrations take seconds; every test uses its own ledger and model name).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from pipeline.checkpoint.layout import (
    COMMITTED_FILE,
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    TRAINER_STATE_FILE,
    checkpoint_dir_name,
)
from pipeline.data import create_snapshot, read_snapshot_frame, write_digits_landing
from pipeline.data.dataset import split_tensors
from pipeline.data.snapshot import Snapshot
from pipeline.digests import sha256_bytes
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from pipeline.trainer.model import build_model

MODEL_CONFIG = {"channels": 8, "hidden": 32, "dropout": 0.0}


@dataclass(frozen=True)
class World:
    """What every evaluation/promotion test shares: settings, a snapshot, trained weights."""

    settings: TracksSettings
    snapshot: Snapshot
    good_state: dict[str, torch.Tensor]  # trained: passes the default quality gate
    untrained_state: dict[str, torch.Tensor]


@functools.cache
def shared_world(base: Path) -> World:
    """Built once per session under ``base`` (the session's temp root)."""
    home = base / "tracks"
    settings = TracksSettings(
        home=home,
        ledger_url=f"sqlite:///{home / 'unused-ledger.db'}",
        mlflow_tracking_uri=f"sqlite:///{home / 'mlflow.db'}",
        mlflow_artifact_root=home / "mlartifacts",
        landing_root=home / "landing",
        snapshot_root=home / "snapshots",
        checkpoint_root=home / "checkpoints",
        work_root=home / "work",
    )
    settings.ensure_dirs()
    write_digits_landing(settings.landing_root)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    torch.manual_seed(0)
    untrained = build_model(MODEL_CONFIG)
    untrained_state = {k: v.clone() for k, v in untrained.state_dict().items()}
    good = train(read_snapshot_frame(snapshot), steps=400, seed=0)
    return World(
        settings=settings,
        snapshot=snapshot,
        good_state={k: v.clone() for k, v in good.state_dict().items()},
        untrained_state=untrained_state,
    )


def train(frame, *, steps: int, seed: int) -> torch.nn.Module:
    """A few hundred Adam steps on the train split: ~97% held-out accuracy, about a second."""
    images, labels = split_tensors(frame, "train")
    torch.manual_seed(seed)
    model = build_model(MODEL_CONFIG)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread
    try:
        model.train()
        for _ in range(steps):
            batch = torch.randint(0, len(labels), (64,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model


def without_class(state: dict[str, torch.Tensor], label: int) -> dict[str, torch.Tensor]:
    """The same weights, except the model never predicts ``label``: one slice collapses."""
    spoiled = copy.deepcopy(state)
    bias_key = [k for k in spoiled if k.endswith(".bias")][-1]  # the output layer's bias
    spoiled[bias_key][label] -= 1000.0
    return spoiled


def write_checkpoint(
    root: Path,
    state: dict[str, torch.Tensor],
    *,
    run_id: str,
    attempt_no: int = 1,
    step: int = 400,
    config: dict | None = None,
) -> Path:
    """A committed checkpoint in the protocol's layout: files, MANIFEST.json, COMMITTED last.

    ``config`` is the trainer state's config (default: a digits model, ``MODEL_CONFIG``)."""
    directory = root / run_id / checkpoint_dir_name(step, attempt_no)
    directory.mkdir(parents=True)
    config = config if config is not None else {"model": MODEL_CONFIG}
    trainer_state = {"step": step, "config": config, "config_sha256": "test"}
    files = {
        MODEL_FILE: safetensors_bytes({k: v.contiguous() for k, v in state.items()}),
        OPTIMIZER_FILE: safetensors_bytes({"step": torch.tensor([step])}),
        TRAINER_STATE_FILE: json.dumps(trainer_state, sort_keys=True).encode(),
        PROBE_FILE: safetensors_bytes({"logits": torch.zeros(1, 10)}, metadata={"device": "cpu"}),
    }
    entries = []
    for name, data in files.items():
        (directory / name).write_bytes(data)
        entries.append({"name": name, "size": len(data), "sha256": sha256_bytes(data)})
    manifest = {
        "format": FORMAT,
        "run_id": run_id,
        "attempt_no": attempt_no,
        "step": step,
        "metrics": {},
        "files": entries,
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    (directory / MANIFEST_FILE).write_bytes(manifest_bytes)
    committed = {
        "manifest_sha256": sha256_bytes(manifest_bytes),
        "run_id": run_id,
        "attempt_no": attempt_no,
        "step": step,
        "fencing_token": attempt_no,
    }
    (directory / COMMITTED_FILE).write_text(json.dumps(committed, sort_keys=True))
    return directory


def manifest_sha256(checkpoint_dir: Path) -> str:
    return json.loads((checkpoint_dir / COMMITTED_FILE).read_text())["manifest_sha256"]


def open_ledger(path: Path, snapshot_id: str, *run_ids: str, family: str = "digits-cnn") -> Ledger:
    """A fresh SQLite ledger holding the training runs (of ``family``) the evaluations point at."""
    ledger = Ledger.open(f"sqlite:///{path}")
    for run_id in run_ids:
        ledger.create_run(
            run_id=run_id,
            model_family=family,
            owner="tests",
            purpose="baseline",
            config_sha256="0" * 64,
            snapshot_id=snapshot_id,
        )
    return ledger


def record_committed(ledger: Ledger, checkpoint_dir: Path, snapshot_id: str) -> None:
    """What training leaves in the ledger for a committed checkpoint (promotion requires it)."""
    import sqlalchemy as sa

    from pipeline.ledger import UnknownRunError
    from pipeline.ledger import schema as ledger_schema
    from pipeline.ledger.ledger import utcnow

    t = ledger_schema.checkpoints

    committed = json.loads((checkpoint_dir / COMMITTED_FILE).read_text())
    try:
        ledger.get_run(committed["run_id"])
    except UnknownRunError:
        ledger.create_run(
            run_id=committed["run_id"], model_family="digits-cnn", owner="tests",
            purpose="baseline", config_sha256="0" * 64, snapshot_id=snapshot_id,
        )  # fmt: skip
    with ledger.engine.begin() as conn:
        if conn.execute(sa.select(t.c.path).where(t.c.path == str(checkpoint_dir))).first():
            return
        conn.execute(
            sa.insert(t).values(
                path=str(checkpoint_dir), run_id=committed["run_id"],
                attempt_no=committed["attempt_no"], step=committed["step"],
                manifest_sha256=committed["manifest_sha256"], state="committed",
                created_at=utcnow(), committed_at=utcnow(), fencing_token=1,
            )
        )  # fmt: skip


# -- text-lm ----------------------------------------------------------------------------------

TEXT_MODEL_CONFIG = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 64}


def text_config() -> dict:
    """The trainer-state config of a tiny text-lm checkpoint."""
    return {"model_family": "text-lm", "model": dict(TEXT_MODEL_CONFIG)}


@dataclass(frozen=True)
class TextWorld:
    """A text snapshot of the shipped corpus and a tiny TextLM trained on it (two strengths)."""

    snapshot: Snapshot
    trained_state: dict[str, torch.Tensor]  # a few dozen steps: far better than uniform
    weaker_state: dict[str, torch.Tensor]  # fewer steps: worse per document


@functools.cache
def text_world(base: Path) -> TextWorld:
    """Built once per session under ``base`` (the shared world's settings' landing and
    snapshot roots)."""
    from pipeline.textlm.landing import read_text_snapshot_frame, write_text_landing

    settings = shared_world(base).settings
    landing = settings.landing_root / "text-lm"
    write_text_landing(landing)
    snapshot = create_snapshot(landing, settings.snapshot_root, family="text-lm")
    frame = read_text_snapshot_frame(snapshot)
    return TextWorld(
        snapshot=snapshot,
        trained_state=train_text(frame, steps=60, seed=0),
        weaker_state=train_text(frame, steps=15, seed=0),
    )


def train_text(frame, *, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps of the tiny TextLM on the train split's windows; its weights."""
    from pipeline.textlm.data import training_windows
    from pipeline.textlm.model import build_model as build_text_model

    windows = training_windows(frame, block_size=TEXT_MODEL_CONFIG["block_size"])
    torch.manual_seed(seed)
    model = build_text_model(dict(TEXT_MODEL_CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(steps):
            batch = windows[torch.randint(0, len(windows), (32,), generator=generator)]
            loss = model.loss(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
