"""Errors the ledger raises; each names the run, attempt or checkpoint involved."""

from __future__ import annotations


class LedgerError(Exception):
    """Base class for ledger errors."""


class UnknownRunError(LedgerError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} is not in the ledger")
        self.run_id = run_id


class UnknownEvaluationError(LedgerError):
    def __init__(self, evaluation_id: str) -> None:
        super().__init__(f"evaluation {evaluation_id!r} is not in the ledger")
        self.evaluation_id = evaluation_id


class UnknownAttemptError(LedgerError):
    def __init__(self, run_id: str, attempt_no: int) -> None:
        super().__init__(f"attempt {run_id}#{attempt_no} is not in the ledger")
        self.run_id = run_id
        self.attempt_no = attempt_no


class AttemptAlreadyEndedError(LedgerError):
    """An attempt that another process ended first: its ending stands, never written over."""

    def __init__(self, run_id: str, attempt_no: int, reason: str | None, ended_at: object) -> None:
        super().__init__(
            f"attempt {run_id}#{attempt_no} was already ended ({reason}, at {ended_at}) by "
            "another process; its ending and retry decision stand"
        )
        self.run_id = run_id
        self.attempt_no = attempt_no
        self.reason = reason


class StaleFencingTokenError(LedgerError):
    """A checkpoint commit from an attempt that a newer attempt of the same run replaced."""

    def __init__(self, run_id: str, attempt_no: int, token: int, current: int) -> None:
        super().__init__(
            f"attempt {run_id}#{attempt_no} holds fencing token {token} but the run's current "
            f"token is {current}: a newer attempt owns this run, so this commit is refused"
        )
        self.run_id = run_id
        self.attempt_no = attempt_no
        self.token = token
        self.current = current


class UnknownSnapshotError(LedgerError):
    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"snapshot {snapshot_id!r} is not in the ledger")
        self.snapshot_id = snapshot_id


class SnapshotManifestChangedError(LedgerError):
    """The snapshot's manifest on disk is not the one the ledger registered: it was edited."""

    def __init__(self, snapshot_id: str, registered: str, found: str) -> None:
        super().__init__(
            f"snapshot {snapshot_id}: manifest.json has sha256 {found}, but the ledger "
            f"registered {registered}; the manifest was changed after the snapshot was made"
        )
        self.snapshot_id = snapshot_id
        self.registered = registered
        self.found = found
