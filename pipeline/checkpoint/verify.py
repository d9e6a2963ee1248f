"""Verifying checkpoints: refuse pickle, check the layout, verify bytes against the manifest.

The verified reads here read each file once, into the memory it then parses (or, given
destinations, straight into the live tensors it restores), hashing each block as it arrives
while the next is read (direct_io.py): verification costs no second read, and the bytes used
are the bytes hashed. :mod:`pipeline.checkpoint.load` builds ``load_checkpoint`` on them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.direct_io import DIRECT_MIN_BYTES, BlockReader
from pipeline.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from pipeline.checkpoint.layout import (
    COMMITTED_FILE,
    CORRUPT_FILE,
    DCP_METADATA_FILE,
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    SHARDED_FORMAT,
    TRAINER_STATE_FILE,
    file_rank,
    is_dcp_file,
    parse_checkpoint_dir_name,
)
from pipeline.checkpoint.tensorfile import (
    TensorEntry,
    TensorFileError,
    header_length,
    parse_header,
    parse_safetensors,
    tensor_view,
)
from pipeline.digests import DigestAlgorithm, file_digest, new_hasher, recorded_digest, sha256_bytes

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")
_PICKLE_PROTOCOLS = (2, 3, 4, 5)
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class ListedFile:
    """One file as MANIFEST.json lists it: its size and its digest, with the algorithm."""

    name: str
    size: int
    algorithm: DigestAlgorithm
    digest: str

    def mismatch(self, actual: str) -> str:
        return f"{self.algorithm} is {actual}, MANIFEST.json says {self.digest}"


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
    # FORMAT (one process, safetensors) or SHARDED_FORMAT (ranks' DCP shards), and the
    # number of ranks that wrote it.
    format: str = FORMAT
    world_size: int = 1


@dataclass(frozen=True)
class LedgerCommit:
    """What the ledger's committed row for a checkpoint directory records: its MANIFEST.json
    sha256 (None: the ledger has no committed row for that directory).

    With a ledger attached, that row, not the folder, is the record of what was committed: a
    store that rewrites a checkpoint and re-signs MANIFEST.json and COMMITTED to match cannot
    also rewrite the ledger.
    """

    manifest_sha256: str | None


@dataclass(frozen=True)
class CheckpointContents:
    """Everything read from a verified checkpoint, as tensors and JSON."""

    info: CheckpointInfo
    model: dict[str, torch.Tensor]
    training_tensors: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    probe: dict[str, torch.Tensor]
    probe_device: str
    # Where the probe logits were computed (None: written before this was recorded).
    probe_cpu_capability: str | None = None
    # Bytes were read straight into tensors the caller passed (``load_checkpoint(into=…)``):
    # those tensors now hold this checkpoint's values, verified or not.
    read_in_place: bool = False


def is_committed(directory: Path) -> bool:
    return (directory / COMMITTED_FILE).is_file()


def checkpoint_dirs(run_dir: Path, *, committed_only: bool = True) -> list[Path]:
    """Checkpoint directories of a run, newest first (step, then attempt).

    Directories without COMMITTED are not checkpoints and are left out unless asked for; so
    are those with a CORRUPT marker (verification failed once: ruled out for good, with or
    without a ledger) and symlinks (never followed).
    """
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        key = parse_checkpoint_dir_name(child.name)
        if key is None or child.is_symlink() or not child.is_dir():
            continue
        if committed_only and (not is_committed(child) or (child / CORRUPT_FILE).exists()):
            continue
        found.append((key, child))
    return [path for _, path in sorted(found, reverse=True)]


def refuse_pickle(directory: Path, *, exempt: frozenset[str] = frozenset()) -> None:
    """Raise :class:`UnsafeCheckpointError` if any file in ``directory`` is or wraps a pickle.

    ``exempt`` names files a format reads through a restricted loader of its own (a sharded
    checkpoint's DCP files: see :mod:`pipeline.checkpoint.sharded`).
    """
    for path in sorted(directory.rglob("*")):
        if path.is_file() and str(path.relative_to(directory)) not in exempt:
            _refuse_pickle_file(directory, path)


def _refuse_pickle_file(directory: Path, path: Path) -> None:
    name = str(path.relative_to(directory))
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnsafeCheckpointError(directory, name, f"has a pickle suffix ({path.suffix})")
    with open(path, "rb") as handle:
        head = handle.read(9)
    # A safetensors file starts with its header length (u64, little-endian), whose low
    # bytes can look like pickle magic (a 640-byte header is 80 02 …): a well-formed
    # safetensors header is not a pickle, whatever its first two bytes.
    if _looks_like_safetensors(head, path.stat().st_size):
        return
    if len(head) >= 2 and head[0] == 0x80 and head[1] in _PICKLE_PROTOCOLS:
        raise UnsafeCheckpointError(
            directory, name, f"starts with pickle protocol {head[1]} magic bytes"
        )
    if head[:4] == _ZIP_MAGIC:
        raise UnsafeCheckpointError(directory, name, "is a zip archive (torch.save wraps pickle)")


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    header_len = int.from_bytes(head[:8], "little")
    return 2 <= header_len <= size - 8 and head[8:9] == b"{"


def _open_nofollow(path: str | bytes, flags: int) -> int:
    # Readers never follow a link: a symlinked file could point anywhere on the machine.
    return os.open(path, flags | os.O_NOFOLLOW)


def _refuse_links(directory: Path) -> None:
    if directory.is_symlink():
        raise CorruptCheckpointError(directory, ".", "is a symlink; Tracks does not follow links")
    for entry in os.scandir(directory):
        if entry.is_symlink():
            raise CorruptCheckpointError(
                directory, entry.name, "is a symlink; Tracks does not follow links"
            )


def _read_json(directory: Path, name: str) -> tuple[dict[str, Any], bytes]:
    path = directory / name
    if not path.is_file():
        raise CorruptCheckpointError(directory, name, "missing")
    try:
        with open(path, "rb", opener=_open_nofollow) as handle:
            raw = handle.read()
    except OSError as exc:
        raise CorruptCheckpointError(directory, name, f"cannot be read ({exc.strerror})") from exc
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(directory, name, f"is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CorruptCheckpointError(directory, name, "is not a JSON object")
    return value, raw


def verify_checkpoint(
    directory: str | Path, *, ledger_commit: LedgerCommit | None = None
) -> CheckpointInfo:
    """Check COMMITTED → MANIFEST.json → every file's size and digest, and nothing extra.

    ``ledger_commit``: what the ledger recorded for this directory; MANIFEST.json must then be
    the manifest it committed. Raises :class:`CorruptCheckpointError` naming the directory,
    the file and what differs, or :class:`UnsafeCheckpointError` when a pickle is present.
    """
    info, listed = _verify_layout(directory, ledger_commit)
    verify_files(info.path, listed, list(listed))
    return info


def verify_files(directory: Path, listed: dict[str, ListedFile], names: list[str]) -> None:
    """Hash ``names`` (two at a time) and compare each with its MANIFEST.json digest."""

    def check(name: str) -> None:
        entry = listed[name]
        digest = file_digest(directory / name, entry.algorithm)
        if digest != entry.digest:
            raise CorruptCheckpointError(directory, name, entry.mismatch(digest))

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-verify") as pool:
        for future in [pool.submit(check, name) for name in names]:
            future.result()


def _verify_layout(
    directory: str | Path, ledger_commit: LedgerCommit | None = None
) -> tuple[CheckpointInfo, dict[str, ListedFile]]:
    """Everything :func:`verify_checkpoint` checks but the files' hashes (sizes included).

    Every later check hangs off the MANIFEST.json read here: held to ``ledger_commit``, the
    whole chain (each file's digest) is the one the ledger committed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CorruptCheckpointError(directory, ".", "directory does not exist")
    _refuse_links(directory)
    # DCP's own files are exempt here, and later refused unless a sharded manifest lists them.
    dcp_files = frozenset(p.name for p in directory.iterdir() if is_dcp_file(p.name))
    refuse_pickle(directory, exempt=dcp_files)
    committed, _ = _read_json(directory, COMMITTED_FILE)
    manifest, manifest_raw = _read_json(directory, MANIFEST_FILE)
    for key in ("manifest_sha256", "run_id", "attempt_no", "step"):
        if key not in committed:
            raise CorruptCheckpointError(directory, COMMITTED_FILE, f"has no {key!r}")
    actual = sha256_bytes(manifest_raw)
    if ledger_commit is not None and ledger_commit.manifest_sha256 != actual:
        raise CorruptCheckpointError(
            directory,
            MANIFEST_FILE,
            f"sha256 is {actual} but the ledger "
            + (
                f"committed {ledger_commit.manifest_sha256} for this checkpoint"
                if ledger_commit.manifest_sha256
                else "has no committed row for this checkpoint"
            )
            + ": the folder was rewritten after its commit, or never committed",
        )
    if committed["manifest_sha256"] != actual:
        raise CorruptCheckpointError(
            directory,
            MANIFEST_FILE,
            f"sha256 is {actual} but COMMITTED points at {committed['manifest_sha256']}",
        )
    checkpoint_format = manifest.get("format")
    if checkpoint_format not in (FORMAT, SHARDED_FORMAT):
        raise CorruptCheckpointError(
            directory,
            MANIFEST_FILE,
            f"format {checkpoint_format!r}, expected {FORMAT!r} or {SHARDED_FORMAT!r}",
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
    listed: dict[str, ListedFile] = {}
    entries = manifest.get("files")
    if not isinstance(entries, list):
        raise CorruptCheckpointError(directory, MANIFEST_FILE, "'files' is not a list")
    for entry in entries:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("size"), int)
        ):
            raise CorruptCheckpointError(directory, MANIFEST_FILE, f"malformed entry {entry!r}")
        try:
            algorithm, digest = recorded_digest(entry)
        except ValueError as exc:
            raise CorruptCheckpointError(
                directory, MANIFEST_FILE, f"entry {entry['name']!r}: {exc}"
            ) from exc
        listed[entry["name"]] = ListedFile(entry["name"], entry["size"], algorithm, digest)
    sharded = checkpoint_format == SHARDED_FORMAT
    required = (
        (DCP_METADATA_FILE, TRAINER_STATE_FILE, PROBE_FILE)
        if sharded
        else (MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, PROBE_FILE)
    )
    for name in required:
        if name not in listed:
            raise CorruptCheckpointError(directory, MANIFEST_FILE, f"does not list {name}")
    world_size = manifest.get("world_size", 1)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise CorruptCheckpointError(directory, MANIFEST_FILE, f"world_size {world_size!r}")
    _check_world_size(directory, world_size, listed if sharded else None)
    if not sharded:
        # DCP files in a single-process checkpoint are not exempt (the rest were checked).
        for name in sorted(dcp_files):
            _refuse_pickle_file(directory, directory / name)
    size_bytes = len(manifest_raw)
    for name, entry in listed.items():
        path = directory / name
        if Path(name).name != name:
            raise CorruptCheckpointError(directory, name, "is not a plain file name")
        if not path.is_file():
            raise CorruptCheckpointError(directory, name, "listed in MANIFEST.json but missing")
        size = path.stat().st_size
        if size != entry.size:
            raise CorruptCheckpointError(
                directory, name, f"size is {size} bytes, MANIFEST.json says {entry.size}"
            )
        size_bytes += size
    expected = set(listed) | {MANIFEST_FILE, COMMITTED_FILE}
    for path in sorted(directory.iterdir()):
        if path.name not in expected:
            raise CorruptCheckpointError(directory, path.name, "is not listed in MANIFEST.json")
    info = CheckpointInfo(
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
        format=checkpoint_format,
        world_size=world_size,
    )
    return info, listed


def _check_world_size(
    directory: Path, world_size: int, listed: dict[str, ListedFile] | None
) -> None:
    """The ranks a manifest's files belong to are exactly ``range(world_size)``.

    Each rank of a sharded save writes its own ``rank-<rank>.json`` and ``digests-<rank>.json``
    and DCP names its shards ``__<rank>_<n>.distcp``; a single-process checkpoint
    (``listed`` None) is world size 1. A false world size would be believed by the resume
    (whose rank RNG it restores) and stated on the receipt (what it resharded from).
    """
    if listed is None:
        if world_size != 1:
            raise CorruptCheckpointError(
                directory, MANIFEST_FILE, f"world_size {world_size} for a single-process format"
            )
        return
    found: dict[str, set[int]] = {"rank": set(), "digests": set(), "shard": set()}
    for name in listed:
        if (owner := file_rank(name)) is not None:
            found[owner[0]].add(owner[1])
    expected = set(range(world_size))
    if found["rank"] != expected or found["digests"] != expected or not found["shard"] <= expected:
        raise CorruptCheckpointError(
            directory,
            MANIFEST_FILE,
            f"world_size {world_size} but the files it lists are those of ranks "
            f"{sorted(set().union(*found.values()))}",
        )


def read_trainer_state(
    directory: str | Path, *, ledger_commit: LedgerCommit | None = None
) -> dict[str, Any]:
    """A committed checkpoint's ``trainer_state.json``, verified against MANIFEST.json (and
    MANIFEST.json against ``ledger_commit``, when given).

    Cheap (the layout and one small file): what a reader checks before it reads gigabytes.
    """
    info, listed = _verify_layout(directory, ledger_commit)
    if TRAINER_STATE_FILE not in listed:
        raise CorruptCheckpointError(info.path, TRAINER_STATE_FILE, "not listed in MANIFEST.json")
    raw = read_verified(info.path, listed[TRAINER_STATE_FILE]).numpy().tobytes()
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(
            info.path, TRAINER_STATE_FILE, f"does not load: {exc}"
        ) from exc
    if not isinstance(value, dict):
        raise CorruptCheckpointError(info.path, TRAINER_STATE_FILE, "is not a JSON object")
    return value


@dataclass(frozen=True)
class ParsedInPlace:
    """A safetensors file read by :func:`read_verified_into`: its tensors and metadata."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    in_place: bool  # some tensor was read straight into a destination
    whole: bool = False  # every tensor was: the destinations hold the whole file


def read_verified_into(
    directory: Path,
    listed: ListedFile,
    destinations: dict[str, torch.Tensor],
    *,
    threads: int = 1,
) -> ParsedInPlace:
    """Read a safetensors file once, each tensor straight into ``destinations[name]`` when that
    is a contiguous CPU or CUDA tensor of the same dtype and shape, the rest into one fresh
    host buffer; every byte hashed in file order and compared with MANIFEST.json at the end.

    The header is read (and hashed) first and decides where the bytes go, before it is
    verified, so it is held to the same rules as when parsed: a destination receives exactly
    its own number of bytes, never more, whatever the header says. A header that does not
    parse, or that overlaps its tensors, is read the ordinary way (:func:`read_verified`),
    which verifies the digest before anything is parsed and says what is wrong.
    """
    name, size = listed.name, listed.size
    digest = new_hasher(listed.algorithm, threads=threads)
    head = bytearray()
    data_at = -1  # where the data section starts, once the header's length is known
    entries: list[TensorEntry] = []
    metadata: dict[str, str] = {}
    plan: _Plan | None = None
    segments: list[tuple[int, int, torch.Tensor]] = []
    spill = torch.empty(0, dtype=torch.uint8)
    got = segment = 0
    try:
        with _blocks(directory / name, size) as blocks:
            for offset, view in blocks:
                got = offset + len(view)
                if got > size:
                    break
                digest.update(view)
                used = 0
                if plan is None:
                    # The header, from the first block(s): its length, then the JSON.
                    wanted = 8 if data_at < 0 else data_at
                    used = min(wanted - len(head), len(view))
                    head += view[:used]
                    if data_at < 0 and len(head) == 8:
                        data_at = 8 + header_length(bytes(head), size)
                        more = min(data_at - len(head), len(view) - used)
                        head += view[used : used + more]
                        used += more
                    if len(head) != data_at:
                        continue
                    entries, metadata = parse_header(bytes(head[8:]), size - data_at)
                    plan = _plan(entries, destinations, size - data_at)
                    if plan is None:
                        raise TensorFileError("tensors overlap")
                    spill = torch.empty(plan.spill_size, dtype=torch.uint8)
                    segments = [
                        (start, end, target if target is not None else spill[at : at + end - start])
                        for start, end, target, at in plan.segments
                    ]
                if used < len(view):
                    source = torch.frombuffer(view, dtype=torch.uint8)[used:]
                    segment = _scatter(segments, segment, offset + used - data_at, source)
            if plan is None and got == size:
                raise TensorFileError(f"a {size}-byte file ends inside its header")
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            directory, name, "listed in MANIFEST.json but missing"
        ) from exc
    except TensorFileError:
        # Not a header this reader can place bytes by: read it whole, verify, then say why.
        buffer = read_verified(directory, listed, threads=threads)
        try:
            tensors, metadata = parse_safetensors(buffer)
        except TensorFileError as exc:
            # Bytes that match the manifest but do not parse: written wrong, never to be used.
            raise CorruptCheckpointError(directory, name, f"does not load: {exc}") from exc
        return ParsedInPlace(tensors, metadata, in_place=False)
    if got != size or plan is None:
        raise CorruptCheckpointError(
            directory, name, f"changed while being read (MANIFEST.json says {size} bytes)"
        )
    if (actual := digest.hexdigest()) != listed.digest:
        raise CorruptCheckpointError(directory, name, listed.mismatch(actual))
    tensors = {}
    for entry in entries:
        if entry.name in plan.placed:
            tensors[entry.name] = plan.placed[entry.name]
        else:
            tensors[entry.name] = tensor_view(spill, entry, plan.spill_offset[entry.name])
    return ParsedInPlace(
        tensors, metadata, in_place=bool(plan.placed), whole=len(plan.placed) == len(entries)
    )


def _scatter(
    segments: list[tuple[int, int, torch.Tensor]], segment: int, at: int, source: torch.Tensor
) -> int:
    """Copy ``source``, the data section's bytes from ``at`` on, into the segments that hold
    them (in file order, from index ``segment``); returns the segment the next byte goes to.
    torch's copy releases the GIL: the other file's reader and hasher keep running. Into a
    GPU tensor it is a host-to-device copy from pageable memory, which returns only once the
    bytes have left ``source`` (the reader then reuses that block)."""
    done = 0
    while done < len(source):
        start, end, target = segments[segment]
        count = min(end - at, len(source) - done)
        target[at - start : at - start + count].copy_(source[done : done + count])
        done += count
        at += count
        if at == end:
            segment += 1
    return segment


# Where a destination may live to be read into: a copy_ into a meta tensor, say, would drop
# the bytes without a word.
_READ_INTO_DEVICES = frozenset({"cpu", "cuda"})


@dataclass
class _Plan:
    """Where each byte of a data section goes, in file order."""

    # (start, end, destination bytes or None for the spill buffer, offset in the spill buffer)
    segments: list[tuple[int, int, torch.Tensor | None, int]] = field(default_factory=list)
    spill_size: int = 0
    spill_offset: dict[str, int] = field(default_factory=dict)  # entry start - spill offset
    placed: dict[str, torch.Tensor] = field(default_factory=dict)


def _plan(
    entries: list[TensorEntry], destinations: dict[str, torch.Tensor], data_size: int
) -> _Plan | None:
    plan = _Plan()
    used: set[int] = set()

    def spill(start: int, end: int) -> int:
        at = plan.spill_size + (-plan.spill_size % 8)  # every spilled tensor 8-byte aligned
        plan.segments.append((start, end, None, at))
        plan.spill_size = at + end - start
        return at

    position = 0
    for entry in entries:
        if entry.start < position:
            return None
        if entry.start > position:
            spill(position, entry.start)
        target = destinations.get(entry.name)
        if (
            target is not None
            and target.device.type in _READ_INTO_DEVICES
            and target.dtype == entry.dtype
            and tuple(target.shape) == entry.shape
            and target.is_contiguous()
            and entry.end > entry.start
            and target.data_ptr() not in used  # tied weights: the second copy is spilled
        ):
            used.add(target.data_ptr())
            destination = target.detach().reshape(-1).view(torch.uint8)
            assert len(destination) == entry.end - entry.start  # same dtype and shape
            plan.segments.append((entry.start, entry.end, destination, 0))
            plan.placed[entry.name] = target.detach()
        else:
            plan.spill_offset[entry.name] = entry.start - spill(entry.start, entry.end)
        position = entry.end
    if position < data_size:
        spill(position, data_size)
    return plan


def read_verified(directory: Path, listed: ListedFile, *, threads: int = 1) -> torch.Tensor:
    """The bytes of ``directory/listed.name`` as a uint8 tensor, after checking size and digest.

    One read, hashed block by block as it arrives (:class:`BlockReader` reads ahead), so
    hashing overlaps the disk instead of following it.
    """
    name, size = listed.name, listed.size
    buffer = torch.empty(size, dtype=torch.uint8)
    digest = new_hasher(listed.algorithm, threads=threads)
    got = 0
    try:
        with _blocks(directory / name, size) as blocks:
            for offset, view in blocks:
                got = offset + len(view)
                if got > size:
                    break
                digest.update(view)
                buffer[offset:got].copy_(torch.frombuffer(view, dtype=torch.uint8))
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            directory, name, "listed in MANIFEST.json but missing"
        ) from exc
    if got != size:
        raise CorruptCheckpointError(
            directory, name, f"changed while being read (MANIFEST.json says {size} bytes)"
        )
    if (actual := digest.hexdigest()) != listed.digest:
        raise CorruptCheckpointError(directory, name, listed.mismatch(actual))
    return buffer


@contextmanager
def _blocks(path: Path, size: int) -> Iterator[BlockReader]:
    """``path`` read once, in order, never through a link; large files bypass the page cache."""
    with open(path, "rb", buffering=0, opener=_open_nofollow) as handle:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with BlockReader(handle.fileno(), size, direct=size >= DIRECT_MIN_BYTES) as reader:
            yield reader
