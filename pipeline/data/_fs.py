"""Durability helpers shared by landing and snapshot writers."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(directory: Path) -> None:
    # A rename is durable only once the directory that holds it is synced.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
