"""The one place Tracks configures MLflow: URIs, quiet logging, experiments, metric names, links.

Everything else asks :func:`mlflow_client` for a client with explicit URIs. The fluent API is
only used where MLflow offers nothing else (``Model.log`` resolves its store from the process,
and ``pyfunc.load_model("models:/…")`` for readers), so the process-wide URIs are set here too.

Every experiment Tracks creates goes through :func:`ensure_experiment`, which marks it a
machine-learning experiment (``mlflow.experimentKind``), so MLflow's UI opens it on the runs
table, not on the GenAI traces view. MLflow 3.17's UI decides in two places, both read from its
bundled JavaScript (``mlflow/server/js/build/static/js``): a global "workflow type" switch in
the side bar (``genai`` unless chosen otherwise, kept in the browser's local storage as
``mlflow.workflowType_v1``, overridden by a ``?workflowType=`` query), which this version reads
first, and the experiment's ``mlflow.experimentKind`` tag (``custom_model_development`` for
"Machine learning", the value the UI writes itself when a person picks it), which the versions
before it read and which names the experiment's kind in the experiment list. So the tag is set,
and every link Tracks makes carries ``?workflowType=machine_learning`` (:func:`mlflow_run_url`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

from pipeline import envvars

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from pipeline.settings import TracksSettings

EVALUATION_EXPERIMENT = "tracks-evaluation"
CHAMPION_ALIAS = "champion"
DEFAULT_MODEL_NAME = "digits-classifier"

# The experiment tag MLflow's UI reads for an experiment's kind, and its "Machine learning" value.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MACHINE_LEARNING_KIND = "custom_model_development"
# The query that opens MLflow 3.17's UI in its "Machine learning" workflow, whatever a browser
# last chose (the UI's default is GenAI).
MACHINE_LEARNING_VIEW = "workflowType=machine_learning"

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
    store_ready(settings.mlflow_tracking_uri)
    return MlflowClient(
        tracking_uri=settings.mlflow_tracking_uri, registry_uri=settings.mlflow_tracking_uri
    )


_ready: set[str] = set()


def store_ready(tracking_uri: str) -> None:
    """Make sure MLflow's SQLite store exists with its whole schema before this process uses it.

    MLflow creates a SQLite store's tables the first time a process opens it, one statement at a
    time and in no lock of its own. Two processes opening a new ``mlflow.db`` together (a Dagster
    step and the trainer's tracker thread) fail with "table ... already exists", and a trainer
    killed while it creates them (the preemption drill's SIGKILL, 2026-11-27) leaves a store
    that every later process fails to open. So a missing store is created whole, under an
    exclusive ``flock`` on ``<db>.lock``, in a staging file renamed into place: a reader finds
    no store or a complete one. Once per process per store. PostgreSQL stores are left to
    MLflow (its migrations there run in transactions).
    """
    if tracking_uri in _ready or not tracking_uri.startswith("sqlite:"):
        return
    from sqlalchemy.engine import make_url

    from pipeline.durable import exclusive_lock

    database = make_url(tracking_uri).database
    if not database or database == ":memory:":
        return
    with _lock:
        if tracking_uri in _ready:
            return
        path = Path(database)
        with exclusive_lock(Path(f"{database}.lock")):
            if not path.exists():
                _create_store(path)
        _ready.add(tracking_uri)


def _create_store(path: Path) -> None:
    from mlflow import MlflowClient
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from pipeline.durable import fsync_dir, fsync_file

    staging = path.with_name(f".{path.name}.creating-{os.getpid()}")
    staging.unlink(missing_ok=True)
    uri = f"sqlite:///{staging}"
    staging_file = staging.resolve()

    def unsynced(dbapi_connection: object, _record: object) -> None:
        # MLflow's ~50 schema migrations commit one by one, each an fsync of the journal and
        # the file: 10-20 s on a busy disk, for a file nobody can see yet. The staging file
        # is synced once below, before it is renamed into place; a crash before that leaves
        # only the staging file, which the next creation removes. Only this file's
        # connections: the listener sees every engine of the process while it is installed.
        cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
        try:
            cursor.execute("PRAGMA database_list")
            if any(row[2] and Path(row[2]).resolve() == staging_file for row in cursor.fetchall()):
                cursor.execute("PRAGMA synchronous=OFF")
                cursor.execute("PRAGMA journal_mode=MEMORY")
        finally:
            cursor.close()

    event.listen(Engine, "connect", unsynced)
    try:
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        client.search_experiments(max_results=1)  # the tracking store creates its tables
        client.search_registered_models(max_results=1)  # and the registry its own
    finally:
        event.remove(Engine, "connect", unsynced)
    fsync_file(staging)
    os.replace(staging, path)
    fsync_dir(path.parent)


def get_or_create_experiment(client: MlflowClient, settings: TracksSettings, name: str) -> str:
    """The id of experiment ``name``, created with its artifacts under the artifact root."""
    location = (settings.mlflow_artifact_root / name).resolve().as_uri()
    return ensure_experiment(client, name, location)


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The id of experiment ``name``: created (artifacts at ``artifact_location``, MLflow's
    default when None) or restored if deleted, and marked a machine-learning experiment."""
    from mlflow.entities import LifecycleStage
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(
                name,
                artifact_location=artifact_location,
                tags={EXPERIMENT_KIND_TAG: MACHINE_LEARNING_KIND},
            )
        except MlflowException as exc:
            # Another process (a parallel Dagster step) created it first.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise exc from None
    if experiment.lifecycle_stage == LifecycleStage.DELETED:
        client.restore_experiment(experiment.experiment_id)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != MACHINE_LEARNING_KIND:
        # An experiment made before Tracks set the kind, or one the UI guessed "GenAI" for.
        client.set_experiment_tag(
            experiment.experiment_id, EXPERIMENT_KIND_TAG, MACHINE_LEARNING_KIND
        )
    return experiment.experiment_id


def mlflow_ui_url(tracking_uri: str) -> str | None:
    """The MLflow UI's address: ``TRACKS_MLFLOW_UI_URL``, else ``tracking_uri`` when it is an
    ``http(s)`` server (without a user or password), else None (a database has no UI)."""
    configured = envvars.TRACKS_MLFLOW_UI_URL.get()
    if configured:
        return configured.rstrip("/")
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def mlflow_run_url(ui_base: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of one run, in the UI's machine-learning view."""
    return (
        f"{ui_base.rstrip('/')}/#/experiments/{quote(str(experiment_id), safe='')}"
        f"/runs/{quote(run_id, safe='')}?{MACHINE_LEARNING_VIEW}"
    )


def mlflow_model_version_url(ui_base: str, model_name: str, version: str) -> str:
    """The MLflow UI page of one registered model version (its source run, signature, tags)."""
    return (
        f"{ui_base.rstrip('/')}/#/models/{quote(model_name, safe='')}"
        f"/versions/{quote(str(version), safe='')}?{MACHINE_LEARNING_VIEW}"
    )


def dagster_run_url(dagster_run_id: str) -> str:
    """The Dagster UI page of a run (``TRACKS_DAGSTER_URL``), for MLflow tags that lead back."""
    base = envvars.TRACKS_DAGSTER_URL.get() or "http://127.0.0.1:3000"
    return f"{base.rstrip('/')}/runs/{quote(dagster_run_id, safe='')}"


_INVALID_KEY_CHARS = re.compile(r"[^\w./\- ]")


def mlflow_key(name: str) -> str:
    """MLflow-safe metric name: ``accuracy@0.1`` -> ``accuracy_at_0.1``, ``class=3`` -> ``class_3``.

    MLflow allows only letters, digits, ``_ - . / :`` and spaces in metric names.
    """
    return _INVALID_KEY_CHARS.sub("_", name.replace("@", "_at_"))
