"""Test helper: re-sign a tampered checkpoint the way an attacker with write access would."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.checkpoint.layout import COMMITTED_FILE, MANIFEST_FILE
from pipeline.digests import FILE_DIGEST, file_digest, sha256_bytes


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
