"""Content digests used everywhere a thing is named by what it holds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 4 * 1024 * 1024


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace: equal values give equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def sha256_json(value: Any) -> str:
    return sha256_bytes(canonical_json(value))
