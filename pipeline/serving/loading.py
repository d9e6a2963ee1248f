"""Committed checkpoints as models, without pickle: safetensors for tensors, JSON for the rest."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pipeline.checkpoint import CheckpointInfo

WEIGHTS_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
PIXEL_COLUMNS = [f"px_{i:02d}" for i in range(64)]  # snapshot columns, integers 0..16
PIXEL_MAX = 16.0  # the model sees pixels / 16


class UnreadableCheckpointError(Exception):
    """A verified checkpoint whose trainer state does not say how to build its model."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"checkpoint {path} {problem}")
        self.path = str(path)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A checkpoint that verified: where it is and what its ``COMMITTED`` marker says."""

    path: str
    manifest_sha256: str
    run_id: str
    attempt_no: int
    step: int
    # The model family its verified trainer state names; None when only the files were verified
    # (open_committed_checkpoint reads no trainer state).
    family: str | None = None

    @classmethod
    def from_info(cls, info: CheckpointInfo) -> CommittedCheckpoint:
        return cls(
            path=os.path.abspath(info.path),
            manifest_sha256=info.manifest_sha256,
            run_id=info.run_id,
            attempt_no=info.attempt_no,
            step=info.step,
        )

    @property
    def weights_path(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE

    @property
    def trainer_state_path(self) -> Path:
        return Path(self.path) / TRAINER_STATE_FILE


def open_committed_checkpoint(checkpoint_dir: str | Path) -> CommittedCheckpoint:
    """Verify a checkpoint (``pipeline.checkpoint.verify_checkpoint``) and describe it.

    Raises ``CorruptCheckpointError`` or ``UnsafeCheckpointError`` from the checkpoint protocol.
    """
    from pipeline.checkpoint import verify_checkpoint

    return CommittedCheckpoint.from_info(verify_checkpoint(checkpoint_dir))


def load_committed_checkpoint(checkpoint_dir: str | Path) -> tuple[CommittedCheckpoint, nn.Module]:
    """Verify a checkpoint and build its model from the verified bytes, in eval mode."""
    from pipeline.checkpoint import load_checkpoint

    contents = load_checkpoint(checkpoint_dir)
    checkpoint = CommittedCheckpoint.from_info(contents.info)
    family = checkpoint_family(contents.trainer_state, checkpoint.path)
    model = model_from_state(contents.trainer_state, contents.model, checkpoint.path)
    return dataclasses.replace(checkpoint, family=family), model


def load_model_from_files(weights_path: str | Path, trainer_state_path: str | Path) -> nn.Module:
    """Build the model from a ``model.safetensors`` and ``trainer_state.json`` pair (serving)."""
    from safetensors.torch import load_file

    trainer_state = json.loads(Path(trainer_state_path).read_text())
    where = Path(trainer_state_path).parent
    return model_from_state(trainer_state, load_file(str(weights_path)), where)


def checkpoint_family(trainer_state: dict[str, Any], where: str | Path) -> str:
    """The model family a checkpoint's trainer state names (``config.model_family``); a state
    written before families existed holds a digits model."""
    from pipeline.data.families import DEFAULT_FAMILY, FAMILIES

    config = trainer_state.get("config") if isinstance(trainer_state, dict) else None
    if not isinstance(config, dict):
        raise UnreadableCheckpointError(where, f"has no config in {TRAINER_STATE_FILE}")
    name = config.get("model_family", DEFAULT_FAMILY)
    if name not in FAMILIES:
        raise UnreadableCheckpointError(
            where,
            f"names model family {name!r} in {TRAINER_STATE_FILE}; known: {', '.join(FAMILIES)}",
        )
    return str(name)


def model_from_state(
    trainer_state: dict[str, Any], weights: dict[str, torch.Tensor], where: str | Path
) -> nn.Module:
    """The family's ``build_model(trainer_state["config"]["model"])`` with ``weights`` loaded
    strictly (the family from ``config.model_family``, see :func:`checkpoint_family`)."""
    from pipeline.trainer.families import family

    name = checkpoint_family(trainer_state, where)
    try:
        model_config = trainer_state["config"]["model"]
    except (KeyError, TypeError) as exc:
        raise UnreadableCheckpointError(
            where, f"has no config.model in {TRAINER_STATE_FILE}"
        ) from exc
    try:
        model = family(name).build_model(model_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableCheckpointError(
            where, f"config.model in {TRAINER_STATE_FILE} builds no {name} model: {exc}"
        ) from exc
    model.load_state_dict(weights, strict=True)
    model.eval()
    return model
