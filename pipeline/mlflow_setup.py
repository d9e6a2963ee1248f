"""The one place Tracks configures MLflow: URIs, quiet logging, experiments, metric names.

Everything else asks :func:`mlflow_client` for a client with explicit URIs. The fluent API is
only used where MLflow offers nothing else (``pyfunc.log_model`` inside ``start_run``, and
``pyfunc.load_model("models:/…")`` for readers), so the process-wide URIs are set here too.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from pipeline.settings import TracksSettings

EVALUATION_EXPERIMENT = "tracks-evaluation"
PROMOTION_EXPERIMENT = "tracks-promotion"
CHAMPION_ALIAS = "champion"
DEFAULT_MODEL_NAME = "digits-classifier"

# MLflow and Alembic log every schema migration and artifact upload at INFO.
_NOISY_LOGGERS = ("mlflow", "alembic", "alembic.runtime.migration")
_lock = threading.Lock()


def configure_mlflow(settings: TracksSettings) -> None:
    """Point MLflow's process-wide tracking and registry URIs at ``settings`` and quiet it."""
    import mlflow

    with _lock:
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        # tqdm bars for every artifact download end up as garbage in Dagster's captured logs.
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        if mlflow.get_tracking_uri() != settings.mlflow_tracking_uri:
            mlflow.set_tracking_uri(settings.mlflow_tracking_uri)
        if mlflow.get_registry_uri() != settings.mlflow_tracking_uri:
            mlflow.set_registry_uri(settings.mlflow_tracking_uri)


def mlflow_client(settings: TracksSettings) -> MlflowClient:
    """A client bound to this deployment's tracking store and model registry (same database)."""
    from mlflow import MlflowClient

    configure_mlflow(settings)
    return MlflowClient(
        tracking_uri=settings.mlflow_tracking_uri, registry_uri=settings.mlflow_tracking_uri
    )


def get_or_create_experiment(client: MlflowClient, settings: TracksSettings, name: str) -> str:
    """The id of experiment ``name``, created with its artifacts under the artifact root."""
    from mlflow.entities import LifecycleStage
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = (settings.mlflow_artifact_root / name).resolve().as_uri()
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:
            # Another process (a parallel Dagster step) created it first.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise exc from None
    if experiment.lifecycle_stage == LifecycleStage.DELETED:
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


_INVALID_KEY_CHARS = re.compile(r"[^\w./\- ]")


def mlflow_key(name: str) -> str:
    """MLflow-safe metric name: ``accuracy@0.1`` -> ``accuracy_at_0.1``, ``class=3`` -> ``class_3``.

    MLflow allows only letters, digits, ``_ - . / :`` and spaces in metric names.
    """
    return _INVALID_KEY_CHARS.sub("_", name.replace("@", "_at_"))
