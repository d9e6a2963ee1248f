"""The training health a checkpoint carries, as its evaluation records it.

Every checkpoint's ``trainer_state.json`` holds the loss-spike detector's settings and the
history of its lineage (pipeline/trainer/spikes.py): every skipped update, every rollback and
every batch range dealt past. An evaluation copies that history from the verified file into
its ledger row (``evaluations.training_health``) and its MLflow run's tags, so the promotion
gate and a reader see that a model trained through spikes without opening the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.trainer.spikes import health_summary

# MLflow tag names (values are strings), beside the evaluation's other ``tracks.`` tags.
TAG_PREFIX = "tracks.training_health."


def checkpoint_health(checkpoint_dir: str | Path, manifest_sha256: str) -> dict[str, Any] | None:
    """The health history in the checkpoint's ``trainer_state.json``, verified against the
    MANIFEST.json whose sha256 is ``manifest_sha256`` (the one the evaluation loaded), with
    its totals; None for a checkpoint written without a detector.

    Raises the checkpoint protocol's ``CorruptCheckpointError`` when the file does not verify.
    """
    from pipeline.checkpoint.verify import LedgerCommit, read_trainer_state

    saved = read_trainer_state(checkpoint_dir, ledger_commit=LedgerCommit(manifest_sha256))
    raw = saved.get("health")
    if not isinstance(raw, dict):
        return None
    return health_summary(raw)


def health_tags(health: dict[str, Any] | None) -> dict[str, str]:
    """``tracks.training_health.*`` tags for an evaluation's MLflow run: ``recorded`` (false for a
    checkpoint without a history), ``spikes``, ``skipped_updates``, ``rollbacks`` and
    ``skipped_batches`` (``58-62,71-71``, or ``none``)."""
    if health is None:
        return {f"{TAG_PREFIX}recorded": "false"}
    ranges = ",".join(f"{first}-{last}" for first, last in health["skipped_batches"])
    return {
        f"{TAG_PREFIX}recorded": "true",
        f"{TAG_PREFIX}spikes": str(health["spikes"]),
        f"{TAG_PREFIX}skipped_updates": str(health["skipped_updates"]),
        f"{TAG_PREFIX}rollbacks": str(health["rollbacks"]),
        f"{TAG_PREFIX}skipped_batches": ranges or "none",
    }
