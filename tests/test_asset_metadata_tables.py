"""Tables, not Markdown, where a materialization lists rows: typed columns the Dagster UI shows
with its schema, and every number the ledger holds, unrounded.

One real in-process materialization of the whole graph gives the snapshot's files, the
evaluation's results and slices and the training attempt's checkpoint lineage; a real promotion
against a champion gives the gate's rules (threshold, paired headline, slices). A second run of
training_attempt alone, with two keys changed, gives a config to compare with the first.

The same materializations answer how the UI shows them: no JSON or Markdown value a person must
scroll (the run's explain page aside), numbers only where a plot means something, the loss curve
inline, links to MLflow, and the run's page on the asset a person looks at last.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import dagster as dg
import pytest

from assets.partitions import ASSET_GROUP
from assets.promotion import promotion_metadata
from assets.tables import COUNT_METRICS
from definitions import build_definitions
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import open_snapshot, snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.mlflow_setup import mlflow_client, mlflow_model_version_url, mlflow_run_url
from pipeline.plots import loss_curve_markdown
from pipeline.settings import TracksSettings
from pipeline.states import PromotionDecision
from pipeline.tracking import training_run_of
from sensors import materialize_snapshot
from tests.evaluation_support import (
    World,
    open_ledger,
    shared_world,
    without_class,
    write_checkpoint,
)
from tests.promotion_support import evaluate_checkpoint, promote_checkpoint
from tests.receipt_support import train_alone

pytestmark = pytest.mark.slow

# Checkpoints at steps 100, 200 and 300: the lineage has parents to show.
TRAINING = {"ops": {"training_attempt": {"config": {"train": {"max_steps": 300}}}}}
# The second run: two keys changed, few steps (its config is what it is for).
SECOND = {"max_steps": 20, "learning_rate": 0.01}
SECOND_RUN = "training_attempt, second run"
MLFLOW_UI = "http://127.0.0.1:5099"
NODES = (
    "data_snapshot",
    "training_attempt",
    "committed_checkpoint",
    "evaluation",
    "promoted_model",
)


@dataclass(frozen=True)
class Materialized:
    settings: TracksSettings
    snapshot_id: str
    metadata: dict[str, dict[str, Any]]  # node (or SECOND_RUN) -> its materialization's metadata


@pytest.fixture(scope="module")
def materialized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Materialized]:
    home = tmp_path_factory.mktemp("tables") / "tracks"
    (home / "dagster").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRACKS_HOME", str(home))
        env.setenv("DAGSTER_HOME", str(home / "dagster"))
        for name in ("TRACKS_LEDGER_URL", "TRACKS_MLFLOW_URI", "TRACKS_ENV"):
            env.delenv(name, raising=False)
        env.setenv("TRACKS_MLFLOW_UI_URL", MLFLOW_UI)
        settings = TracksSettings.from_env()
        write_digits_landing(settings.landing_root)
        snapshot = snapshot_id_for(settings.landing_root)
        with dg.DagsterInstance.get() as instance:
            result = materialize_snapshot(
                build_definitions(settings), instance, snapshot, run_config=TRAINING
            )
            assert result.success, _failures(result)
            second = train_alone(settings, instance, snapshot, {"train": SECOND})
            assert second.success, _failures(second)
        metadata = {
            node: dict(result.asset_materializations_for_node(node)[0].metadata) for node in NODES
        }
        [attempt] = second.asset_materializations_for_node("training_attempt")
        metadata[SECOND_RUN] = dict(attempt.metadata)
        yield Materialized(settings, snapshot, metadata)


def _failures(result: dg.ExecuteInProcessResult) -> list[str]:
    return [e.step_failure_data.error.message for e in result.all_events if e.is_step_failure]


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
    run = ledger.get_run(materialized.metadata["training_attempt"]["run_id"].value)
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
    # A matrix reads across and down: true labels down, predicted across, the diagonal apart.
    matrix = meta["holdout_accuracy/confusion_matrix"]
    labels = [str(n) for n in range(10)]
    assert _schema(matrix) == [
        ("label", "string"),
        *[(n, "int") for n in labels],
        ("correct", "int"),
        ("examples", "int"),
    ]
    rows = _rows(matrix)
    assert [row["label"] for row in rows] == labels
    assert all(row["correct"] == row[row["label"]] for row in rows)
    assert (
        sum(row["examples"] for row in rows) == evaluations["holdout_accuracy"].metrics["examples"]
    )
    assert sum(row["correct"] for row in rows) == pytest.approx(
        evaluations["holdout_accuracy"].metrics["accuracy"] * sum(r["examples"] for r in rows)
    )


def test_the_checkpoint_lineage_is_one_row_per_checkpoint_with_its_parent_and_metrics(
    materialized: Materialized,
) -> None:
    lineage = materialized.metadata["training_attempt"]["checkpoint_lineage"]
    ledger = Ledger.open(materialized.settings.ledger_url)
    run = ledger.get_run(materialized.metadata["training_attempt"]["run_id"].value)
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
    # Every field of the paired comparison, as recorded; the rest of the gate record beside it.
    fields = {row["field"]: row["value"] for row in _rows(metadata["headline_comparison"])}
    assert fields == {k: json.dumps(v) if isinstance(v, list) else v for k, v in headline.items()}
    gate_fields = {row["field"] for row in _rows(metadata["gate"])}
    assert "champion_version" in gate_fields and "gate.max_slice_regression" in gate_fields
    assert not any(f.startswith(("thresholds", "slice_comparisons")) for f in gate_fields)


# -- how the UI shows them ----------------------------------------------------------------------

# What each node may report as a number (the UI plots every number over materializations).
PLOTTED = {
    "training_attempt": {"first_loss", "final_loss", "examples_per_second"},
    "committed_checkpoint": {"bytes", "metrics/eval_accuracy", "metrics/eval_loss",
                             "metrics/train_loss"},
    "promoted_model": set(),
}  # fmt: skip


def _lines(value: Any) -> int:
    if isinstance(value, dg.JsonMetadataValue):
        # As the UI shows it: pretty-printed.
        return json.dumps(value.value, indent=2).count("\n") + 1
    return str(value.value).count("\n") + 1


def test_no_json_or_markdown_value_runs_longer_than_ten_lines_but_the_explain_page(
    materialized: Materialized,
) -> None:
    too_long = [
        (node, key, _lines(value))
        for node, metadata in materialized.metadata.items()
        for key, value in metadata.items()
        if isinstance(value, dg.JsonMetadataValue | dg.MarkdownMetadataValue)
        and key != "explain"
        and _lines(value) > 10
    ]
    assert too_long == []


def test_numbers_are_metrics_worth_plotting_and_identifiers_are_text(
    materialized: Materialized,
) -> None:
    meta = materialized.metadata
    plotted = dg.IntMetadataValue | dg.FloatMetadataValue
    numbers = {
        node: {k for k, v in meta[node].items() if isinstance(v, plotted)}
        for node in (*PLOTTED, "evaluation")
    }
    assert {node: numbers[node] for node in PLOTTED} == PLOTTED
    # Each evaluator's scores, never a count of examples.
    assert numbers["evaluation"] and all(
        "/" in key and key.split("/", 1)[1] not in COUNT_METRICS for key in numbers["evaluation"]
    )
    assert isinstance(meta["evaluation"]["holdout_accuracy/accuracy"], dg.FloatMetadataValue)
    for node, key, shown in [
        ("training_attempt", "attempt_no", "1"),
        ("training_attempt", "restored_step", "0"),
        ("committed_checkpoint", "attempt_no", "1"),
        ("committed_checkpoint", "step", "300"),
        ("promoted_model", "attempt_no", "1"),
    ]:
        value = meta[node][key]
        assert (type(value), value.value) == (dg.TextMetadataValue, shown), (node, key)


def test_the_loss_curve_is_an_image_the_ui_shows_inline_with_its_numbers_beside_it(
    materialized: Materialized,
) -> None:
    meta = materialized.metadata["training_attempt"]
    curve = meta["loss_curve"]
    # Dagster's UI shows a Markdown value in the metadata table only under 1,000 characters.
    assert isinstance(curve, dg.MarkdownMetadataValue) and len(curve.value) < 1000
    prefix = "![loss curve](data:image/svg+xml,"
    assert curve.value.startswith(prefix) and curve.value.endswith(")")
    svg = ET.fromstring(unquote(curve.value[len(prefix) : -1]))
    paths = {p.get("stroke"): p.get("d") for p in svg.iter("{http://www.w3.org/2000/svg}path")}
    # 30 reports (every 10 steps) and the three committed checkpoints, dotted.
    assert paths["steelblue"].count(",") == 30
    assert paths["grey"].count("M") == 3
    rows = _rows(meta["loss_by_step"])
    assert len(rows) == 10 and (rows[0]["step"], rows[-1]["step"]) == (10, 300)
    assert (rows[0]["loss"], rows[-1]["loss"]) == (
        meta["first_loss"].value,
        meta["final_loss"].value,
    )
    # A long run is downsampled, never pushed behind a click: 5,000 reports, 50 checkpoints.
    long_run = [{"step": n, "loss": 1 / n} for n in range(1, 5001)]
    assert len(loss_curve_markdown(long_run, range(100, 5001, 100))) < 1000
    # One line of text the run's event log shows whole, where it shows no picture.
    line = meta["loss"].value
    assert isinstance(meta["loss"], dg.TextMetadataValue) and "\n" not in line
    assert line.startswith(f"{rows[0]['loss']:.4g} ") and "(steps 10-300, 30 report(s)" in line


def test_the_config_is_a_table_beside_the_previous_runs_changed_keys_first(
    materialized: Materialized,
) -> None:
    first, second = materialized.metadata["training_attempt"], materialized.metadata[SECOND_RUN]
    assert first["config_compared_with"].value == "nothing: the first run of family digits-cnn"
    assert {row["changed"] for row in _rows(first["config"])} == {None}
    rows = _rows(second["config"])
    assert [(r["key"], r["value"], r["previous"], r["changed"]) for r in rows[:2]] == [
        ("max_steps", "20", "300", True),
        ("learning_rate", "0.01", "0.003", True),
    ]
    assert not any(r["changed"] for r in rows[2:]) and len(rows) > 20
    assert second["config_compared_with"].value == (
        f"run {first['run_id'].value} (attempt 1), the family's previous run"
    )
    # The receipt's retry decision and commits, each field a row.
    ledger = Ledger.open(materialized.settings.ledger_url)
    attempt = ledger.get_attempt(second["run_id"].value, 1)
    decision = {row["field"]: row["value"] for row in _rows(second["retry_decision"])}
    assert decision["action"] == attempt.retry_decision["action"] == "none"
    assert decision["spent.count"] == 1
    [commit] = _rows(second["checkpoints_committed"])
    [checkpoint] = ledger.checkpoints(second["run_id"].value)
    assert (commit["step"], commit["path"]) == (20, checkpoint.path)
    assert commit["train_loss"] == checkpoint.metrics["train_loss"]


def test_links_lead_to_mlflow_for_the_training_run_each_evaluation_and_the_model_version(
    materialized: Materialized,
) -> None:
    meta = materialized.metadata
    client = mlflow_client(materialized.settings)
    run_id = meta["training_attempt"]["run_id"].value
    training = client.get_run(training_run_of(client, run_id))
    expected = mlflow_run_url(MLFLOW_UI, training.info.experiment_id, training.info.run_id)
    for node in ("training_attempt", "promoted_model"):
        link = meta[node]["mlflow_training_run"]
        assert isinstance(link, dg.UrlMetadataValue) and link.value == expected, node
    ledger = Ledger.open(materialized.settings.ledger_url)
    for evaluation in ledger.evaluations_for_run(run_id):
        run = client.get_run(evaluation.mlflow_run_id)
        link = meta["evaluation"][f"{evaluation.evaluator_name}/mlflow_run"]
        assert link.value == mlflow_run_url(MLFLOW_UI, run.info.experiment_id, run.info.run_id)
    version = meta["promoted_model"]["model_version"].value
    assert meta["promoted_model"]["mlflow_model_version"].value == mlflow_model_version_url(
        MLFLOW_UI, "digits-classifier", version
    )


def test_the_story_follows_the_run_to_its_promotion(materialized: Materialized) -> None:
    meta = materialized.metadata
    ledger = Ledger.open(materialized.settings.ledger_url)
    run_id = meta["training_attempt"]["run_id"].value
    [promotion] = ledger.promotions(run_id=run_id)
    # The attempt's page is the run as it stood then, and says so.
    trained = meta["training_attempt"]["explain"].value
    assert "as it stood when attempt 1 ended" in trained and "Not evaluated" in trained
    # The evaluation's page names each evaluation; the promotion is still to come.
    evaluated = meta["evaluation"]["explain"].value
    assert "Not evaluated" not in evaluated and "No promotion decision yet." in evaluated
    assert all(f"`{e.evaluation_id}`" in evaluated for e in ledger.evaluations_for_run(run_id))
    # The asset a person looks at last tells the end: this promotion.
    promoted = meta["promoted_model"]["explain"]
    assert isinstance(promoted, dg.MarkdownMetadataValue)
    assert "No promotion decision yet." not in promoted.value
    assert f"**promoted** as digits-classifier version {promotion.model_version}" in promoted.value
    assert promotion.promotion_id == meta["promoted_model"]["promotion_id"].value


def test_the_graph_is_one_group_drawn_from_the_landing_files(materialized: Materialized) -> None:
    graph = build_definitions(materialized.settings).resolve_asset_graph()
    nodes = {key.to_user_string(): graph.get(key) for key in graph.get_all_asset_keys()}
    assert set(nodes) == {"landing_files", *NODES}
    # Several groups open collapsed in Dagster's UI; one group is drawn open, every asset shown.
    assert {node.group_name for node in nodes.values()} == {ASSET_GROUP}
    landing = nodes["landing_files"]
    assert not landing.is_materializable  # external: Tracks never writes landing files
    assert landing.metadata["landing_folder"].value == str(materialized.settings.landing_root)
    assert [key.to_user_string() for key in nodes["data_snapshot"].parent_keys] == ["landing_files"]
