"""The trainer runtime: ``python -m pipeline.trainer`` and :func:`run_training` in-process.

``config`` and ``exit_codes`` are light; :func:`run_training` (torch) is imported on first use,
so Dagster code can read configs and exit codes without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.trainer import exit_codes
from pipeline.trainer.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from pipeline.trainer.attempt import Outcome, last_words_path
    from pipeline.trainer.train import StopRequest, run_training

__all__ = [
    "ConfigError",
    "Outcome",
    "StopRequest",
    "TrainConfig",
    "exit_codes",
    "last_words_path",
    "run_training",
]

_LAZY = {
    "run_training": "pipeline.trainer.train",
    "StopRequest": "pipeline.trainer.train",
    "Outcome": "pipeline.trainer.attempt",
    "last_words_path": "pipeline.trainer.attempt",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeline.trainer' has no attribute {name!r}")
