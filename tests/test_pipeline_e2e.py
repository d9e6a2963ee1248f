"""The whole path in Dagster: snapshot → checks → train → checkpoint → evaluate → promote.

Runs on the embedded default (SQLite everywhere) and on PostgreSQL (Dagster's instance through
deploy/dagster-postgres.yaml, the ledger and MLflow's tracking and registry store).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pytest
from mlflow import MlflowClient

from definitions import build_definitions
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from sensors import materialize_snapshot
from tests.dagster_dev import REPO_ROOT, check_evaluations

pytestmark = pytest.mark.slow

FAST_TRAINING = {"ops": {"training_attempt": {"config": {"train": {"max_steps": 300}}}}}


@pytest.fixture(params=["sqlite", "postgresql"])
def deployment(
    request: pytest.FixtureRequest,
    tracks_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    if request.param == "postgresql":
        make_db: Callable[[], str] = request.getfixturevalue("make_pg_database")
        monkeypatch.setenv("TRACKS_LEDGER_URL", make_db())
        monkeypatch.setenv("TRACKS_MLFLOW_URI", make_db())
        monkeypatch.setenv("TRACKS_DAGSTER_PG_URL", make_db())
        shutil.copyfile(
            REPO_ROOT / "deploy" / "dagster-postgres.yaml",
            tracks_home / "dagster" / "dagster.yaml",
        )
    return request.param


def test_whole_path_promotes_a_champion_whose_tags_lead_back(deployment: str) -> None:
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root)
    snapshot = snapshot_id_for(settings.landing_root)
    defs = build_definitions(settings)

    with dg.DagsterInstance.get() as instance:
        if deployment == "postgresql":
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        result = materialize_snapshot(defs, instance, snapshot, run_config=FAST_TRAINING)
        assert result.success, [
            e.step_failure_data.error.message for e in result.all_events if e.is_step_failure
        ]
        checks = {name: e.passed for name, e in check_evaluations(result).items()}
        assert checks["schema_contract"] and checks["data_quality"]
        # Pictures and tables, not JSON: what a person sees on each materialization in the UI.
        shown = {
            "training_attempt": (["loss_curve"], ["checkpoint_lineage"]),
            "evaluation": (
                ["explain"],
                ["results", "holdout_accuracy/slices", "holdout_accuracy/confusion_matrix"],
            ),
            "promoted_model": (["decision_against_champion"], ["gate_rules"]),
        }
        for node, (pictures, tables) in shown.items():
            [materialization] = result.asset_materializations_for_node(node)
            for key in pictures:
                value = materialization.metadata[key]
                assert isinstance(value, dg.MarkdownMetadataValue), (node, key, value)
            for key in tables:
                value = materialization.metadata[key]
                assert isinstance(value, dg.TableMetadataValue) and value.records, (node, key)
        loss_curve = result.asset_materializations_for_node("training_attempt")[0].metadata
        assert loss_curve["loss_curve"].value.startswith("![loss curve](data:image/svg+xml,")

    ledger = Ledger.open(settings.ledger_url)
    [run] = ledger.find_runs(snapshot_id=snapshot)
    [attempt] = ledger.attempts(run.run_id)
    assert attempt.termination_reason == "succeeded"
    assert attempt.dagster_run_id == result.run_id
    final = ledger.latest_committed_checkpoint(run.run_id)
    assert final is not None and final.step == 300
    assert (Path(final.path) / "COMMITTED").exists()

    [promotion] = ledger.promotions(run_id=run.run_id)
    assert promotion.decision == "promoted"
    client = MlflowClient(settings.mlflow_tracking_uri, settings.mlflow_tracking_uri)
    champion = client.get_model_version_by_alias(promotion.model_name, "champion")
    assert str(champion.version) == promotion.model_version
    tags = champion.tags
    assert tags["tracks.run_id"] == run.run_id
    assert tags["tracks.attempt_no"] == "1"
    assert tags["tracks.checkpoint_manifest_sha256"] == final.manifest_sha256
    assert tags["tracks.snapshot_id"] == snapshot
    # The training run is one MLflow run with its curves, found by the ledger run id.
    from pipeline.tracking import RUN_TAG, TRAINING_EXPERIMENT

    experiment = client.get_experiment_by_name(TRAINING_EXPERIMENT)
    [training] = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run.run_id}'"
    )
    assert len(client.get_metric_history(training.info.run_id, "loss")) > 0
    assert tags["tracks.training_mlflow_run"] == training.info.run_id
    evaluations = ledger.evaluations_for_checkpoint(final.manifest_sha256)
    assert {e.evaluator_name for e in evaluations} == {"holdout_accuracy", "noise_robustness"}
    assert set(tags["tracks.evaluation_ids"].split(",")) == {e.evaluation_id for e in evaluations}
    for evaluation in evaluations:
        assert evaluation.missing_provenance() == []
        assert evaluation.mlflow_run_id
