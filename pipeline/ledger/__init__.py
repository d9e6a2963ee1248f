"""The attempt receipt: runs, attempts, checkpoints, evaluations and promotions."""

from pipeline.ledger.errors import (
    LedgerError,
    StaleFencingTokenError,
    UnknownAttemptError,
    UnknownRunError,
)
from pipeline.ledger.ledger import Ledger
from pipeline.ledger.records import (
    AttemptRecord,
    AttemptStart,
    CheckpointRecord,
    CostRow,
    EvaluationRecord,
    PromotionRecord,
    RunRecord,
)

__all__ = [
    "AttemptRecord",
    "AttemptStart",
    "CheckpointRecord",
    "CostRow",
    "EvaluationRecord",
    "Ledger",
    "LedgerError",
    "PromotionRecord",
    "RunRecord",
    "StaleFencingTokenError",
    "UnknownAttemptError",
    "UnknownRunError",
]
