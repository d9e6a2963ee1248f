"""The one place the Dagster ``Definitions`` are assembled.

Resources are chosen per deployment by ``TRACKS_ENV`` (``local`` by default): SQLite and local
folders under ``TRACKS_HOME`` locally; PostgreSQL URLs (required) in ``production``.
"""

from __future__ import annotations

import os

import dagster as dg

from assets import ALL_ASSET_CHECKS, ALL_ASSETS
from pipeline import redact
from pipeline.settings import TracksSettings
from resources import LedgerResource, MlflowResource, StorageResource, TrainerLauncherResource
from sensors import ALL_JOBS, ALL_SCHEDULES, ALL_SENSORS


class DeploymentError(Exception):
    pass


def _from_env(name: str, value: str) -> str | dg.EnvVar:
    # A URL that came from the environment stays there: Dagster stores and shows the variable's
    # name in resource config (the UI, run storage), never the URL and its password.
    return dg.EnvVar(name) if os.environ.get(name) == value else value


def _resources(settings: TracksSettings) -> dict[str, dg.ConfigurableResource]:
    return {
        "ledger": LedgerResource(url=_from_env("TRACKS_LEDGER_URL", settings.ledger_url)),
        "storage": StorageResource(
            landing_root=str(settings.landing_root),
            snapshot_root=str(settings.snapshot_root),
            checkpoint_root=str(settings.checkpoint_root),
            work_root=str(settings.work_root),
        ),
        "mlflow": MlflowResource(
            tracking_uri=_from_env("TRACKS_MLFLOW_URI", settings.mlflow_tracking_uri),
            artifact_root=str(settings.mlflow_artifact_root),
        ),
        "trainer": TrainerLauncherResource(),
    }


def resources_for(env_name: str, settings: TracksSettings) -> dict[str, dg.ConfigurableResource]:
    """Resources for a deployment: ``local`` or ``production``."""
    if env_name == "local":
        return _resources(settings)
    if env_name == "production":
        for name, url in (
            ("TRACKS_LEDGER_URL", settings.ledger_url),
            ("TRACKS_MLFLOW_URI", settings.mlflow_tracking_uri),
        ):
            if not url.startswith("postgresql"):
                raise DeploymentError(
                    f"TRACKS_ENV=production needs {name} to be a PostgreSQL URL, "
                    f"got {redact.database_url(url)!r}"
                )
        return _resources(settings)
    raise DeploymentError(f"TRACKS_ENV must be 'local' or 'production', got {env_name!r}")


def build_definitions(settings: TracksSettings | None = None) -> dg.Definitions:
    settings = settings or TracksSettings.from_env()
    settings.ensure_dirs()
    return dg.Definitions(
        # Every step of a run in the run's own process. The heavy work already runs in
        # processes of its own (the trainer through Pipes, the restore check, torchrun's ranks,
        # pods on Kubernetes); the steps themselves orchestrate and record. Dagster's default,
        # a process per step, re-imported the code location and its libraries (Dagster,
        # torch, MLflow, Great Expectations) for each of a run's eight steps: measured on
        # 2 vCPUs, a whole-graph run from `dagster dev` took 83 s and 98 CPU-seconds that way
        # and 50 s and 57 CPU-seconds in one process (README, "The lineage graph").
        executor=dg.in_process_executor,
        assets=ALL_ASSETS,
        asset_checks=ALL_ASSET_CHECKS,
        jobs=ALL_JOBS,
        sensors=ALL_SENSORS,
        schedules=ALL_SCHEDULES,
        resources=resources_for(os.environ.get("TRACKS_ENV", "local"), settings),
    )


defs = build_definitions()
