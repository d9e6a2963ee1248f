"""The data gate: no path trains on a snapshot whose blocking checks failed, or whose manifest
was edited; a stopped batch leaves a ledger row; bad landing files are named.

Each case was reproduced on the landed main before the fix: `training_attempt` materialized on
its own trained a blocked partition, the trainer CLI trained it too, an edited manifest went
unnoticed, a stopped batch left nothing in the ledger, drift compared against a failed
snapshot, a snapshot without an eval split passed its checks, and a zero-byte landing file gave
a pyarrow traceback that did not name it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner

from definitions import build_definitions
from pipeline.cli import main as tracks
from pipeline.data.errors import BlockedSnapshotError, LandingFileError, SnapshotTamperedError
from pipeline.data.gate import ensure_checks_passed, verdict_path
from pipeline.data.landing import Drift, write_digits_landing
from pipeline.data.quality import check_data_quality
from pipeline.data.snapshot import create_snapshot, open_snapshot, read_snapshot_frame
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from pipeline.trainer import exit_codes
from sensors import materialize_snapshot
from tests.trainer_support import write_config

REPO = Path(__file__).resolve().parent.parent


def _snapshot(root: Path, drift: Drift | None = None, name: str | None = None) -> object:
    landing = root / f"landing-{drift or 'good'}-{name or 'x'}"
    write_digits_landing(landing, drift=drift, file_name=name)
    return create_snapshot(landing, root / "snapshots")


@pytest.mark.slow
def test_training_attempt_materialized_alone_refuses_a_blocked_partition(
    tracks_home: Path,
) -> None:
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root, drift=Drift.PIXEL_OUT_OF_RANGE)
    defs = build_definitions(settings)
    with dg.DagsterInstance.get() as instance:
        first = materialize_snapshot(defs, instance, _only_id(settings))
        assert not first.success  # stopped at its blocking checks
        # Now the attack: materialize training_attempt on its own for that partition.
        job = defs.resolve_implicit_global_asset_job_def()
        alone = job.execute_in_process(
            instance=instance,
            partition_key=_only_id(settings),
            asset_selection=[dg.AssetKey("training_attempt")],
            raise_on_error=False,
        )
    assert not alone.success
    failure = next(e for e in alone.all_events if e.event_type_value == "STEP_FAILURE")
    assert "failed its blocking checks" in failure.event_specific_data.error.message
    ledger = Ledger.open(settings.ledger_url)
    assert ledger.list_attempts() == []  # nothing trained, not even an attempt row
    # The batch that was stopped is in the ledger, and the CLI tells its story.
    snap = ledger.get_snapshot(_only_id(settings))
    assert snap.verdict == "blocked"
    page = CliRunner().invoke(tracks, ["explain", _only_id(settings)])
    assert page.exit_code == 0, page.output
    assert "**failed**" in page.output and "px_" in page.output
    assert "the blocking checks stopped this batch" in page.output


def _only_id(settings: TracksSettings) -> str:
    from pipeline.data.snapshot import snapshot_id_for

    return snapshot_id_for(settings.landing_root)


def _train(
    config: Path, store: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.trainer", "--config", str(config), "--run-id", "r1",
         "--store", str(store)],
        cwd=REPO, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_trainer_cli_refuses_a_snapshot_that_fails_its_checks(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path, Drift.PIXEL_OUT_OF_RANGE)
    config = write_config(tmp_path / "config", snapshot.path, max_steps=5)
    done = _train(config, tmp_path / "store")
    assert done.returncode == exit_codes.BAD_INPUT, done.stderr[-2000:]
    words = json.loads((tmp_path / "store" / "r1" / "attempt-1.last_words.json").read_text())
    assert words["reason"] == "bad_input"
    assert "failed its blocking checks" in words["detail"] and "px_" in words["detail"]
    assert not list((tmp_path / "store" / "r1").glob("step-*"))  # not one step trained


def test_an_edited_manifest_is_refused_with_or_without_a_ledger(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    ensure_checks_passed(snapshot, snapshot_root=tmp_path / "snapshots", ledger=ledger)
    manifest = snapshot.path / "manifest.json"
    os.chmod(manifest, 0o644)
    edited = json.loads(manifest.read_text())
    edited["source"] = "s3://somewhere-else/"
    manifest.write_text(json.dumps(edited))
    reopened = open_snapshot(snapshot.path)
    with pytest.raises(SnapshotTamperedError, match="changed after the snapshot was made"):
        ensure_checks_passed(reopened, snapshot_root=tmp_path / "snapshots", ledger=ledger)
    with pytest.raises(SnapshotTamperedError, match="changed after the snapshot was made"):
        ensure_checks_passed(reopened, snapshot_root=tmp_path / "snapshots", ledger=None)
    # A row count that lies about the data is caught by verification itself.
    edited["row_count"] += 1
    manifest.write_text(json.dumps(edited))
    with pytest.raises(Exception, match="row_count"):
        read_snapshot_frame(open_snapshot(snapshot.path))
    # And the trainer, pointed at it without a ledger, refuses as bad input.
    config = write_config(tmp_path / "config", snapshot.path, max_steps=5)
    assert _train(config, tmp_path / "store").returncode == exit_codes.BAD_INPUT


def test_a_verdict_is_keyed_by_the_exact_manifest(tmp_path: Path) -> None:
    blocked = _snapshot(tmp_path, Drift.LABEL_OUT_OF_RANGE)
    with pytest.raises(BlockedSnapshotError, match="label"):
        ensure_checks_passed(blocked, snapshot_root=tmp_path / "snapshots")
    # Recorded, and read back instead of re-running the checks.
    assert verdict_path(tmp_path / "snapshots", blocked).is_file()
    with pytest.raises(BlockedSnapshotError):
        ensure_checks_passed(blocked, snapshot_root=tmp_path / "snapshots")


def test_a_snapshot_without_an_eval_split_fails_data_quality(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    frame = read_snapshot_frame(snapshot)
    frame["split"] = "train"
    outcome = check_data_quality(frame)
    assert not outcome.passed
    assert "no rows in split(s) eval" in outcome.summary


@pytest.mark.parametrize(
    ("content", "words"),
    [(b"", "is empty (0 bytes)"), (b"PAR1\x00\x01truncated", "not a readable Parquet file"),
     (b"label,pixel\n1,2\n", "not a readable Parquet file")],
)  # fmt: skip
def test_bad_landing_files_are_named(tmp_path: Path, content: bytes, words: str) -> None:
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "broken.parquet").write_bytes(content)
    with pytest.raises(LandingFileError) as raised:
        create_snapshot(landing, tmp_path / "snapshots")
    assert "broken.parquet" in str(raised.value) and words in str(raised.value)
    result = CliRunner().invoke(tracks, ["snapshot-id", "--landing-dir", str(tmp_path / "none")])
    assert result.exit_code != 0 and "Traceback" not in result.output


def test_byte_identical_data_under_another_file_name_is_named_in_explain(tmp_path: Path) -> None:
    from pipeline.data.gate import register
    from pipeline.explain import render_snapshot

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    first = _snapshot(tmp_path, name="digits.parquet")
    second = _snapshot(tmp_path, name="renamed.parquet")
    # The id covers names (what a reader sees); the content digest covers the bytes alone.
    assert first.snapshot_id != second.snapshot_id
    for s in (first, second):
        register(s, ledger)
    page = render_snapshot(ledger, second.snapshot_id)
    assert f"**byte-identical** to snapshot `{first.snapshot_id}`" in page


@pytest.mark.slow
def test_drift_compares_against_the_newest_snapshot_that_passed(tracks_home: Path) -> None:
    settings = TracksSettings.from_env()
    defs = build_definitions(settings)
    ids = []
    with dg.DagsterInstance.get() as instance:
        for drift, name in ((None, "a.parquet"), (Drift.NULLS, "b.parquet"), (None, "c.parquet")):
            landing = settings.home / f"landing-{name}"
            write_digits_landing(landing, drift=drift, file_name=name)
            from pipeline.data.snapshot import snapshot_id_for

            snapshot_id = snapshot_id_for(landing)
            ids.append(snapshot_id)
            instance.add_dynamic_partitions("snapshots", [snapshot_id])
            result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
                instance=instance,
                partition_key=snapshot_id,
                asset_selection=[dg.AssetKey("data_snapshot")],
                run_config={"ops": {"data_snapshot": {"config": {"landing_dir": str(landing)}}}},
                raise_on_error=False,
            )
    drift = next(
        e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
        and e.asset_check_evaluation_data.check_name == "drift_vs_previous"
    )
    # b failed its checks: c is compared with a, and says so.
    assert drift.metadata["baseline_snapshot_id"].value == ids[0]


def test_the_trainer_checks_the_pixel_range_itself(tmp_path: Path) -> None:
    """Even with a verdict that says passed (forged here), out-of-range pixels are bad input."""
    from pipeline.data.gate import CheckVerdict, record_verdict
    from pipeline.trainer.data import BadInputError, load_training_data

    snapshot = _snapshot(tmp_path, Drift.PIXEL_OUT_OF_RANGE)
    forged = [
        CheckVerdict(name, blocking=True, passed=True, summary="forged")
        for name in ("schema_contract", "data_quality")
    ]
    record_verdict(snapshot, forged, snapshot_root=tmp_path / "snapshots")
    with pytest.raises(BadInputError, match=r"pixel values fall outside 0\.\.16"):
        load_training_data(snapshot.path, model_family="digits-cnn")


def test_with_a_ledger_a_forged_verdict_file_is_not_trusted(tmp_path: Path) -> None:
    """A hand-written `passed` verdict file beside an unchecked snapshot: the ledger has no
    rows for it, so the gate checks it on the spot, refuses it, and the ledger says so."""
    from pipeline.data.gate import CheckVerdict, record_verdict

    snapshot = _snapshot(tmp_path, Drift.LABEL_OUT_OF_RANGE)
    forged = [
        CheckVerdict(name, blocking=True, passed=True, summary="forged")
        for name in ("schema_contract", "data_quality")
    ]
    record_verdict(snapshot, forged, snapshot_root=tmp_path / "snapshots")  # file only
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    with pytest.raises(BlockedSnapshotError, match="label"):
        ensure_checks_passed(snapshot, snapshot_root=tmp_path / "snapshots", ledger=ledger)
    rows = ledger.snapshot_checks(snapshot.snapshot_id, snapshot.manifest_sha256)
    assert rows and not all(r.passed for r in rows if r.blocking)
    assert ledger.get_snapshot(snapshot.snapshot_id).verdict == "blocked"
