"""Errors the checkpoint protocol raises; each names the directory and the file involved."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """Base class for checkpoint errors."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes, manifest or probe outputs are not what was committed."""

    def __init__(self, directory: str | Path, file: str, detail: str) -> None:
        super().__init__(f"checkpoint {directory} is corrupt: {file}: {detail}")
        self.directory = str(directory)
        self.file = file
        self.detail = detail


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint directory holding a pickle: loading it could run arbitrary code."""

    def __init__(self, directory: str | Path, file: str, detail: str) -> None:
        super().__init__(
            f"checkpoint {directory} is refused: {file} {detail}; "
            "checkpoints hold safetensors and JSON only, never pickle"
        )
        self.directory = str(directory)
        self.file = file
        self.detail = detail


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that verifies but belongs to another config, snapshot or model."""

    def __init__(self, directory: str | Path, field: str, saved: object, current: object) -> None:
        super().__init__(
            f"checkpoint {directory} was saved with {field}={saved!r} but this attempt has "
            f"{field}={current!r}: a run has one config and one snapshot, refusing to resume"
        )
        self.directory = str(directory)
        self.field = field
        self.saved = saved
        self.current = current


class RestoreDivergedError(CheckpointError):
    """The live state was overwritten by a checkpoint that then failed its post-restore probe.

    Only possible when the same weights passed the probe outside the model just before (so no
    copy of the prior state was kept): the state is neither the checkpoint's nor the original,
    and the attempt must stop rather than train on it.
    """

    def __init__(self, directory: str | Path, detail: str) -> None:
        super().__init__(
            f"checkpoint {directory}: restored state failed its probe after the weights alone "
            f"passed it ({detail}); the live state is unusable, stopping this attempt"
        )
        self.directory = str(directory)
