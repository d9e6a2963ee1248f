"""Errors the data layer raises; each names the landing dir, snapshot, file or column involved."""

from __future__ import annotations

from pathlib import Path

from pipeline.states import TerminationReason


class DataError(Exception):
    """Base class for data-layer errors."""

    # What the retry policy should call an attempt that died of this error.
    termination_reason: TerminationReason = TerminationReason.BAD_INPUT


class NoLandingFilesError(DataError):
    def __init__(self, landing_dir: Path) -> None:
        super().__init__(f"landing dir {landing_dir} holds no Parquet files to snapshot")
        self.landing_dir = landing_dir


class SnapshotMismatchError(DataError):
    """The landing data no longer hashes to the snapshot id a partition was registered with."""

    def __init__(self, landing_dir: Path, expected_id: str, actual_id: str) -> None:
        super().__init__(
            f"landing data changed since the partition was registered: {landing_dir} hashes to "
            f"{actual_id}, expected {expected_id}"
        )
        self.landing_dir = landing_dir
        self.expected_id = expected_id
        self.actual_id = actual_id


class LandingChangedError(DataError):
    """A landing file changed while it was being copied: a producer is still writing."""

    # A half-written landing file settles; trying again shortly is the right call.
    termination_reason = TerminationReason.INFRA_TRANSIENT

    def __init__(self, path: Path, snapshot_id: str) -> None:
        super().__init__(
            f"landing file {path} changed while it was copied into snapshot {snapshot_id}; "
            "retry once its producer has finished writing"
        )
        self.path = path
        self.snapshot_id = snapshot_id


class SnapshotNotFoundError(DataError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"no snapshot at {path}: manifest.json is missing")
        self.path = path


class SnapshotIntegrityError(DataError):
    """Snapshot bytes differ from its manifest: termination reason ``bad_input``."""

    def __init__(self, snapshot_path: Path, problems: list[tuple[str, str]]) -> None:
        shown = "; ".join(f"{name}: {what}" for name, what in problems[:5])
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        super().__init__(f"snapshot {snapshot_path} differs from its manifest: {shown}{more}")
        self.snapshot_path = snapshot_path
        self.problems = tuple(problems)
        self.file = problems[0][0] if problems else None


class MissingColumnError(DataError):
    def __init__(self, column: str, where: str) -> None:
        super().__init__(f"column {column!r} is missing from {where}")
        self.column = column


class UnknownSplitError(DataError):
    # Asking for a split that does not exist is a caller's mistake, not bad data.
    termination_reason = TerminationReason.USER_CODE_ERROR

    def __init__(self, split: str, known: tuple[str, ...]) -> None:
        super().__init__(f"split {split!r} is not one of {', '.join(known)}")
        self.split = split


class EmptySplitError(DataError):
    def __init__(self, split: str) -> None:
        super().__init__(f"split {split!r} has no rows")
        self.split = split


class BlockedSnapshotError(DataError):
    """A snapshot whose blocking checks failed: nothing trains on it, by any path."""

    def __init__(self, snapshot_id: str, manifest_sha256: str, failed: dict[str, str]) -> None:
        checks = "; ".join(f"{name}: {summary}" for name, summary in failed.items())
        super().__init__(
            f"snapshot {snapshot_id} (manifest {manifest_sha256[:16]}) failed its blocking "
            f"checks, so nothing trains on it — {checks}"
        )
        self.snapshot_id = snapshot_id
        self.manifest_sha256 = manifest_sha256
        self.failed = failed


class SnapshotTamperedError(DataError):
    """The snapshot's manifest differs from the one recorded when it was made and checked."""

    def __init__(self, snapshot_id: str, detail: str) -> None:
        super().__init__(f"snapshot {snapshot_id}: {detail}")
        self.snapshot_id = snapshot_id


class LandingFileError(DataError):
    """A landing file that is not readable Parquet: zero bytes, truncated, another format."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"landing file {path}: {problem}")
        self.path = path
