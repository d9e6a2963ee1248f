"""Where the launcher keeps the ranks summary, for the launcher that writes it and the
orchestrator that reads it (``pipeline.attempts``): the launcher calls the orchestrator's side,
never the reverse, so the path lives here, below both."""

from __future__ import annotations

from pathlib import Path

from pipeline import ids
from pipeline.checkpoint.layout import run_dir


def ranks_summary_path(store: str | Path, run_id: str, attempt_no: int) -> Path:
    """``<store>/<run_id>/attempt-<n>.ranks.json``: every rank's ending and the first failure."""
    return run_dir(store, run_id) / f"attempt-{ids.attempt_no(attempt_no)}.ranks.json"
