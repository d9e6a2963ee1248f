"""Tables, not Markdown, where a materialization lists rows: typed columns the Dagster UI shows
with its schema, and every number the ledger holds, unrounded.

One real in-process materialization of the whole graph gives the snapshot's files, the
evaluation's results and slices and the training attempt's checkpoint lineage; a real promotion
against a champion gives the gate's rules (threshold, paired headline, slices).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets.promotion import promotion_metadata
from definitions import build_definitions
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import open_snapshot, snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from pipeline.states import PromotionDecision
from sensors import materialize_snapshot
from tests.evaluation_support import (
    World,
    open_ledger,
    shared_world,
    without_class,
    write_checkpoint,
)
from tests.promotion_support import evaluate_checkpoint, promote_checkpoint

pytestmark = pytest.mark.slow

# Checkpoints at steps 100, 200 and 300: the lineage has parents to show.
TRAINING = {"ops": {"training_attempt": {"config": {"train": {"max_steps": 300}}}}}


@dataclass(frozen=True)
class Materialized:
    settings: TracksSettings
    snapshot_id: str
    metadata: dict[str, dict[str, Any]]  # node -> its materialization's metadata


@pytest.fixture(scope="module")
def materialized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Materialized]:
    home = tmp_path_factory.mktemp("tables") / "tracks"
    (home / "dagster").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRACKS_HOME", str(home))
        env.setenv("DAGSTER_HOME", str(home / "dagster"))
        for name in ("TRACKS_LEDGER_URL", "TRACKS_MLFLOW_URI", "TRACKS_ENV"):
            env.delenv(name, raising=False)
        settings = TracksSettings.from_env()
        write_digits_landing(settings.landing_root)
        snapshot = snapshot_id_for(settings.landing_root)
        with dg.DagsterInstance.get() as instance:
            result = materialize_snapshot(
                build_definitions(settings), instance, snapshot, run_config=TRAINING
            )
        assert result.success, [
            e.step_failure_data.error.message for e in result.all_events if e.is_step_failure
        ]
        metadata = {
            node: dict(result.asset_materializations_for_node(node)[0].metadata)
            for node in ("data_snapshot", "training_attempt", "evaluation")
        }
        yield Materialized(settings, snapshot, metadata)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return shared_world(tmp_path_factory.getbasetemp())


def _schema(value: Any) -> list[tuple[str, str]]:
    assert isinstance(value, dg.TableMetadataValue), type(value)
    return [(c.name, c.type) for c in value.schema.columns]


def _rows(value: dg.TableMetadataValue) -> list[dict[str, Any]]:
    return [dict(r.data) for r in value.records]


def test_the_snapshot_files_are_a_table_with_every_byte_count_row_count_and_digest(
    materialized: Materialized,
) -> None:
    files = materialized.metadata["data_snapshot"]["files"]
    assert _schema(files) == [
        ("name", "string"),
        ("bytes", "int"),
        ("rows", "int"),
        ("sha256", "string"),
    ]
    snapshot = open_snapshot(materialized.settings.snapshot_root / materialized.snapshot_id)
    expected = [
        {"name": f["name"], "bytes": f["bytes"], "rows": f["rows"], "sha256": f["sha256"]}
        for f in snapshot.manifest["files"]
    ]
    assert expected and _rows(files) == expected  # the whole digest, not its first 16 digits


def test_the_evaluation_results_are_one_row_per_evaluator_with_each_metric_a_column(
    materialized: Materialized,
) -> None:
    meta = materialized.metadata["evaluation"]
    ledger = Ledger.open(materialized.settings.ledger_url)
    [run] = ledger.find_runs(snapshot_id=materialized.snapshot_id)
    evaluations = {
        e.evaluator_name: e
        for e in ledger.evaluations_for_run(run.run_id)
        if e.status == "complete"
    }
    metric_names = sorted({k for e in evaluations.values() for k in e.metrics})
    schema = _schema(meta["results"])
    assert schema[:4] == [
        ("evaluator", "string"),
        ("evaluator_version", "string"),
        ("evaluation_id", "string"),
        ("mlflow_run_id", "string"),
    ]
    assert [name for name, _ in schema[4:]] == metric_names
    assert dict(schema)["examples"] == "int" and dict(schema)["accuracy@0.1"] == "float"

    rows = {row["evaluator"]: row for row in _rows(meta["results"])}
    assert set(rows) == {"holdout_accuracy", "noise_robustness"} == set(evaluations)
    for name, row in rows.items():
        evaluation = evaluations[name]
        assert row["evaluation_id"] == evaluation.evaluation_id
        assert row["evaluator_version"] == evaluation.evaluator_version
        assert row["mlflow_run_id"] == evaluation.mlflow_run_id
        # Every metric unrounded in its own column; empty where the evaluator has none.
        assert {k: row[k] for k in metric_names} == {
            k: evaluation.metrics.get(k) for k in metric_names
        }

    slices = meta["holdout_accuracy/slices"]
    assert _schema(slices) == [("slice", "string"), ("accuracy", "float"), ("support", "int")]
    holdout = evaluations["holdout_accuracy"].slice_metrics
    assert _rows(slices) == [
        {"slice": name, "accuracy": v["accuracy"], "support": int(v["support"])}
        for name, v in sorted(holdout.items())
    ]
    noise = [row["slice"] for row in _rows(meta["noise_robustness/slices"])]
    assert noise == sorted(evaluations["noise_robustness"].slice_metrics)
    # A matrix reads across and down: it stays a Markdown picture with its diagonal in bold.
    assert isinstance(meta["holdout_accuracy/confusion_matrix"], dg.MarkdownMetadataValue)


def test_the_checkpoint_lineage_is_one_row_per_checkpoint_with_its_parent_and_metrics(
    materialized: Materialized,
) -> None:
    lineage = materialized.metadata["training_attempt"]["checkpoint_lineage"]
    ledger = Ledger.open(materialized.settings.ledger_url)
    [run] = ledger.find_runs(snapshot_id=materialized.snapshot_id)
    checkpoints = ledger.checkpoints(run.run_id)
    metric_names = sorted({k for c in checkpoints for k in c.metrics or {}})
    assert "train_loss" in metric_names
    assert _schema(lineage) == [
        ("step", "int"),
        ("attempt", "int"),
        ("state", "string"),
        ("checkpoint", "string"),
        ("parent", "string"),
        ("manifest_sha256", "string"),
        *[(name, "float") for name in metric_names],
    ]
    assert _rows(lineage) == [
        {
            "step": c.step,
            "attempt": c.attempt_no,
            "state": c.state,
            "checkpoint": Path(c.path).name,
            "parent": Path(c.parent_path).name if c.parent_path else None,
            "manifest_sha256": c.manifest_sha256,
            **{name: (c.metrics or {}).get(name) for name in metric_names},
        }
        for c in checkpoints
    ]
    rows = _rows(lineage)
    assert [(row["step"], row["attempt"]) for row in rows] == [(100, 1), (200, 1), (300, 1)]
    assert rows[-1]["state"] == "committed"
    # Each checkpoint names the one before it as the one it built on.
    assert [row["parent"] for row in rows] == [None, rows[0]["checkpoint"], rows[1]["checkpoint"]]


def test_the_gate_rules_are_a_table_of_thresholds_the_paired_headline_and_each_slice(
    world: World, tmp_path: Path
) -> None:
    runs = ("run-tables-champion", "run-tables-candidate")
    name = "digits-gate-rules-table"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, *runs)
    champion = write_checkpoint(tmp_path / "champion", world.good_state, run_id=runs[0])
    [champion_holdout, _] = evaluate_checkpoint(world, ledger, champion, runs[0])
    assert promote_checkpoint(world, ledger, champion, runs[0], name).model_version == "1"
    spoiled = without_class(world.good_state, 3)
    candidate = write_checkpoint(tmp_path / "candidate", spoiled, run_id=runs[1])
    evaluate_checkpoint(world, ledger, candidate, runs[1])

    record = promote_checkpoint(world, ledger, candidate, runs[1], name)

    assert record.decision == PromotionDecision.REFUSED
    metadata = promotion_metadata(record)
    rules = metadata["gate_rules"]
    assert _schema(rules) == [
        ("rule", "string"),
        ("this_checkpoint", "float"),
        ("reference", "float"),
        ("difference", "float"),
        ("needs", "string"),
        ("passed", "bool"),
        ("interval_low", "float"),
        ("interval_high", "float"),
        ("n", "int"),
        ("result", "string"),
    ]
    rows = {row["rule"]: row for row in _rows(rules)}
    gate = record.gate
    for check in gate["thresholds"]:
        row = rows[check["metric"]]
        assert (row["this_checkpoint"], row["reference"]) == (check["value"], check["threshold"])
        assert row["passed"] is check["passed"]

    headline = gate["headline_comparison"]
    paired = rows["holdout_accuracy.accuracy against the champion, paired"]
    low, high = headline["interval"]
    assert paired == {
        "rule": "holdout_accuracy.accuracy against the champion, paired",
        "this_checkpoint": headline["candidate"],
        "reference": headline["champion"],
        "difference": headline["difference"],
        "needs": f"difference >= -{headline['margin']:g} and the 95% interval's upper bound >= 0",
        "passed": False,
        "interval_low": low,
        "interval_high": high,
        "n": headline["n"],
        "result": "failed",
    }

    slices = [row for rule, row in rows.items() if " slice " in rule]
    assert len(slices) == len(gate["slice_comparisons"]) == 10 + 5  # classes, noise levels
    collapsed = rows["holdout_accuracy slice class=3"]
    champion_accuracy = champion_holdout.slice_metrics["class=3"]["accuracy"]
    assert collapsed["reference"] == champion_accuracy and collapsed["this_checkpoint"] == 0.0
    assert (collapsed["passed"], collapsed["result"]) == (False, "regressed")
    assert collapsed["difference"] == pytest.approx(-champion_accuracy)
    # The sentence stays Markdown, naming the decision and the champion it was made against.
    decision = metadata["decision_against_champion"]
    assert isinstance(decision, dg.MarkdownMetadataValue)
    assert decision.value.startswith("**refused** (against champion version 1)")
