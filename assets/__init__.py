"""Dagster assets and asset checks: data, training, evaluation, promotion."""

from assets.checks import ALL_CHECKS
from assets.data import data_snapshot
from assets.evaluation import evaluation
from assets.partitions import snapshot_partitions
from assets.promotion import promoted_model
from assets.training import committed_checkpoint, training_attempt

ALL_ASSETS = [data_snapshot, training_attempt, committed_checkpoint, evaluation, promoted_model]
# Checks defined apart from their asset (data_snapshot declares its own through check_specs).
ALL_ASSET_CHECKS: list = [*ALL_CHECKS]

__all__ = ["ALL_ASSETS", "ALL_ASSET_CHECKS", "snapshot_partitions"]
