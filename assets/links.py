"""Links from an asset's metadata to the MLflow UI pages of what it recorded.

A ``MetadataValue.url`` is a link the Dagster UI opens in a new tab, in the asset's metadata and
in the run's event log alike. Where no MLflow UI address is known (``TRACKS_MLFLOW_UI_URL`` is
unset and the tracking URI is a database, not a server), the whole MLflow run id is shown as
text instead, with the variable that turns it into a link.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

from pipeline import envvars
from resources import MlflowResource

_NO_UI = f"(set {envvars.TRACKS_MLFLOW_UI_URL.name} for a link to the MLflow UI)"


def _ui_base(mlflow: MlflowResource) -> str | None:
    from pipeline.mlflow_setup import mlflow_ui_url

    return mlflow_ui_url(mlflow.tracking_uri)


def _run_link(mlflow: MlflowResource, experiment_id: str, mlflow_run_id: str) -> dg.MetadataValue:
    from pipeline.mlflow_setup import mlflow_run_url

    base = _ui_base(mlflow)
    if base is None:
        return dg.MetadataValue.text(f"MLflow run {mlflow_run_id} {_NO_UI}")
    return dg.MetadataValue.url(mlflow_run_url(base, experiment_id, mlflow_run_id))


def _client(mlflow: MlflowResource) -> Any:
    from mlflow import MlflowClient

    from pipeline.mlflow_setup import store_ready

    store_ready(mlflow.tracking_uri)
    return MlflowClient(tracking_uri=mlflow.tracking_uri, registry_uri=mlflow.tracking_uri)


def mlflow_training_link(mlflow: MlflowResource, run_id: str) -> dict[str, dg.MetadataValue]:
    """``{"mlflow_training_run": link}`` for ledger run ``run_id``; empty when MLflow has no
    training run for it (tracking was off) or cannot be read: a link is never worth failing
    the asset over."""
    from pipeline.tracking import training_run_of

    try:
        client = _client(mlflow)
        found = training_run_of(client, run_id)
        if found is None:
            return {}
        experiment_id = client.get_run(found).info.experiment_id
        return {"mlflow_training_run": _run_link(mlflow, experiment_id, found)}
    except Exception:
        return {}


def mlflow_evaluation_links(
    mlflow: MlflowResource, records: Sequence[Any]
) -> dict[str, dg.MetadataValue]:
    """``{"<evaluator>/mlflow_run": link}`` for each evaluation record with an MLflow run."""
    links: dict[str, dg.MetadataValue] = {}
    try:
        client = _client(mlflow)
        for record in records:
            if record.mlflow_run_id:
                experiment_id = client.get_run(record.mlflow_run_id).info.experiment_id
                links[f"{record.evaluator_name}/mlflow_run"] = _run_link(
                    mlflow, experiment_id, record.mlflow_run_id
                )
    except Exception:
        return links
    return links


def mlflow_model_version_link(
    mlflow: MlflowResource, model_name: str, version: str | None
) -> dict[str, dg.MetadataValue]:
    """``{"mlflow_model_version": link}`` for a registered version; empty without one."""
    if not version:
        return {}
    base = _ui_base(mlflow)
    if base is None:
        return {
            "mlflow_model_version": dg.MetadataValue.text(
                f"models:/{model_name}/{version} {_NO_UI}"
            )
        }
    from pipeline.mlflow_setup import mlflow_model_version_url

    url = mlflow_model_version_url(base, model_name, version)
    return {"mlflow_model_version": dg.MetadataValue.url(url)}
