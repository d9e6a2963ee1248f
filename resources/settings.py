"""The core's settings object, rebuilt from the resources a deployment configured."""

from __future__ import annotations

from pathlib import Path

from pipeline.settings import TracksSettings
from resources.ledger import LedgerResource
from resources.mlflow import MlflowResource
from resources.storage import StorageResource


def core_settings(
    storage: StorageResource, mlflow: MlflowResource, ledger: LedgerResource
) -> TracksSettings:
    return TracksSettings(
        home=Path(storage.work_root).parent,
        ledger_url=ledger.url,
        mlflow_tracking_uri=mlflow.tracking_uri,
        mlflow_artifact_root=Path(mlflow.artifact_root),
        landing_root=Path(storage.landing_root),
        snapshot_root=Path(storage.snapshot_root),
        checkpoint_root=Path(storage.checkpoint_root),
        work_root=Path(storage.work_root),
    )
