"""Reading checkpoints: refuse pickle, verify bytes against the manifest, then load.

Loading uses safetensors and json only; verification runs first, so a reader never
deserializes a byte that COMMITTED and MANIFEST.json do not vouch for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from pipeline.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from pipeline.checkpoint.layout import (
    COMMITTED_FILE,
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    TRAINER_STATE_FILE,
    parse_checkpoint_dir_name,
)
from pipeline.digests import sha256_bytes, sha256_file

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")
_PICKLE_PROTOCOLS = (2, 3, 4, 5)
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint that verified: what COMMITTED and MANIFEST.json say about it."""

    path: Path
    run_id: str
    attempt_no: int
    step: int
    manifest_sha256: str
    fencing_token: int | None
    committed_at: str
    size_bytes: int
    metrics: dict[str, float] = field(default_factory=dict)
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointContents:
    """Everything read from a verified checkpoint, as tensors and JSON."""

    info: CheckpointInfo
    model: dict[str, torch.Tensor]
    training_tensors: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    probe: dict[str, torch.Tensor]
    probe_device: str


def is_committed(directory: Path) -> bool:
    return (directory / COMMITTED_FILE).is_file()


def checkpoint_dirs(run_dir: Path, *, committed_only: bool = True) -> list[Path]:
    """Checkpoint directories of a run, newest first (step, then attempt).

    Directories without COMMITTED are not checkpoints and are left out unless asked for.
    """
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        key = parse_checkpoint_dir_name(child.name)
        if key is None or not child.is_dir():
            continue
        if committed_only and not is_committed(child):
            continue
        found.append((key, child))
    return [path for _, path in sorted(found, reverse=True)]


def refuse_pickle(directory: Path) -> None:
    """Raise :class:`UnsafeCheckpointError` if any file in ``directory`` is or wraps a pickle."""
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        name = str(path.relative_to(directory))
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise UnsafeCheckpointError(directory, name, f"has a pickle suffix ({path.suffix})")
        with open(path, "rb") as handle:
            head = handle.read(9)
        # A safetensors file starts with its header length (u64, little-endian), whose low
        # bytes can look like pickle magic (a 640-byte header is 80 02 …): a well-formed
        # safetensors header is not a pickle, whatever its first two bytes.
        if _looks_like_safetensors(head, path.stat().st_size):
            continue
        if len(head) >= 2 and head[0] == 0x80 and head[1] in _PICKLE_PROTOCOLS:
            raise UnsafeCheckpointError(
                directory, name, f"starts with pickle protocol {head[1]} magic bytes"
            )
        if head[:4] == _ZIP_MAGIC:
            raise UnsafeCheckpointError(
                directory, name, "is a zip archive (torch.save wraps pickle)"
            )


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    header_len = int.from_bytes(head[:8], "little")
    return 2 <= header_len <= size - 8 and head[8:9] == b"{"


def _read_json(directory: Path, name: str) -> tuple[dict[str, Any], bytes]:
    path = directory / name
    if not path.is_file():
        raise CorruptCheckpointError(directory, name, "missing")
    raw = path.read_bytes()
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(directory, name, f"is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CorruptCheckpointError(directory, name, "is not a JSON object")
    return value, raw


def verify_checkpoint(directory: str | Path) -> CheckpointInfo:
    """Check COMMITTED → MANIFEST.json → every file's size and sha256, and nothing extra.

    Raises :class:`CorruptCheckpointError` naming the directory, the file and what differs,
    or :class:`UnsafeCheckpointError` when a pickle is present.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CorruptCheckpointError(directory, ".", "directory does not exist")
    refuse_pickle(directory)
    committed, _ = _read_json(directory, COMMITTED_FILE)
    manifest, manifest_raw = _read_json(directory, MANIFEST_FILE)
    for key in ("manifest_sha256", "run_id", "attempt_no", "step"):
        if key not in committed:
            raise CorruptCheckpointError(directory, COMMITTED_FILE, f"has no {key!r}")
    actual = sha256_bytes(manifest_raw)
    if committed["manifest_sha256"] != actual:
        raise CorruptCheckpointError(
            directory,
            MANIFEST_FILE,
            f"sha256 is {actual} but COMMITTED points at {committed['manifest_sha256']}",
        )
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(
            directory, MANIFEST_FILE, f"format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    for key in ("run_id", "attempt_no", "step"):
        if manifest.get(key) != committed[key]:
            raise CorruptCheckpointError(
                directory,
                COMMITTED_FILE,
                f"{key}={committed[key]!r} but MANIFEST.json says {manifest.get(key)!r}",
            )
    named = parse_checkpoint_dir_name(directory.name)
    if named is not None and named != (committed["step"], committed["attempt_no"]):
        raise CorruptCheckpointError(
            directory,
            COMMITTED_FILE,
            f"says step {committed['step']} of attempt {committed['attempt_no']}, "
            f"but the directory is named for step {named[0]} of attempt {named[1]}",
        )
    listed: dict[str, dict[str, Any]] = {}
    entries = manifest.get("files")
    if not isinstance(entries, list):
        raise CorruptCheckpointError(directory, MANIFEST_FILE, "'files' is not a list")
    for entry in entries:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
        ):
            raise CorruptCheckpointError(directory, MANIFEST_FILE, f"malformed entry {entry!r}")
        listed[entry["name"]] = entry
    for required in (MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, PROBE_FILE):
        if required not in listed:
            raise CorruptCheckpointError(directory, MANIFEST_FILE, f"does not list {required}")
    size_bytes = len(manifest_raw)
    for name, entry in listed.items():
        path = directory / name
        if Path(name).name != name:
            raise CorruptCheckpointError(directory, name, "is not a plain file name")
        if not path.is_file():
            raise CorruptCheckpointError(directory, name, "listed in MANIFEST.json but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CorruptCheckpointError(
                directory, name, f"size is {size} bytes, MANIFEST.json says {entry['size']}"
            )
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise CorruptCheckpointError(
                directory, name, f"sha256 is {digest}, MANIFEST.json says {entry['sha256']}"
            )
        size_bytes += size
    expected = set(listed) | {MANIFEST_FILE, COMMITTED_FILE}
    for path in sorted(directory.iterdir()):
        if path.name not in expected:
            raise CorruptCheckpointError(directory, path.name, "is not listed in MANIFEST.json")
    return CheckpointInfo(
        path=directory,
        run_id=committed["run_id"],
        attempt_no=int(committed["attempt_no"]),
        step=int(committed["step"]),
        manifest_sha256=actual,
        fencing_token=committed.get("fencing_token"),
        committed_at=str(committed.get("committed_at", "")),
        size_bytes=size_bytes,
        metrics=dict(manifest.get("metrics") or {}),
        files=tuple(sorted(listed)),
    )


def load_checkpoint(directory: str | Path) -> CheckpointContents:
    """Verify, then read every file (safetensors and JSON, never pickle).

    The bytes are read once and checked against the manifest again, so a file swapped
    between verification and loading is still caught.
    """
    info = verify_checkpoint(directory)
    manifest, _ = _read_json(info.path, MANIFEST_FILE)
    expected = {entry["name"]: entry["sha256"] for entry in manifest["files"]}

    raw: dict[str, bytes] = {}
    for name in (TRAINER_STATE_FILE, MODEL_FILE, OPTIMIZER_FILE, PROBE_FILE):
        raw[name] = (info.path / name).read_bytes()
        if sha256_bytes(raw[name]) != expected[name]:
            raise CorruptCheckpointError(info.path, name, "changed after verification")
    name = TRAINER_STATE_FILE
    try:
        trainer_state = json.loads(raw[name])
        name = MODEL_FILE
        model = safetensors_load(raw[name])
        name = OPTIMIZER_FILE
        training_tensors = safetensors_load(raw[name])
        name = PROBE_FILE
        probe = safetensors_load(raw[name])
        probe_device = _safetensors_metadata(raw[name]).get("device", "cpu")
    except Exception as exc:  # bytes that match the manifest but do not parse
        raise CorruptCheckpointError(info.path, name, f"does not load: {exc}") from exc
    return CheckpointContents(
        info=info,
        model=model,
        training_tensors=training_tensors,
        trainer_state=trainer_state,
        probe=probe,
        probe_device=probe_device,
    )


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return dict(header.get("__metadata__") or {})
