import json
import os
import stat
from pathlib import Path

import pytest

from pipeline.data import (
    NoLandingFilesError,
    SnapshotIntegrityError,
    SnapshotMismatchError,
    create_snapshot,
    list_snapshots,
    open_snapshot,
    read_snapshot_frame,
    snapshot_id_for,
    verify_snapshot,
    write_digits_landing,
)
from pipeline.digests import sha256_file


@pytest.fixture
def landing(tmp_path: Path) -> Path:
    write_digits_landing(tmp_path / "landing")
    return tmp_path / "landing"


def _flip_last_byte(path: Path) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_same_content_gives_same_snapshot_id(tmp_path: Path, landing: Path) -> None:
    other = tmp_path / "other-landing"
    write_digits_landing(other)
    snapshot_id = snapshot_id_for(landing)
    assert snapshot_id == snapshot_id_for(other)
    assert snapshot_id.startswith("digits-")
    assert len(snapshot_id) == len("digits-") + 16


def test_one_changed_byte_gives_a_new_snapshot_id(landing: Path) -> None:
    before = snapshot_id_for(landing)
    # A byte of the data, not of the footer: a file that is no longer Parquet gets no id.
    path = landing / "digits.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert snapshot_id_for(landing) != before


def test_file_name_is_part_of_the_snapshot_id(landing: Path) -> None:
    before = snapshot_id_for(landing)
    (landing / "digits.parquet").rename(landing / "renamed.parquet")
    assert snapshot_id_for(landing) != before


def test_empty_landing_dir_is_refused_naming_the_dir(tmp_path: Path) -> None:
    with pytest.raises(NoLandingFilesError, match="empty-landing"):
        snapshot_id_for(tmp_path / "empty-landing")


def test_manifest_lists_files_sha256_sizes_rows_and_columns(tmp_path: Path, landing: Path) -> None:
    snapshot = create_snapshot(landing, tmp_path / "snapshots", source="unit-test")
    manifest = json.loads((snapshot.path / "manifest.json").read_bytes())
    assert manifest == snapshot.manifest
    assert snapshot.path == tmp_path / "snapshots" / snapshot.snapshot_id
    assert snapshot.snapshot_id == snapshot_id_for(landing)
    assert manifest["snapshot_id"] == snapshot.snapshot_id
    assert manifest["source"] == "unit-test"
    assert manifest["manifest_version"] == 1
    assert manifest["created_at"]
    landing_file = landing / "digits.parquet"
    assert manifest["files"] == [
        {
            "name": "digits.parquet",
            "bytes": landing_file.stat().st_size,
            "sha256": sha256_file(landing_file),
            "rows": 1797,
        }
    ]
    assert manifest["row_count"] == snapshot.row_count == 1797
    columns = {c["name"]: c["dtype"] for c in manifest["columns"]}
    assert list(columns)[:3] == ["sample_id", "split", "label"]
    assert len(columns) == 67
    assert columns["label"] == "int64"
    assert columns["split"] == "string"
    assert snapshot.manifest_sha256 == sha256_file(snapshot.path / "manifest.json")


def test_snapshot_files_are_read_only_and_no_staging_is_left(tmp_path: Path, landing: Path) -> None:
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    for path in (snapshot.path / "manifest.json", snapshot.path / "data" / "digits.parquet"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o444, path
    assert [p.name for p in (tmp_path / "snapshots").iterdir()] == [snapshot.snapshot_id]


def test_creating_a_snapshot_twice_returns_the_same_untouched_snapshot(
    tmp_path: Path, landing: Path
) -> None:
    first = create_snapshot(landing, tmp_path / "snapshots")
    manifest_mtime = (first.path / "manifest.json").stat().st_mtime_ns
    second = create_snapshot(landing, tmp_path / "snapshots")
    assert second == first
    assert (first.path / "manifest.json").stat().st_mtime_ns == manifest_mtime


def test_tampered_snapshot_file_is_detected_naming_the_file(tmp_path: Path, landing: Path) -> None:
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    _flip_last_byte(snapshot.path / "data" / "digits.parquet")
    with pytest.raises(SnapshotIntegrityError, match=r"data/digits\.parquet: sha256") as caught:
        verify_snapshot(snapshot)
    assert caught.value.file == "data/digits.parquet"
    assert caught.value.termination_reason == "bad_input"
    with pytest.raises(SnapshotIntegrityError):
        read_snapshot_frame(snapshot)
    # Idempotent creation verifies what is already there instead of trusting it.
    with pytest.raises(SnapshotIntegrityError):
        create_snapshot(landing, tmp_path / "snapshots")


def test_missing_truncated_and_extra_snapshot_files_are_named(
    tmp_path: Path, landing: Path
) -> None:
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    data_file = snapshot.path / "data" / "digits.parquet"
    os.chmod(data_file, 0o644)
    data_file.write_bytes(data_file.read_bytes()[:-10])
    (snapshot.path / "data" / "stray.parquet").write_bytes(b"x")
    with pytest.raises(SnapshotIntegrityError) as caught:
        verify_snapshot(snapshot)
    problems = dict(caught.value.problems)
    assert "size" in problems["data/digits.parquet"]
    assert problems["data/stray.parquet"] == "not in the manifest"
    data_file.unlink()
    with pytest.raises(SnapshotIntegrityError, match=r"data/digits\.parquet: missing"):
        verify_snapshot(snapshot)


def test_edited_manifest_is_detected(tmp_path: Path, landing: Path) -> None:
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    manifest_path = snapshot.path / "manifest.json"
    manifest = json.loads(manifest_path.read_bytes())
    manifest["files"][0]["sha256"] = "0" * 64
    os.chmod(manifest_path, 0o644)
    manifest_path.write_text(json.dumps(manifest))
    reopened = open_snapshot(tmp_path / "snapshots", snapshot.snapshot_id)
    with pytest.raises(SnapshotIntegrityError, match=r"manifest\.json: file list hashes to"):
        verify_snapshot(reopened)


def test_expected_id_mismatch_names_landing_dir_and_both_ids(tmp_path: Path, landing: Path) -> None:
    registered = snapshot_id_for(landing)
    write_digits_landing(landing, seed=7)  # the producer re-landed different data
    actual = snapshot_id_for(landing)
    with pytest.raises(SnapshotMismatchError) as caught:
        create_snapshot(landing, tmp_path / "snapshots", expected_id=registered)
    message = str(caught.value)
    assert "landing data changed since the partition was registered" in message
    assert str(landing) in message and registered in message and actual in message
    assert not (tmp_path / "snapshots" / registered).exists()


def test_open_snapshot_accepts_the_dir_or_root_and_id(tmp_path: Path, landing: Path) -> None:
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    assert open_snapshot(snapshot.path) == snapshot
    assert open_snapshot(tmp_path / "snapshots", snapshot.snapshot_id) == snapshot


def test_read_snapshot_frame_concatenates_every_file(tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    write_digits_landing(landing, file_name="part-1.parquet")
    write_digits_landing(landing, file_name="part-2.parquet", seed=3)
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    assert [f["name"] for f in snapshot.manifest["files"]] == ["part-1.parquet", "part-2.parquet"]
    frame = read_snapshot_frame(snapshot)
    assert len(frame) == snapshot.row_count == 2 * 1797
    assert list(frame.columns[:3]) == ["sample_id", "split", "label"]


def test_manifest_pointing_outside_the_snapshot_is_refused(tmp_path: Path, landing: Path) -> None:
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    manifest_path = snapshot.path / "manifest.json"
    manifest = json.loads(manifest_path.read_bytes())
    manifest["files"][0]["name"] = "../../landing/digits.parquet"
    os.chmod(manifest_path, 0o644)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(SnapshotIntegrityError, match=r"not a relative path inside data/"):
        open_snapshot(snapshot.path)


def test_list_snapshots_skips_staging_dirs_and_orders_oldest_first(
    tmp_path: Path, landing: Path
) -> None:
    root = tmp_path / "snapshots"
    first = create_snapshot(landing, root)
    write_digits_landing(landing, seed=5)
    second = create_snapshot(landing, root)
    (root / f".staging-{second.snapshot_id}-abc").mkdir()
    assert [s.snapshot_id for s in list_snapshots(root)] == [first.snapshot_id, second.snapshot_id]
    assert list_snapshots(tmp_path / "nothing-here") == []
