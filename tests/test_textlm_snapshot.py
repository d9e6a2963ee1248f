"""A text snapshot is a first-class snapshot: its family in its id and manifest, its own checks
blocking the graph, its own drift baseline, and `tracks landing text` to land it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner

from assets.training_config import TrainingRunConfig, train_config_for_attempt
from definitions import _resources, build_definitions
from pipeline import ids
from pipeline.cli import TEXT_DRIFTS, main
from pipeline.data.errors import BlockedSnapshotError, SnapshotIntegrityError
from pipeline.data.families import DIGITS, TEXT, UnknownFamilyError, landing_dir_for
from pipeline.data.gate import (
    DRIFT_VS_PREVIOUS,
    drift_baseline,
    drift_outcome,
    ensure_checks_passed,
    read_check_frame,
    record_verdict,
    run_blocking_checks,
)
from pipeline.data.landing import landing_files, write_digits_landing
from pipeline.data.snapshot import (
    MANIFEST_NAME,
    create_snapshot,
    family_of_snapshot,
    open_snapshot,
    snapshot_id_for,
    verify_snapshot,
)
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from pipeline.textlm.landing import TextDrift, write_text_landing
from pipeline.trainer.config import TrainConfig, named_config
from sensors import materialize_snapshot
from sensors.snapshots import new_snapshot
from tests.dagster_dev import check_evaluations


def test_text_landing_becomes_a_text_snapshot_whose_checks_pass(tmp_path: Path) -> None:
    landing_root, snapshots = tmp_path / "landing", tmp_path / "snapshots"
    write_digits_landing(landing_root)
    text_dir = landing_dir_for(landing_root, TEXT)
    assert text_dir == landing_root / "text-lm"
    write_text_landing(text_dir)

    # The digits landing is the root itself, and never picks up the text sub-folder.
    assert [p.name for p in landing_files(landing_root)] == ["digits.parquet"]
    digits = create_snapshot(landing_root, snapshots)
    assert digits.family == DIGITS and digits.snapshot_id.startswith("digits-")
    assert [f["name"] for f in digits.manifest["files"]] == ["digits.parquet"]

    expected = snapshot_id_for(text_dir, family=TEXT)
    text = create_snapshot(text_dir, snapshots, family=TEXT)
    assert text.snapshot_id == expected
    assert ids.snapshot_id(text.snapshot_id).startswith("text-")
    assert text.family == TEXT == text.manifest["family"]
    assert family_of_snapshot(text.snapshot_id) == TEXT
    assert family_of_snapshot(digits.snapshot_id) == DIGITS
    assert open_snapshot(snapshots, text.snapshot_id).family == TEXT
    verify_snapshot(text)

    verdicts = ensure_checks_passed(text, snapshot_root=snapshots)
    assert {name: v.passed for name, v in verdicts.items()} == {
        "schema_contract": True,
        "data_quality": True,
    }
    assert "280 documents" in verdicts["schema_contract"].summary


def test_the_same_bytes_under_two_families_are_two_snapshots(tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    write_text_landing(landing)
    as_text = snapshot_id_for(landing, family=TEXT)
    as_digits = snapshot_id_for(landing, family=DIGITS)
    assert as_text.removeprefix("text-") == as_digits.removeprefix("digits-")
    assert as_text != as_digits
    with pytest.raises(UnknownFamilyError, match=r"'text'.*digits-cnn, text-lm"):
        create_snapshot(landing, tmp_path / "snapshots", family="text")


def test_snapshot_ids_are_one_of_the_families_prefixes() -> None:
    assert ids.snapshot_id("text-0123456789abcdef") == "text-0123456789abcdef"
    for bad in ("textlm-0123456789abcdef", "images-0123456789abcdef", "text-0123456789ABCDEF"):
        assert not ids.is_snapshot_id(bad)
        with pytest.raises(ids.InvalidIdError, match="'digits-' or 'text-'"):
            family_of_snapshot(bad)


def _rewrite_manifest(snapshot_dir: Path, edit: dict[str, object | None]) -> None:
    path = snapshot_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    for key, value in edit.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    os.chmod(path, 0o644)
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def test_a_manifest_family_that_disagrees_with_the_id_is_refused(tmp_path: Path) -> None:
    write_text_landing(tmp_path / "landing")
    text = create_snapshot(tmp_path / "landing", tmp_path / "snapshots", family=TEXT)
    # Edited to send text through the digits checks and trainer.
    _rewrite_manifest(text.path, {"family": DIGITS})
    with pytest.raises(SnapshotIntegrityError, match=r"names family 'digits-cnn'.*'digits-'"):
        open_snapshot(text.path)
    _rewrite_manifest(text.path, {"family": "poetry"})
    with pytest.raises(SnapshotIntegrityError, match="unknown family 'poetry'"):
        open_snapshot(text.path)


def test_a_manifest_without_family_is_digits(tmp_path: Path) -> None:
    write_digits_landing(tmp_path / "landing")
    digits = create_snapshot(tmp_path / "landing", tmp_path / "snapshots")
    _rewrite_manifest(digits.path, {"family": None})  # as written before families existed
    reopened = open_snapshot(digits.path)
    assert "family" not in reopened.manifest
    assert reopened.family == DIGITS
    verify_snapshot(reopened)


def test_text_drift_compares_with_the_previous_passing_text_snapshot(tmp_path: Path) -> None:
    snapshots = tmp_path / "snapshots"
    write_digits_landing(tmp_path / "digits")
    digits = create_snapshot(tmp_path / "digits", snapshots)
    record_verdict(digits, run_blocking_checks(digits), snapshot_root=snapshots)

    write_text_landing(tmp_path / "clean")
    clean = create_snapshot(tmp_path / "clean", snapshots, family=TEXT)
    # The passing digits snapshot is no baseline for text, nor the reverse.
    assert drift_baseline(clean, snapshot_root=snapshots, ledger=None) is None
    record_verdict(clean, run_blocking_checks(clean), snapshot_root=snapshots)
    assert drift_baseline(digits, snapshot_root=snapshots, ledger=None) is None

    write_text_landing(tmp_path / "shouted", drift=TextDrift.SHOUTED)
    shouted = create_snapshot(tmp_path / "shouted", snapshots, family=TEXT)
    baseline = drift_baseline(shouted, snapshot_root=snapshots, ledger=None)
    assert baseline is not None and baseline.snapshot_id == clean.snapshot_id
    drift = drift_outcome(shouted, read_check_frame(shouted), read_check_frame(baseline))
    assert drift.check == DRIFT_VS_PREVIOUS and not drift.passed
    assert drift.failures[0].rule == "byte_js_distance <= 0.2"
    # Valid text whose characters moved warns; it does not block.
    assert all(v.passed for v in run_blocking_checks(shouted))


def test_a_blocked_text_snapshot_stops_the_trainer_gate(tmp_path: Path) -> None:
    write_text_landing(tmp_path / "landing", drift=TextDrift.INVALID_UTF8)
    snapshot = create_snapshot(tmp_path / "landing", tmp_path / "snapshots", family=TEXT)
    with pytest.raises(BlockedSnapshotError, match="valid_utf8"):
        ensure_checks_passed(snapshot, snapshot_root=tmp_path / "snapshots")


# Done when (issue 30, item 4): each defect stops the graph at the blocking text contract, and
# the check names the rule and the rows (doc_id and row number, never the text).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("drift", "column", "rule", "rows"),
    [
        (TextDrift.INVALID_UTF8, "text", "valid_utf8", ["'assert/000' (row 0)"]),
        (TextDrift.EMPTY_DOCUMENT, "text", "non_empty", ["'assignment/001' (row 2)"]),
        (TextDrift.DUPLICATE_ID, "doc_id", "field_uniqueness", ["'assignment/002' (row 3)"]),
        (
            TextDrift.SPLIT_LEAK,
            "text",
            "no_split_leak",
            ["'assignment/003' (row 4, train)", "'bitwise/000' (row 25, eval)"],
        ),
    ],
)
def test_a_text_defect_stops_the_graph_at_the_contract(
    tracks_home: Path, drift: TextDrift, column: str, rule: str, rows: list[str]
) -> None:
    settings = TracksSettings.from_env()
    text_dir = landing_dir_for(settings.landing_root, TEXT)
    write_text_landing(text_dir, drift=drift)
    snapshot = snapshot_id_for(text_dir, family=TEXT)

    with dg.DagsterInstance.get() as instance:
        result = materialize_snapshot(build_definitions(settings), instance, snapshot)
    assert not result.success

    evaluations = check_evaluations(result)
    contract = evaluations["schema_contract"]
    assert not contract.passed
    assert contract.severity == dg.AssetCheckSeverity.ERROR
    summary = contract.metadata["summary"].value
    assert f"rule {rule!r}" in summary, summary
    failure = next(f for f in contract.metadata["failures"].value if f["rule"] == rule)
    assert failure["column"] == column
    for row in rows:
        assert row in failure["detail"], failure["detail"]

    # The snapshot is recorded, as text; nothing downstream ran.
    materialized = [e for e in result.all_events if e.is_step_materialization]
    assert [e.asset_key.path[-1] for e in materialized] == ["data_snapshot"]
    metadata = materialized[0].step_materialization_data.materialization.metadata
    assert metadata["family"].value == TEXT
    started = {e.step_key for e in result.all_events if e.event_type_value == "STEP_START"}
    assert started == {"data_snapshot"}
    ledger = Ledger.open(settings.ledger_url)
    assert ledger.find_runs(snapshot_id=snapshot) == []
    assert ledger.list_attempts() == []
    recorded = {
        c.check_name: c.passed
        for c in ledger.snapshot_checks(snapshot, metadata["manifest_sha256"].value)
    }
    assert recorded["schema_contract"] is False


def test_tracks_landing_text_and_snapshot_id(tracks_home: Path) -> None:
    assert tuple(TextDrift) == TEXT_DRIFTS
    runner = CliRunner()
    landed = runner.invoke(main, ["landing", "text"])
    assert landed.exit_code == 0, landed.output
    path = Path(landed.output.strip())
    assert path == tracks_home / "landing" / "text-lm" / "text.parquet"

    shown = runner.invoke(main, ["snapshot-id", "--family", "text-lm"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.strip() == snapshot_id_for(path.parent, family=TEXT)
    # The digits landing (the root) holds no file of its own: the text file is not its data.
    digits = runner.invoke(main, ["snapshot-id"])
    assert digits.exit_code != 0 and "holds no Parquet files" in digits.output

    spoiled = runner.invoke(
        main, ["landing", "text", "--drift", "split_leak", "--file-name", "x.parquet"]
    )
    assert spoiled.exit_code == 0, spoiled.output
    assert Path(spoiled.output.strip()) == path.parent / "x.parquet"
    refused = runner.invoke(main, ["landing", "text", "--drift", "typo"])
    assert refused.exit_code == 2 and "'typo' is not one of" in refused.output


def _aged(path: Path) -> Path:
    past = time.time() - 60
    os.utime(path, (past, past))
    return path


def test_new_snapshot_registers_each_familys_landing(tracks_home: Path) -> None:
    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    storage = _resources(settings)["storage"]
    _aged(write_digits_landing(settings.landing_root))
    text_dir = landing_dir_for(settings.landing_root, TEXT)
    _aged(write_text_landing(text_dir))
    digits_id = snapshot_id_for(settings.landing_root)
    text_id = snapshot_id_for(text_dir, family=TEXT)
    # A cursor from before text existed: the digits' fingerprint alone, as a JSON list.
    digits_file = settings.landing_root / "digits.parquet"
    legacy = json.dumps(
        [[digits_file.name, digits_file.stat().st_size, digits_file.stat().st_mtime_ns]]
    )
    with dg.instance_for_test() as instance:
        result = new_snapshot(
            dg.build_sensor_context(
                instance=instance, cursor=legacy, resources={"storage": storage}
            )
        )
        assert isinstance(result, dg.SensorResult)
        # The digits' landing is unchanged since the legacy cursor: only text is new.
        [request] = result.run_requests
        assert request.partition_key == text_id == request.run_key
        # No run config: training_attempt starts a text partition from the text-lm config
        # (test_a_new_run_on_a_text_partition_starts_from_the_text_lm_config).
        assert request.run_config == {}
        [add] = result.dynamic_partitions_requests
        assert list(add.partition_keys) == [text_id]

        fresh = new_snapshot(
            dg.build_sensor_context(instance=instance, resources={"storage": storage})
        )
        assert isinstance(fresh, dg.SensorResult)
        assert {r.partition_key: r.run_config for r in fresh.run_requests}[digits_id] == {}
        assert sorted(r.partition_key for r in fresh.run_requests) == sorted([digits_id, text_id])

        again = new_snapshot(
            dg.build_sensor_context(
                instance=instance, cursor=fresh.cursor, resources={"storage": storage}
            )
        )
        assert isinstance(again, dg.SkipReason) and "unchanged" in again.skip_message


def test_a_new_run_on_a_text_partition_starts_from_the_text_lm_config(tmp_path: Path) -> None:
    """What the nightly schedule, the new-data sensor and a launch from the UI with no run
    config all do: the partition's family picks where the training config starts."""
    landing_root, snapshots = tmp_path / "landing", tmp_path / "snapshots"
    write_digits_landing(landing_root)
    write_text_landing(landing_dir_for(landing_root, TEXT))
    digits = create_snapshot(landing_root, snapshots)
    text = create_snapshot(landing_dir_for(landing_root, TEXT), snapshots, family=TEXT)
    scheduled = TrainingRunConfig(owner="schedule", purpose="scheduled")

    as_text = train_config_for_attempt(None, scheduled, text, None)
    assert as_text.model_family == TEXT
    assert as_text.to_dict()["model"] == named_config("text-lm")["model"]
    assert as_text.max_steps == named_config("text-lm")["max_steps"]
    as_digits = train_config_for_attempt(None, scheduled, digits, None)
    assert as_digits.model_family == DIGITS and as_digits.max_steps == TrainConfig.max_steps
    # What the run config sets still wins over the family's starting point.
    short = TrainingRunConfig(owner="ana", purpose="baseline", train={"max_steps": 7})
    assert train_config_for_attempt(None, short, text, None).max_steps == 7
