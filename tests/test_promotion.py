"""Promotion end to end: real evaluations, MLflow registry on SQLite, the ledger; no mocks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.data import read_snapshot_frame
from pipeline.ledger import EvaluationRecord, Ledger, PromotionRecord
from pipeline.mlflow_setup import configure_mlflow
from pipeline.promotion import QualityGate, champion_version, promote
from pipeline.states import PromotionDecision
from pipeline.tracking import (
    PROMOTION_TAG,
    RUN_TAG,
    TRAINING_RUN_TAG,
    ensure_training_run,
    training_run_of,
)
from tests.evaluation_support import (
    World,
    manifest_sha256,
    open_ledger,
    shared_world,
    without_class,
    write_checkpoint,
)
from tests.promotion_support import (
    PIXELS,
    crown,
    evaluate_checkpoint,
    nudged,
    promote_checkpoint,
)

# Thresholds out of the way, so a test sees only the rule it is about.
SLICES_ONLY = QualityGate(min_metrics={}, max_slice_regression=0.03)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return shared_world(tmp_path_factory.getbasetemp())


@dataclass(frozen=True)
class Champion:
    ledger: Ledger
    checkpoint: Path
    evaluations: list[EvaluationRecord]
    promotion: PromotionRecord
    model_name: str = "digits-champion-tests"


@pytest.fixture(scope="module")
def champion(world: World, tmp_path_factory: pytest.TempPathFactory) -> Champion:
    """A good checkpoint, evaluated by every required evaluator and promoted."""
    base = tmp_path_factory.mktemp("champion")
    ledger = open_ledger(
        base / "ledger.db", world.snapshot.snapshot_id, "run-good", "run-degraded", "run-untrained"
    )
    checkpoint = write_checkpoint(base / "checkpoints", world.good_state, run_id="run-good")
    evaluations = evaluate_checkpoint(world, ledger, checkpoint, "run-good")
    promotion = promote_checkpoint(world, ledger, checkpoint, "run-good", Champion.model_name)
    return Champion(ledger, checkpoint, evaluations, promotion)


def test_promotion_passes_and_moves_the_champion_alias(world: World, champion: Champion) -> None:
    record = champion.promotion
    assert record.decision == PromotionDecision.PROMOTED, record.reason
    assert record.reason.startswith("Passed:")
    assert record.model_version == "1" and record.previous_champion_version is None
    assert sorted(record.evaluation_ids) == sorted(e.evaluation_id for e in champion.evaluations)
    assert record.gate["thresholds"] and all(c["passed"] for c in record.gate["thresholds"])

    version = champion_version(world.settings, champion.model_name)
    assert version is not None and str(version.version) == record.model_version
    assert "champion" in version.aliases
    assert champion.ledger.current_champion(champion.model_name) == record


def test_model_version_tags_lead_back_to_run_attempt_checkpoint_snapshot_and_evaluations(
    world: World, champion: Champion
) -> None:
    version = champion_version(world.settings, champion.model_name)
    tags = version.tags
    assert tags["tracks.run_id"] == "run-good" and tags["tracks.attempt_no"] == "1"
    assert tags["tracks.checkpoint_path"] == str(champion.checkpoint)
    assert tags["tracks.checkpoint_manifest_sha256"] == manifest_sha256(champion.checkpoint)
    assert tags["tracks.snapshot_id"] == world.snapshot.snapshot_id
    assert tags["tracks.promotion_id"] == champion.promotion.promotion_id
    by_name = {e.evaluator_name: e.evaluation_id for e in champion.evaluations}
    assert sorted(tags["tracks.evaluation_ids"].split(",")) == sorted(by_name.values())
    for name, evaluation_id in by_name.items():
        assert tags[f"tracks.evaluation.{name}"] == evaluation_id
    # Each tag resolves: the evaluations are in the ledger for exactly this checkpoint.
    sha = tags["tracks.checkpoint_manifest_sha256"]
    in_ledger = champion.ledger.evaluations_for_checkpoint(sha)
    assert {e.evaluation_id for e in in_ledger} == set(by_name.values())
    # The version's source is the run's MLflow TRAINING run (made at promotion here: these
    # checkpoints were written by hand, with no tracker), which also holds the gate's details.
    client = MlflowClient(world.settings.mlflow_tracking_uri)
    assert version.run_id == training_run_of(client, "run-good") == tags[TRAINING_RUN_TAG]
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert (logged.source_run_id, logged.name) == (version.run_id, "model")
    run = client.get_run(version.run_id)
    assert run.data.tags[RUN_TAG] == "run-good" and run.info.status == "FINISHED"
    gate = f"promotions/{champion.promotion.promotion_id}/gate.json"
    assert gate in {a.path for a in client.list_artifacts(version.run_id, gate.rsplit("/", 1)[0])}
    # The evaluation runs carry the same tracks.run_id, and lead to the training run too.
    for evaluation in champion.evaluations:
        evaluation_tags = client.get_run(evaluation.mlflow_run_id).data.tags
        assert evaluation_tags[RUN_TAG] == "run-good"
        assert evaluation_tags["tracks.evaluation_id"] == evaluation.evaluation_id
        assert evaluation_tags["tracks.checkpoint_manifest_sha256"] == sha


def test_champion_loads_by_alias_without_pickle_and_predicts(
    world: World, champion: Champion, tmp_path: Path
) -> None:
    configure_mlflow(world.settings)  # registry URI for the models:/ scheme
    model = mlflow.pyfunc.load_model(f"models:/{champion.model_name}@champion")
    frame = read_snapshot_frame(world.snapshot)
    rows = frame[frame["split"] == "eval"]
    predicted = model.predict(rows)  # extra columns (sample_id, split, label) are ignored
    assert predicted.shape == (len(rows),) and predicted.dtype == np.int64
    accuracy = float((predicted == rows["label"].to_numpy()).mean())
    holdout = next(e for e in champion.evaluations if e.evaluator_name == "holdout_accuracy")
    assert accuracy == pytest.approx(holdout.metrics["accuracy"])
    assert np.array_equal(model.predict(rows[PIXELS].head(7)), predicted[:7])
    # The signature is the snapshot's contract: integer pixel columns, refused by name else.
    with pytest.raises(MlflowException, match="px_00"):
        model.predict(rows[PIXELS].to_numpy()[:7])
    signature = model.metadata.signature
    assert signature.inputs.input_names() == PIXELS
    assert [spec.type.name for spec in signature.inputs.inputs] == ["long"] * 64

    local = Path(
        mlflow.artifacts.download_artifacts(
            f"models:/{champion.model_name}@champion", dst_path=str(tmp_path)
        )
    )
    files = {p.name for p in local.rglob("*") if p.is_file()}
    assert {"model.safetensors", "trainer_state.json", "digits_model.py", "MLmodel"} <= files
    assert "input_example.json" in files  # two real rows of the snapshot's eval split
    assert not any(name.endswith((".pkl", ".pickle", ".pt", ".pth")) for name in files)


def test_slice_regression_against_the_champion_is_refused(
    world: World, champion: Champion, tmp_path: Path
) -> None:
    degraded = write_checkpoint(tmp_path, without_class(world.good_state, 3), run_id="run-degraded")
    evaluate_checkpoint(world, champion.ledger, degraded, "run-degraded")
    record = promote_checkpoint(
        world, champion.ledger, degraded, "run-degraded", champion.model_name, gate=SLICES_ONLY
    )

    assert record.decision == PromotionDecision.REFUSED
    assert record.model_version is None
    assert record.previous_champion_version == "1"
    assert "slice class=3 of holdout_accuracy regressed from" in record.reason
    assert "to 0.000 (> 0.03) against champion version 1" in record.reason
    assert "class=4" not in record.reason  # only what failed is named
    assert any(c["regressed"] and c["slice"] == "class=3" for c in record.gate["slice_comparisons"])
    assert champion.ledger.promotions(run_id="run-degraded") == [record]
    assert str(champion_version(world.settings, champion.model_name).version) == "1"


def test_threshold_failure_is_refused(world: World, champion: Champion, tmp_path: Path) -> None:
    untrained = write_checkpoint(tmp_path, world.untrained_state, run_id="run-untrained")
    evaluate_checkpoint(world, champion.ledger, untrained, "run-untrained")
    record = promote_checkpoint(
        world, champion.ledger, untrained, "run-untrained", champion.model_name
    )

    assert record.decision == PromotionDecision.REFUSED
    assert "holdout_accuracy.accuracy 0." in record.reason and "< 0.9" in record.reason
    assert "noise_robustness.accuracy@0.1 0." in record.reason and "< 0.8" in record.reason
    assert str(champion_version(world.settings, champion.model_name).version) == "1"
    # The ledger and `tracks explain` say the run was refused, not "succeeded".
    from pipeline.explain import explain

    assert champion.ledger.get_run("run-untrained").status == "refused"
    assert champion.ledger.get_run("run-good").status == "promoted"
    page = explain(champion.ledger, "run-untrained")
    assert "Status **refused**" in page and "**promotion refused**: Refused:" in page


def test_promoting_the_champion_again_returns_the_recorded_promotion(
    world: World, champion: Champion
) -> None:
    again = promote_checkpoint(
        world, champion.ledger, champion.checkpoint, "run-good", champion.model_name
    )
    assert again == champion.promotion
    client = MlflowClient(world.settings.mlflow_tracking_uri)
    versions = client.search_model_versions(f"name='{champion.model_name}'")
    assert [str(v.version) for v in versions] == ["1"]


def test_missing_evaluator_is_refused_with_reason(world: World, tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, "run-partial")
    checkpoint = write_checkpoint(tmp_path, world.good_state, run_id="run-partial")
    evaluate_checkpoint(world, ledger, checkpoint, "run-partial", evaluators=["holdout_accuracy"])
    record = promote_checkpoint(
        world, ledger, checkpoint, "run-partial", "digits-missing-evaluator"
    )

    sha12 = manifest_sha256(checkpoint)[:12]
    assert record.decision == PromotionDecision.REFUSED
    assert f"evaluator noise_robustness has no complete evaluation for checkpoint {sha12}" in (
        record.reason
    )
    assert ledger.promotions(model_name="digits-missing-evaluator") == [record]
    assert champion_version(world.settings, "digits-missing-evaluator") is None


def test_second_promotion_records_the_previous_champion(world: World, tmp_path: Path) -> None:
    name = "digits-succession"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, "run-1", "run-2")
    first = write_checkpoint(tmp_path, world.good_state, run_id="run-1")
    evaluate_checkpoint(world, ledger, first, "run-1")
    assert promote_checkpoint(world, ledger, first, "run-1", name).model_version == "1"

    # Other weights, a hair apart (no prediction changes): a new checkpoint, no regression.
    second = write_checkpoint(tmp_path, nudged(world.good_state), run_id="run-2", step=800)
    assert manifest_sha256(second) != manifest_sha256(first)
    evaluate_checkpoint(world, ledger, second, "run-2")
    record = promote_checkpoint(world, ledger, second, "run-2", name)

    assert record.decision == PromotionDecision.PROMOTED, record.reason
    assert (record.model_version, record.previous_champion_version) == ("2", "1")
    assert record.gate["champion_version"] == "1" and record.gate["slice_comparisons"]
    version = champion_version(world.settings, name)
    assert str(version.version) == "2" and version.tags["tracks.previous_champion_version"] == "1"
    assert ledger.current_champion(name) == record


def test_retraining_to_identical_weights_registers_no_new_version(
    world: World, tmp_path: Path
) -> None:
    """The same snapshot, config and code train bit-identical weights on CPU: a second run
    whose model.safetensors is the champion's byte for byte is recorded unchanged."""
    name = "digits-unchanged"
    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, "run-a", "run-b")
    first = write_checkpoint(tmp_path, world.good_state, run_id="run-a")
    evaluate_checkpoint(world, ledger, first, "run-a")
    crowned = promote_checkpoint(world, ledger, first, "run-a", name)
    assert crowned.model_version == "1"
    # Another run, another attempt's checkpoint (another manifest), the same tensors.
    again = write_checkpoint(tmp_path, world.good_state, run_id="run-b", step=500)
    assert manifest_sha256(again) != manifest_sha256(first)
    evaluations = evaluate_checkpoint(world, ledger, again, "run-b")
    client = MlflowClient(world.settings.mlflow_tracking_uri)
    ensure_training_run(client, "run-b", None)  # what its trainer's tracker would have made

    record = promote_checkpoint(world, ledger, again, "run-b", name)

    assert record.decision == PromotionDecision.UNCHANGED, record.reason
    assert record.reason.startswith("Identical to the champion (version 1, run run-a)")
    assert (record.model_version, record.previous_champion_version) == ("1", "1")
    assert record.serving_manifest is None
    identical = record.gate["identical_to_champion"]
    assert identical["promotion_id"] == crowned.promotion_id
    assert identical["weights"]["digest"] == crowned.serving_manifest["files"]["weights"]["digest"]
    assert sorted(record.evaluation_ids) == sorted(e.evaluation_id for e in evaluations)
    assert ledger.promotions(run_id="run-b") == [record]  # a row of its own, with its reason
    assert ledger.current_champion(name) == crowned
    assert ledger.get_run("run-b").status not in ("promoted", "refused")  # kept its status
    assert [str(v.version) for v in client.search_model_versions(f"name='{name}'")] == ["1"]
    assert str(champion_version(world.settings, name).version) == "1"
    training = client.get_run(training_run_of(client, "run-b"))
    assert training.data.tags[PROMOTION_TAG] == record.reason


def test_a_promotion_whose_ledger_row_was_lost_is_recorded_without_a_second_version(
    world: World, tmp_path: Path
) -> None:
    name = "digits-repair"
    checkpoint = crown(world, tmp_path, "run-r", name)

    # As if the process died after moving the alias but before writing the ledger row.
    ledger = open_ledger(tmp_path / "second.db", world.snapshot.snapshot_id, "run-r")
    evaluate_checkpoint(world, ledger, checkpoint, "run-r")
    record = promote_checkpoint(world, ledger, checkpoint, "run-r", name)

    assert record.decision == PromotionDecision.PROMOTED, record.reason
    assert record.model_version == "1"
    assert ledger.current_champion(name) == record
    client = MlflowClient(world.settings.mlflow_tracking_uri)
    assert [str(v.version) for v in client.search_model_versions(f"name='{name}'")] == ["1"]


# -- serving: the champion is verified against its promotion record before a byte is loaded ---


def _served_files(world: World, model_name: str) -> Path:
    """Where the registered version's artifacts lie in the artifact store (to tamper with)."""
    from pipeline.mlflow_setup import mlflow_client

    client = mlflow_client(world.settings)
    version = client.get_model_version_by_alias(model_name, "champion")
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    return Path(logged.artifact_location.removeprefix("file://"))


def test_load_champion_verifies_and_serves_the_promoted_bytes(
    world: World, champion: Champion
) -> None:
    from pipeline.serving.champion import load_champion

    served = load_champion(world.settings, champion.ledger, champion.model_name)
    assert served.checkpoint_manifest_sha256 == champion.promotion.checkpoint_manifest_sha256
    frame = read_snapshot_frame(world.snapshot)
    rows = frame[frame["split"] == "eval"]
    predicted = served.predict(rows[PIXELS].to_numpy())
    accuracy = float((predicted == rows["label"].to_numpy()).mean())
    holdout = next(e for e in champion.evaluations if e.evaluator_name == "holdout_accuracy")
    assert accuracy == pytest.approx(holdout.metrics["accuracy"])


def test_tampered_weights_or_planted_code_are_refused_and_never_run(
    world: World, tmp_path: Path
) -> None:
    from pipeline.serving.champion import ChampionVerificationError, load_champion

    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, "run-served")
    checkpoint = write_checkpoint(tmp_path / "ckpt", world.good_state, run_id="run-served")
    evaluate_checkpoint(world, ledger, checkpoint, "run-served")
    model_name = "digits-served"
    record = promote_checkpoint(world, ledger, checkpoint, "run-served", model_name)
    assert record.decision == PromotionDecision.PROMOTED, record.reason
    stored = _served_files(world, model_name)
    marker = tmp_path / "ran.txt"

    # Code planted where pyfunc would import it: Tracks' loader never imports it.
    code = stored / "digits_model.py"
    os.chmod(code, 0o644)
    code.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + code.read_text())
    load_champion(world.settings, ledger, model_name)
    assert not marker.exists()

    # An extra file among the served artifacts is refused.
    planted = stored / "artifacts" / "hook.py"
    planted.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(ChampionVerificationError, match="unexpected file"):
        load_champion(world.settings, ledger, model_name)
    planted.unlink()

    # One flipped byte in the weights: refused, naming the file and both digests.
    weights = stored / "artifacts" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(blob))
    with pytest.raises(
        ChampionVerificationError,
        match=r"model\.safetensors has (blake3|sha256) [0-9a-f]{64} .* but",
    ):
        load_champion(world.settings, ledger, model_name)
    assert not marker.exists()


def test_a_checkpoint_the_ledger_does_not_vouch_for_is_never_promoted(
    world: World, tmp_path: Path
) -> None:
    from pipeline.promotion.promote import UnvouchedCheckpointError

    ledger = open_ledger(tmp_path / "ledger.db", world.snapshot.snapshot_id, "run-forged")
    forged = write_checkpoint(tmp_path / "ckpt", world.good_state, run_id="run-forged")
    evaluate_checkpoint(world, ledger, forged, "run-forged")
    with pytest.raises(UnvouchedCheckpointError, match="not a checkpoint of run run-forged"):
        promote(
            ledger=ledger, settings=world.settings, run_id="run-forged", attempt_no=1,
            checkpoint_dir=forged, snapshot_id=world.snapshot.snapshot_id,
            model_name="digits-forged",
        )  # fmt: skip
