"""Committed checkpoints as models, without pickle: safetensors for tensors, JSON for the rest."""

from __future__ import annotations

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
    return checkpoint, model_from_state(contents.trainer_state, contents.model, checkpoint.path)


def load_model_from_files(weights_path: str | Path, trainer_state_path: str | Path) -> nn.Module:
    """Build the model from a ``model.safetensors`` and ``trainer_state.json`` pair (serving)."""
    from safetensors.torch import load_file

    trainer_state = json.loads(Path(trainer_state_path).read_text())
    where = Path(trainer_state_path).parent
    return model_from_state(trainer_state, load_file(str(weights_path)), where)


def model_from_state(
    trainer_state: dict[str, Any], weights: dict[str, torch.Tensor], where: str | Path
) -> nn.Module:
    """``build_model(trainer_state["config"]["model"])`` with ``weights`` loaded strictly."""
    from pipeline.trainer.model import build_model

    try:
        model_config = trainer_state["config"]["model"]
    except (KeyError, TypeError) as exc:
        raise UnreadableCheckpointError(
            where, f"has no config.model in {TRAINER_STATE_FILE}"
        ) from exc
    model = build_model(model_config)
    model.load_state_dict(weights, strict=True)
    model.eval()
    return model
