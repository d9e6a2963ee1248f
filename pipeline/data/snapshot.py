"""Immutable, content-addressed snapshots of landing data, each with a manifest.

Layout::

    <snapshot_root>/<snapshot_id>/
        manifest.json   snapshot id, family, files (name, bytes, sha256, rows), row count,
                        columns
        data/…          the landing files, byte for byte, read-only

A snapshot holds data for one model family (:mod:`pipeline.data.families`): its id starts with
the family's prefix (``digits-…``, ``text-…``) and its manifest names the family. A manifest
without a ``family`` key was written before there were two: it holds digits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import ids, safepath
from pipeline.data._fs import fsync_dir, fsync_file
from pipeline.data.errors import (
    LandingChangedError,
    LandingFileError,
    NoLandingFilesError,
    SnapshotIntegrityError,
    SnapshotMismatchError,
    SnapshotNotFoundError,
)
from pipeline.data.families import (
    DEFAULT_FAMILY,
    UnknownFamilyError,
    family_data,
    family_of_prefix,
)
from pipeline.data.landing import landing_files
from pipeline.digests import sha256_bytes, sha256_file, sha256_json

if TYPE_CHECKING:
    import pandas as pd

MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
MANIFEST_VERSION = 1
_READ_ONLY = 0o444
_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class LandingFile:
    """One landing file as it will be named in a snapshot: relative name, size, content hash."""

    name: str
    path: Path
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Snapshot:
    """An opened snapshot: where it lives and what its manifest promises."""

    snapshot_id: str
    path: Path
    manifest: dict[str, Any]
    manifest_sha256: str
    row_count: int

    @property
    def family(self) -> str:
        """The model family the data is for (``digits-cnn`` when the manifest predates it)."""
        return str(self.manifest.get("family", DEFAULT_FAMILY))

    @property
    def data_dir(self) -> Path:
        return self.path / DATA_DIR

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_NAME


def describe_landing(landing_dir: Path) -> list[LandingFile]:
    """Name, size and sha256 of every landing file; raises if there are none.

    A file that is not readable Parquet (empty, truncated, another format) raises
    :class:`LandingFileError` naming it here, so no snapshot id (a sensor's partition, the
    answer of ``tracks snapshot-id``) is ever given to data no step could read.
    """
    landing_dir = Path(landing_dir)
    paths = landing_files(landing_dir)
    if not paths:
        raise NoLandingFilesError(landing_dir)
    described = []
    for path in paths:
        _parquet_rows(path, path)
        described.append(
            LandingFile(
                name=path.relative_to(landing_dir).as_posix(),
                path=path,
                bytes=path.stat().st_size,
                sha256=sha256_file(path),
            )
        )
    return described


def snapshot_id_for(landing_dir: Path, *, family: str = DEFAULT_FAMILY) -> str:
    """The id a snapshot of ``landing_dir`` would get: same bytes, same id; any change, new id.

    The family picks the prefix (``digits-``, ``text-``); raises
    :class:`~pipeline.data.families.UnknownFamilyError` for a family no snapshot holds.
    """
    family_data(family)  # an unknown family is named before the landing files are read
    files = describe_landing(landing_dir)
    return _snapshot_id(((f.name, f.sha256, f.bytes) for f in files), family)


def family_of_snapshot(snapshot_id: str) -> str:
    """The model family a snapshot id names by its prefix (``text-…`` → ``text-lm``).

    Raises :class:`~pipeline.ids.InvalidIdError` for anything that is not a snapshot id.
    """
    return family_of_prefix(ids.snapshot_id(snapshot_id).rsplit("-", 1)[0])


def create_snapshot(
    landing_dir: Path,
    snapshot_root: Path,
    *,
    family: str = DEFAULT_FAMILY,
    expected_id: str | None = None,
    source: str | None = None,
) -> Snapshot:
    """Copy the landing files into ``snapshot_root/<snapshot_id>`` and write its manifest.

    The snapshot appears in one rename, complete and read-only. If it already exists it is
    verified and returned unchanged (snapshots are immutable). ``expected_id`` guards a
    partition registered earlier: if the landing data now hashes differently, raise
    :class:`SnapshotMismatchError` rather than snapshot something else under its name.
    ``family`` names what the data is for; it picks the id's prefix and is written in the
    manifest.
    """
    landing_dir = Path(landing_dir)
    snapshot_root = Path(snapshot_root)
    family_data(family)
    files = describe_landing(landing_dir)
    snapshot_id = _snapshot_id(((f.name, f.sha256, f.bytes) for f in files), family)
    if expected_id is not None and snapshot_id != expected_id:
        raise SnapshotMismatchError(landing_dir, expected_id, snapshot_id)

    final = snapshot_root / snapshot_id
    if final.exists():
        return _open_verified(final)

    snapshot_root.mkdir(parents=True, exist_ok=True)
    # Staging is hidden and lives beside its final name, so the rename is atomic and a
    # reader listing snapshot_root sees either nothing or the whole snapshot.
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{snapshot_id}-", dir=snapshot_root))
    try:
        entries = [_copy_into(f, staging / DATA_DIR, snapshot_id) for f in files]
        fsync_dir(staging / DATA_DIR)  # the copied files' entries, not only their bytes
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "snapshot_id": snapshot_id,
            "family": family,
            "created_at": datetime.now(UTC).isoformat(),
            "source": source if source is not None else str(landing_dir.resolve()),
            "files": entries,
            "row_count": sum(e["rows"] for e in entries),
            "columns": _columns(staging / DATA_DIR, entries),
        }
        manifest_path = staging / MANIFEST_NAME
        manifest_path.write_bytes(_manifest_bytes(manifest))
        fsync_file(manifest_path)
        for path in (manifest_path, *(staging / DATA_DIR / e["name"] for e in entries)):
            os.chmod(path, _READ_ONLY)
        os.chmod(staging, 0o755)  # mkdtemp makes 0o700; trainers may run as another user
        fsync_dir(staging)
        try:
            os.rename(staging, final)
        except OSError:
            # Another writer won the race with the same content; theirs is as good as ours.
            if not final.exists():
                raise
            shutil.rmtree(staging, ignore_errors=True)
            return _open_verified(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(snapshot_root)
    return open_snapshot(final)


def open_snapshot(snapshot_root_or_dir: Path, snapshot_id: str | None = None) -> Snapshot:
    """Open ``snapshot_root/snapshot_id``, or the snapshot dir itself when no id is given.

    Reads the manifest only; call :func:`verify_snapshot` to re-hash the data.
    """
    path = Path(snapshot_root_or_dir)
    if snapshot_id is not None:
        path = path / snapshot_id
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise SnapshotNotFoundError(path)
    raw = manifest_path.read_bytes()
    try:
        manifest = json.loads(raw)
        found_id = manifest["snapshot_id"]
        row_count = int(manifest["row_count"])
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotIntegrityError(
            path, [(MANIFEST_NAME, f"unreadable manifest ({type(exc).__name__}: {exc})")]
        ) from exc
    problem = _manifest_files_problem(files)
    if problem is not None:
        raise SnapshotIntegrityError(path, [(MANIFEST_NAME, problem)])
    if found_id != path.name:
        raise SnapshotIntegrityError(
            path, [(MANIFEST_NAME, f"names snapshot {found_id!r} but lives in {path.name!r}")]
        )
    problem = _manifest_family_problem(found_id, manifest.get("family", DEFAULT_FAMILY))
    if problem is not None:
        raise SnapshotIntegrityError(path, [(MANIFEST_NAME, problem)])
    return Snapshot(
        snapshot_id=found_id,
        path=path,
        manifest=manifest,
        manifest_sha256=sha256_bytes(raw),
        row_count=row_count,
    )


def list_snapshots(snapshot_root: Path) -> list[Snapshot]:
    """Every complete snapshot under ``snapshot_root``, oldest first (by manifest created_at).

    Staging directories (hidden) are skipped; manifests are read, data is not re-hashed.
    """
    snapshot_root = Path(snapshot_root)
    if not snapshot_root.is_dir():
        return []
    snapshots = [
        open_snapshot(path)
        for path in snapshot_root.iterdir()
        if path.is_dir() and not path.name.startswith(".") and (path / MANIFEST_NAME).is_file()
    ]
    return sorted(snapshots, key=lambda s: (str(s.manifest.get("created_at", "")), s.snapshot_id))


def verify_snapshot(snapshot: Snapshot) -> None:
    """Re-hash every file against the manifest; raise :class:`SnapshotIntegrityError` on drift.

    Names each file that is missing, unexpected, or differs in size or sha256, and a
    manifest that was edited after the snapshot was opened or no longer matches its id.
    """
    import pyarrow.parquet as pq

    problems: list[tuple[str, str]] = []
    manifest_path = snapshot.manifest_path
    if not manifest_path.is_file():
        problems.append((MANIFEST_NAME, "missing"))
    elif (actual := sha256_file(manifest_path)) != snapshot.manifest_sha256:
        problems.append(
            (MANIFEST_NAME, f"sha256 {actual} differs from {snapshot.manifest_sha256} at open")
        )

    entries = snapshot.manifest["files"]
    content_id = _snapshot_id(
        ((e["name"], e["sha256"], e["bytes"]) for e in entries), snapshot.family
    )
    if content_id != snapshot.snapshot_id:
        problems.append(
            (MANIFEST_NAME, f"file list hashes to {content_id}, not {snapshot.snapshot_id}")
        )

    listed = set()
    for entry in entries:
        name = entry["name"]
        listed.add(name)
        path = snapshot.data_dir / name
        relative = f"{DATA_DIR}/{name}"
        if not path.is_file():
            problems.append((relative, "missing"))
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append((relative, f"size {size} bytes, manifest says {entry['bytes']}"))
            continue
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            problems.append((relative, f"sha256 {digest}, manifest says {entry['sha256']}"))
            continue
        # Facts the manifest states about the data are checked against the data itself.
        rows = pq.ParquetFile(path).metadata.num_rows
        if rows != entry["rows"]:
            problems.append((relative, f"holds {rows} rows, manifest says {entry['rows']}"))
    counted = sum(e["rows"] for e in entries if isinstance(e.get("rows"), int))
    if snapshot.row_count != counted:
        problems.append(
            (MANIFEST_NAME, f"row_count {snapshot.row_count}, its files list {counted} rows")
        )

    if snapshot.data_dir.is_dir():
        for path in sorted(snapshot.data_dir.rglob("*")):
            name = path.relative_to(snapshot.data_dir).as_posix()
            if path.is_file() and name not in listed:
                problems.append((f"{DATA_DIR}/{name}", "not in the manifest"))

    if problems:
        raise SnapshotIntegrityError(snapshot.path, problems)


def read_snapshot_frame(snapshot: Snapshot, *, verify: bool = True) -> pd.DataFrame:
    """All rows of the snapshot's files, in manifest order (verified first unless told not to)."""
    import pandas as pd
    import pyarrow.parquet as pq

    if verify:
        verify_snapshot(snapshot)
    frames = [
        pq.read_table(snapshot.data_dir / entry["name"]).to_pandas()
        for entry in snapshot.manifest["files"]
    ]
    return pd.concat(frames, ignore_index=True) if len(frames) != 1 else frames[0]


def _manifest_files_problem(files: Any) -> str | None:
    if not isinstance(files, list) or not files:
        return "'files' is not a non-empty list"
    for entry in files:
        if not isinstance(entry, dict) or not {"name", "bytes", "sha256", "rows"} <= entry.keys():
            return f"file entry {entry!r} lacks name, bytes, sha256 or rows"
        name = entry["name"]
        # A manifest must not point verification or reads outside its own data dir.
        if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
            return f"file name {name!r} is not a relative path inside {DATA_DIR}/"
    return None


def _manifest_family_problem(snapshot_id: str, family: Any) -> str | None:
    # The family is covered by the id only through its prefix: a manifest whose "family" key
    # was edited would send the data through another family's checks and trainer.
    try:
        prefix = family_data(family).snapshot_prefix
    except UnknownFamilyError:
        return f"names unknown family {family!r}"
    if not snapshot_id.startswith(prefix + "-"):
        return f"names family {family!r}, whose ids start {prefix + '-'!r}, not {snapshot_id!r}"
    return None


def _snapshot_id(entries: Any, family: str) -> str:
    canonical = [[name, sha256, size] for name, sha256, size in entries]
    return f"{family_data(family).snapshot_prefix}-{sha256_json(canonical)[:16]}"


def _open_verified(path: Path) -> Snapshot:
    snapshot = open_snapshot(path)
    verify_snapshot(snapshot)
    return snapshot


def _copy_into(landing: LandingFile, data_dir: Path, snapshot_id: str) -> dict[str, Any]:
    target = data_dir / landing.name
    target.parent.mkdir(parents=True, exist_ok=True)
    # Hash while copying: the id was computed from an earlier read, and a producer still
    # writing would otherwise slip different bytes in under that id.
    digest = hashlib.sha256()
    size = 0
    # Never through a link: the file may have been swapped for one since it was listed.
    source_fd = safepath.open_regular_nofollow(landing.path)
    with open(source_fd, "rb") as source, open(target, "wb") as sink:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            sink.write(chunk)
            size += len(chunk)
        sink.flush()
        os.fsync(sink.fileno())
    if digest.hexdigest() != landing.sha256 or size != landing.bytes:
        raise LandingChangedError(landing.path, snapshot_id)
    return {
        "name": landing.name,
        "bytes": size,
        "sha256": landing.sha256,
        "rows": _parquet_rows(target, landing.path),
    }


def _parquet_rows(path: Path, landing_path: Path) -> int:
    # A zero-byte, truncated or non-Parquet landing file is bad input naming that file, not a
    # pyarrow traceback about "a file" somewhere in a staging folder.
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise LandingFileError(landing_path, "is empty (0 bytes), not a Parquet file")
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LandingFileError(
            landing_path, f"is not a readable Parquet file (truncated or another format: {first})"
        ) from exc


def _columns(data_dir: Path, entries: list[dict[str, Any]]) -> list[dict[str, str]]:
    # Union in order of first appearance; a column whose type differs between files lists
    # every type seen ("int64|double"), so the manifest shows the disagreement.
    import pyarrow.parquet as pq

    dtypes: dict[str, list[str]] = {}
    for entry in entries:
        for field in pq.read_schema(data_dir / entry["name"]):
            seen = dtypes.setdefault(field.name, [])
            if str(field.type) not in seen:
                seen.append(str(field.type))
    return [{"name": name, "dtype": "|".join(types)} for name, types in dtypes.items()]


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
