"""Names on disk and the durable-write primitives the protocol is built from."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
PROBE_FILE = "probe.safetensors"
MANIFEST_FILE = "MANIFEST.json"
COMMITTED_FILE = "COMMITTED"
FORMAT = "tracks-checkpoint/1"

_DIR_RE = re.compile(r"^step-(?P<step>\d{10})-a(?P<attempt>\d{2,})$")


def checkpoint_dir_name(step: int, attempt_no: int) -> str:
    """``step-0000001200-a03``: sorts by step, and two attempts never share a directory."""
    return f"step-{step:010d}-a{attempt_no:02d}"


def parse_checkpoint_dir_name(name: str) -> tuple[int, int] | None:
    """``(step, attempt_no)`` for a checkpoint directory name, else None."""
    match = _DIR_RE.match(name)
    if match is None:
        return None
    return int(match["step"]), int(match["attempt"])


def fsync_dir(directory: Path) -> None:
    # Makes a rename or a new file in the directory durable, not just the file's bytes.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory is fsynced by the caller)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def replace_atomically(path: Path, data: bytes) -> None:
    """Temp file, fsync, ``os.replace``, fsync the directory: readers see all of it or none."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
