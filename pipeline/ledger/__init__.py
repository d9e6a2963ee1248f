"""The attempt receipt: runs, attempts, checkpoints, evaluations and promotions."""

from pipeline.ledger.errors import (
    AttemptAlreadyEndedError,
    LedgerError,
    SnapshotManifestChangedError,
    StaleFencingTokenError,
    UnknownAttemptError,
    UnknownEvaluationError,
    UnknownRunError,
    UnknownSnapshotError,
)
from pipeline.ledger.ledger import Ledger
from pipeline.ledger.notes import InvalidNoteError
from pipeline.ledger.records import (
    AttemptRecord,
    AttemptStart,
    CheckpointRecord,
    CostRow,
    EvaluationRecord,
    NoteRecord,
    PromotionRecord,
    RunRecord,
    SnapshotCheckRecord,
    SnapshotRecord,
)

__all__ = [
    "AttemptAlreadyEndedError",
    "AttemptRecord",
    "AttemptStart",
    "CheckpointRecord",
    "CostRow",
    "EvaluationRecord",
    "InvalidNoteError",
    "Ledger",
    "LedgerError",
    "NoteRecord",
    "PromotionRecord",
    "RunRecord",
    "SnapshotCheckRecord",
    "SnapshotManifestChangedError",
    "SnapshotRecord",
    "StaleFencingTokenError",
    "UnknownAttemptError",
    "UnknownEvaluationError",
    "UnknownRunError",
    "UnknownSnapshotError",
]
