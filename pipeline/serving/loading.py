"""Read a committed checkpoint without pickle: safetensors for tensors, JSON for the rest."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

WEIGHTS_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
COMMITTED_FILE = "COMMITTED"


class UnreadableCheckpointError(Exception):
    """A checkpoint directory that is not committed, or lacks the files serving needs."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"checkpoint {path} {problem}")
        self.path = str(path)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """What the ``COMMITTED`` marker of a verified checkpoint says about it."""

    path: str
    manifest_sha256: str
    run_id: str | None
    attempt_no: int | None
    step: int | None

    @property
    def weights_path(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE

    @property
    def trainer_state_path(self) -> Path:
        return Path(self.path) / TRAINER_STATE_FILE


def open_committed_checkpoint(checkpoint_dir: str | Path) -> CommittedCheckpoint:
    """Verify a checkpoint directory and read its ``COMMITTED`` marker.

    Verification (manifest sizes and digests) is ``pipeline.checkpoint.verify_checkpoint``'s job
    and raises its ``CorruptCheckpointError``; this function adds the checks serving needs.
    """
    path = os.path.abspath(checkpoint_dir)
    verify = _checkpoint_verifier()
    if verify is not None:
        verify(path)
    marker_path = Path(path) / COMMITTED_FILE
    if not marker_path.is_file():
        raise UnreadableCheckpointError(path, f"has no {COMMITTED_FILE} marker: it is not committed")
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError) as exc:
        raise UnreadableCheckpointError(path, f"has an unreadable {COMMITTED_FILE}: {exc}") from exc
    if not marker.get("manifest_sha256"):
        raise UnreadableCheckpointError(path, f"has no manifest_sha256 in {COMMITTED_FILE}")
    for name in (WEIGHTS_FILE, TRAINER_STATE_FILE):
        if not (Path(path) / name).is_file():
            raise UnreadableCheckpointError(path, f"has no {name}")
    return CommittedCheckpoint(
        path=path,
        manifest_sha256=str(marker["manifest_sha256"]),
        run_id=marker.get("run_id"),
        attempt_no=None if marker.get("attempt_no") is None else int(marker["attempt_no"]),
        step=None if marker.get("step") is None else int(marker["step"]),
    )


def _checkpoint_verifier() -> Any:
    try:
        from pipeline.checkpoint import verify_checkpoint
    except ModuleNotFoundError as exc:
        if exc.name not in ("pipeline.checkpoint",):
            raise
        return None
    return verify_checkpoint


def load_model_from_files(weights_path: str | Path, trainer_state_path: str | Path) -> nn.Module:
    """Build the model from ``trainer_state.json["config"]["model"]`` and load its weights."""
    from safetensors.torch import load_file

    from pipeline.trainer.model import build_model

    state = json.loads(Path(trainer_state_path).read_text())
    try:
        model_config = state["config"]["model"]
    except (KeyError, TypeError) as exc:
        raise UnreadableCheckpointError(
            Path(trainer_state_path).parent, f"has no config.model in {TRAINER_STATE_FILE}"
        ) from exc
    model = build_model(model_config)
    model.load_state_dict(load_file(str(weights_path)), strict=True)
    model.eval()
    return model


def load_checkpoint_model(checkpoint: CommittedCheckpoint) -> nn.Module:
    """The model stored in a committed checkpoint, in eval mode."""
    return load_model_from_files(checkpoint.weights_path, checkpoint.trainer_state_path)
