"""The Dagster code location: the one place the ``Definitions`` are assembled.

Top level, beside workspace.yaml, as Dagster projects keep it: ``pipeline/`` is the
framework-free core and never imports Dagster; ``assets/``, ``resources/`` and ``sensors/`` are
the thin Dagster layers this module puts together.

Resources are chosen per deployment by ``TRACKS_ENV`` (``local`` by default): SQLite and local
folders under ``TRACKS_HOME`` locally; PostgreSQL URLs (required) in ``production``.
"""

from __future__ import annotations

# ruff: noqa: E402 - the filters below must be in place before assets/ is imported
import warnings

from dagster import PreviewWarning

# Dagster 1.13 warns of two preview features Tracks uses knowingly, on every load of this code
# location and in each run's process (the `dagster dev` terminal, `tracks demo`): the snapshot
# checks declare their partitions (assets/checks.py: a check's verdict belongs to one
# snapshot), and every Pipes session reads its message reader's writer count (Dagster's own
# code, for TrainerPipesClient and TrainJobPipesClient). A user did nothing to cause either,
# so only these two are silenced, by their words.
for _preview in (
    "Specifying a partitions_def on an AssetCheckSpec",
    "Function `PipesMessageReader.expected_writer_count`",
):
    warnings.filterwarnings("ignore", message=_preview, category=PreviewWarning)

import dagster as dg

from assets import ALL_ASSET_CHECKS, ALL_ASSETS
from assets.data import landing_files_spec
from pipeline import envvars, redact
from pipeline.settings import TracksSettings
from resources import LedgerResource, MlflowResource, StorageResource, TrainerLauncherResource
from sensors import ALL_JOBS, ALL_SCHEDULES, ALL_SENSORS


class DeploymentError(Exception):
    """A deployment whose settings this code location refuses to start with."""


def _from_env(variable: envvars.UrlVariable, value: str) -> str | dg.EnvVar:
    # A URL that came from the environment stays there: Dagster stores and shows the variable's
    # name in resource config (the UI, run storage), never the URL and its password.
    return dg.EnvVar(variable.name) if variable.get() == value else value


def _resources(settings: TracksSettings) -> dict[str, dg.ConfigurableResource]:
    return {
        "ledger": LedgerResource(url=_from_env(envvars.TRACKS_LEDGER_URL, settings.ledger_url)),
        "storage": StorageResource(
            landing_root=str(settings.landing_root),
            snapshot_root=str(settings.snapshot_root),
            checkpoint_root=str(settings.checkpoint_root),
            work_root=str(settings.work_root),
        ),
        "mlflow": MlflowResource(
            tracking_uri=_from_env(envvars.TRACKS_MLFLOW_URI, settings.mlflow_tracking_uri),
            artifact_root=str(settings.mlflow_artifact_root),
        ),
        "trainer": TrainerLauncherResource(),
    }


def resources_for(env_name: str, settings: TracksSettings) -> dict[str, dg.ConfigurableResource]:
    """Resources for a deployment: ``local`` or ``production``."""
    if env_name == "local":
        return _resources(settings)
    if env_name == "production":
        for variable, url in (
            (envvars.TRACKS_LEDGER_URL, settings.ledger_url),
            (envvars.TRACKS_MLFLOW_URI, settings.mlflow_tracking_uri),
        ):
            if not url.startswith("postgresql"):
                raise DeploymentError(
                    f"{envvars.TRACKS_ENV.name}=production needs {variable.name} to be a "
                    "PostgreSQL URL, "
                    f"got {redact.database_url(url)!r}"
                )
        return _resources(settings)
    raise DeploymentError(
        f"{envvars.TRACKS_ENV.name} must be 'local' or 'production', got {env_name!r}"
    )


def build_definitions(settings: TracksSettings | None = None) -> dg.Definitions:
    """The code location's Definitions, with the resources ``TRACKS_ENV`` selects."""
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
        # The landing folder as configured, drawn upstream of data_snapshot.
        assets=[landing_files_spec(settings.landing_root), *ALL_ASSETS],
        asset_checks=ALL_ASSET_CHECKS,
        jobs=ALL_JOBS,
        sensors=ALL_SENSORS,
        schedules=ALL_SCHEDULES,
        resources=resources_for(envvars.TRACKS_ENV.get(), settings),
    )


defs = build_definitions()
