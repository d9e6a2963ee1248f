"""Content digests used everywhere a thing is named by what it holds."""

from __future__ import annotations

import hashlib
import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import blake3

_CHUNK = 4 * 1024 * 1024


class DigestAlgorithm(StrEnum):
    """How a checkpoint file's digest was computed; the manifest names it beside the digest."""

    SHA256 = "sha256"  # checkpoints written before BLAKE3 (read, never written any more)
    BLAKE3 = "blake3"  # a tree hash: several cores can hash one file, faster than the disk


# What new checkpoint manifests record. SHA-256 stays for everything else that is named by
# content (snapshots, configs, manifests): small, and their ids must not change.
FILE_DIGEST = DigestAlgorithm.BLAKE3


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def new_hasher(algorithm: DigestAlgorithm, *, threads: int = 1) -> Hasher:
    """A streaming hasher; both release the GIL on large updates, so threads overlap.

    ``threads`` > 1 lets BLAKE3 hash one large update on several cores (SHA-256 cannot).
    """
    if algorithm is DigestAlgorithm.BLAKE3:
        return blake3.blake3(max_threads=max(1, threads))
    return hashlib.sha256()


def file_digest(path: str | Path, algorithm: DigestAlgorithm) -> str:
    digest = new_hasher(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    return file_digest(path, DigestAlgorithm.SHA256)


def short_digest(value: Any) -> str:
    """A recorded digest as people read it: ``sha256:`` and its first 16 hex digits (enough to
    tell two apart, and to find the full one); "—" for none."""
    text = str(value or "—")
    return text[:SHORT_DIGEST_CHARS]


# "sha256:" and 16 hex digits.
SHORT_DIGEST_CHARS = 23


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace: equal values give equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def sha256_json(value: Any) -> str:
    return sha256_bytes(canonical_json(value))


def recorded_digest(entry: dict[str, Any]) -> tuple[DigestAlgorithm, str]:
    """The (algorithm, hex digest) a manifest entry records for a file.

    Entries name their algorithm (``{"algorithm": "blake3", "digest": ...}``); entries written
    before that carry only ``"sha256"``. Raises ValueError for anything else.
    """
    if "digest" in entry or "algorithm" in entry:
        try:
            algorithm = DigestAlgorithm(entry.get("algorithm"))
        except ValueError:
            raise ValueError(f"unknown digest algorithm {entry.get('algorithm')!r}") from None
        digest = entry.get("digest")
    else:
        algorithm, digest = DigestAlgorithm.SHA256, entry.get("sha256")
    if not (isinstance(digest, str) and len(digest) == 64 and _is_hex(digest)):
        raise ValueError(f"no valid {algorithm} digest (got {digest!r})")
    return algorithm, digest


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
