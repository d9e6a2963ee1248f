"""The text-lm family's whole path in Dagster, as `tracks demo --family text-lm` runs it, on the
tiny config: landing → text snapshot → checks → training → checkpoint → three evaluations →
the family's own champion, its explain page with every provenance field filled, and the
generation evaluation reproduced from its record alone."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from definitions import build_definitions
from pipeline.cli import main
from pipeline.data.families import TEXT, landing_dir_for
from pipeline.data.snapshot import snapshot_id_for
from pipeline.explain import explain
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from pipeline.textlm.landing import write_text_landing
from pipeline.trainer.config import named_config
from sensors import materialize_snapshot
from tests.dagster_dev import check_evaluations

pytestmark = pytest.mark.slow


def test_a_text_partition_trains_evaluates_and_crowns_the_text_lm_champion(
    tracks_home: Path,
) -> None:
    settings = TracksSettings.from_env()
    text_dir = landing_dir_for(settings.landing_root, TEXT)
    write_text_landing(text_dir)
    snapshot = snapshot_id_for(text_dir, family=TEXT)
    assert snapshot.startswith("text-")
    # The tiny config (30 steps, one narrow block) over the family's own starting point.
    tiny = {**named_config("text-lm-tiny"), "lr_schedule": {"warmup_steps": 0}}
    run_config = {"ops": {"training_attempt": {"config": {"train": tiny}}}}

    with dg.DagsterInstance.get() as instance:
        result = materialize_snapshot(
            build_definitions(settings), instance, snapshot, run_config=run_config
        )
        assert result.success, [
            e.step_failure_data.error.message for e in result.all_events if e.is_step_failure
        ]
        checks = {name: e.passed for name, e in check_evaluations(result).items()}
        assert all(checks.values()), checks
        assert {"schema_contract", "data_quality", "provenance_complete"} <= checks.keys()
        [promoted] = result.asset_materializations_for_node("promoted_model")
    assert promoted.metadata["model_name"].value == "text-lm"
    run_id = promoted.metadata["run_id"].value

    client = MlflowClient(settings.mlflow_tracking_uri)
    champion = client.get_model_version_by_alias("text-lm", "champion")
    assert str(champion.version) == str(promoted.metadata["model_version"].value)
    # The digits' registered model is another family's: nothing was registered there.
    assert not client.search_model_versions("name='digits-classifier'")

    ledger = Ledger(settings.ledger_url)
    evaluations = {e.evaluator_name: e for e in ledger.evaluations_for_run(run_id)}
    assert set(evaluations) == {"heldout_bits_per_byte", "generation_judged", "contamination"}
    page = explain(ledger, run_id)
    generation = evaluations["generation_judged"]
    line = next(x for x in page.splitlines() if x.startswith(f"- `{generation.evaluation_id}`"))
    for field in ("prompt set", "template", "greedy decoding", "sampled decoding", "seed", "judge"):
        assert field in line, (field, line)
    assert "Not applicable: nothing; every field is filled." in page
    assert "missing provenance" in page and "| none |" in page
    assert "against training snapshot `" + snapshot in page
    assert f"**promoted** as text-lm version {champion.version}" in page

    reproduced = CliRunner().invoke(main, ["reproduce", generation.evaluation_id])
    assert reproduced.exit_code == 0, reproduced.output
    assert "identical" in reproduced.output
