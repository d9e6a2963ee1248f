"""Dagster resources: thin, typed adapters over the Tracks core, chosen per deployment."""

from resources.launcher import TrainerExit, TrainerLauncherResource
from resources.ledger import LedgerResource
from resources.mlflow import MlflowResource
from resources.settings import core_settings
from resources.storage import StorageResource

__all__ = [
    "LedgerResource",
    "MlflowResource",
    "StorageResource",
    "TrainerExit",
    "TrainerLauncherResource",
    "core_settings",
]
