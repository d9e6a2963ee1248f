"""Errors the checkpoint protocol raises; each names the directory and the file involved."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """Base class for checkpoint errors.

    Each subclass keeps its constructor's arguments in ``_args`` so that it survives pickling:
    torch.distributed.checkpoint gathers a rank's exception to every rank by pickle, and the
    default reduction would call the constructor with the message alone.
    """

    _args: tuple[object, ...] = ()

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), self._args


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes, manifest or probe outputs are not what was committed."""

    def __init__(self, directory: str | Path, file: str, detail: str) -> None:
        super().__init__(f"checkpoint {directory} is corrupt: {file}: {detail}")
        self._args = (directory, file, detail)
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
        self._args = (directory, file, detail)
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
        self._args = (directory, field, saved, current)
        self.directory = str(directory)
        self.field = field
        self.saved = saved
        self.current = current


class RestoreDivergedError(CheckpointError):
    """No candidate restored, and one failed after it had changed the live state.

    Checkpoints are read straight into the live tensors, so a candidate that fails its digest
    or its post-restore probe leaves them holding its bytes; an older candidate that restores
    overwrites them. When none does, the state is neither a checkpoint's nor the initial one:
    the caller must build its initial state again (the trainer does, from the seed) rather
    than train on it.
    """

    def __init__(self, directory: str | Path, detail: str) -> None:
        super().__init__(
            f"checkpoint {directory} failed after it was read into the live state ({detail}),"
            " and no older checkpoint restored: the live state is unusable until rebuilt"
        )
        self._args = (directory, detail)
        self.directory = str(directory)
