"""Ids and paths: nothing leaves its folder, nothing follows a link, no run aliases another.

Each case was reproduced on the landed main before the fix: a run id of ``../../x`` committed
checkpoints outside the store, ``./victim`` marked run ``victim``'s checkpoints corrupt, a
symlinked tensor file was read, ``--file-name ../x.parquet`` wrote outside the landing folder,
a 300-character id ended as a retryable ``infra_transient``, and retention without a ledger
counted a corrupt checkpoint toward keep_last_k.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import ids
from pipeline.checkpoint import MODEL_FILE, checkpoint_dirs
from pipeline.checkpoint.errors import CorruptCheckpointError
from pipeline.checkpoint.layout import CORRUPT_FILE, run_dir
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.verify import verify_checkpoint
from pipeline.cli import main
from pipeline.ledger import AttemptStart, Ledger
from pipeline.safepath import UnsafePathError
from pipeline.states import CheckpointState
from pipeline.trainer import exit_codes
from tests.checkpoint_support import (
    RUN_ID,
    checkpoint_manager,
    save_at,
    training_data,
    training_state,
)

REPO = Path(__file__).resolve().parent.parent
BAD_RUN_IDS = ["../../x", "/tmp/abs", "", ".", "./victim", "a/b", "x" * 300, "run\n"]


@pytest.mark.parametrize("bad", BAD_RUN_IDS)
def test_trainer_refuses_a_run_id_that_would_leave_the_store_as_bad_input(
    tmp_path: Path, bad: str
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text("max_steps: 1\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.trainer", "--config", str(config), "--run-id", bad,
         "--store", str(store)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Bad input (never retried), said in one line, and nothing written anywhere.
    assert done.returncode == exit_codes.BAD_INPUT, done.stderr
    assert "invalid run id" in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("bad", BAD_RUN_IDS)
def test_run_dir_and_ledger_refuse_bad_run_ids(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ids.InvalidIdError):
        run_dir(tmp_path, bad)
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    with pytest.raises(ids.InvalidIdError):
        ledger.create_run(
            run_id=bad, model_family="digits-cnn", owner="t", purpose="baseline",
            config_sha256="c" * 64, snapshot_id="digits-0123456789abcdef",
        )  # fmt: skip


def test_run_folder_that_is_a_symlink_out_of_the_store_is_refused(tmp_path: Path) -> None:
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, store / "victim")
    with pytest.raises(UnsafePathError, match="symlink"):
        run_dir(store, "victim")


def test_one_run_can_never_mark_another_runs_checkpoints(ledger_url: str, tmp_path: Path) -> None:
    ledger = Ledger.open(ledger_url)
    for run in ("victim", "attacker"):
        ledger.create_run(
            run_id=run, model_family="digits-cnn", owner="t", purpose="baseline",
            config_sha256="c" * 64, snapshot_id="digits-0123456789abcdef",
        )  # fmt: skip
    attempt = ledger.begin_attempt(
        "victim",
        AttemptStart(config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="f" * 64,
                     container_digest="test"),
    )  # fmt: skip
    path = str(tmp_path / "store" / "victim" / "step-0000000010-a01")
    ledger.checkpoint_writing(
        run_id="victim", attempt_no=attempt.attempt_no, step=10, path=path,
        fencing_token=attempt.fencing_token,
    )  # fmt: skip
    ledger.commit_checkpoint(
        run_id="victim", attempt_no=attempt.attempt_no, path=path, manifest_sha256="a" * 64,
        size_bytes=1, metrics=None, fencing_token=attempt.fencing_token, step=10,
    )  # fmt: skip
    changed = ledger.set_checkpoint_state("attacker", path, CheckpointState.CORRUPT, "not yours")
    assert changed == 0
    assert ledger.get_checkpoint(path).state == CheckpointState.COMMITTED


def _three_checkpoints(tmp_path: Path) -> list[Path]:
    data = training_data()
    state = training_state(data)
    return save_at(checkpoint_manager(tmp_path), state, data, [10, 20, 30])


def test_a_symlinked_tensor_file_is_refused_and_resume_uses_the_previous(tmp_path: Path) -> None:
    paths = _three_checkpoints(tmp_path)
    # Same bytes, so size and sha256 still match: only the link itself gives it away.
    outside = tmp_path / "outside.safetensors"
    target = paths[-1] / MODEL_FILE
    outside.write_bytes(target.read_bytes())
    target.unlink()
    os.symlink(outside, target)
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        verify_checkpoint(paths[-1])
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        load_checkpoint(paths[-1])
    data = training_data()
    resumed = training_state(data, seed=3)
    info = checkpoint_manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.path == paths[1]
    assert (paths[-1] / CORRUPT_FILE).is_file()  # ruled out on disk, no ledger needed


def test_a_symlinked_checkpoint_folder_is_never_a_checkpoint(tmp_path: Path) -> None:
    paths = _three_checkpoints(tmp_path)
    outside = tmp_path / "outside"
    paths[-1].rename(outside)
    os.symlink(outside, paths[-1])
    assert paths[-1] not in checkpoint_dirs(paths[-1].parent)
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        verify_checkpoint(paths[-1])


def test_retention_without_a_ledger_does_not_count_a_corrupt_checkpoint(tmp_path: Path) -> None:
    data = training_data()
    state = training_state(data)
    manager = checkpoint_manager(tmp_path, keep_last_k=2)
    paths = save_at(manager, state, data, [10, 20])
    # The newest is damaged; a new attempt falls back to step 10 and trains on.
    blob = (paths[-1] / MODEL_FILE).read_bytes()
    (paths[-1] / MODEL_FILE).write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    resumed = training_state(data, seed=5)
    resumer = checkpoint_manager(tmp_path, attempt=2, keep_last_k=2)
    assert resumer.resume(resumed).path == paths[0]
    newer = save_at(resumer, resumed, data, [20, 30])
    # keep_last_k=2 keeps two GOOD checkpoints: the corrupt one is not counted (nor deleted).
    assert checkpoint_dirs(paths[0].parent) == [newer[1], newer[0]]
    for path in newer:
        verify_checkpoint(path)
    assert (paths[-1] / CORRUPT_FILE).is_file()


def test_landing_file_name_cannot_leave_the_landing_folder(tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    for bad in ("../x.parquet", "/tmp/x.parquet", "sub/x.parquet", ".hidden.parquet", "x.csv"):
        result = CliRunner().invoke(
            main, ["landing", "digits", "--landing-dir", str(landing), "--file-name", bad]
        )
        assert result.exit_code == 2, result.output
        assert "invalid landing file name" in result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "x.parquet").exists()
    assert not landing.exists() or not any(landing.rglob("*"))


def test_run_id_of_the_manager_matches_its_folder() -> None:
    assert ids.run_id(RUN_ID) == RUN_ID


@pytest.mark.parametrize("dangling", [True, False], ids=["dangling", "to_a_file"])
def test_instance_init_never_writes_through_a_symlinked_dagster_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dangling: bool
) -> None:
    home, outside = tmp_path / "dagster", tmp_path / "outside.yaml"
    home.mkdir()
    if not dangling:
        outside.write_text("precious: true\n")
    (home / "dagster.yaml").symlink_to(outside)
    monkeypatch.setenv("TRACKS_HOME", str(tmp_path / "tracks"))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    for args in (["instance", "init"], ["instance", "init", "--postgres"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, result.output
        assert "dagster.yaml: is a symlink; Tracks does not follow links" in result.output
    assert outside.exists() is not dangling
    assert dangling or outside.read_text() == "precious: true\n"


def test_a_landing_file_that_is_a_symlink_is_refused_not_snapshotted(tmp_path: Path) -> None:
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    landing, secret = tmp_path / "landing", tmp_path / "secret.parquet"
    write_digits_landing(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "digits.parquet").rename(secret)
    landing.mkdir()
    (landing / "digits.parquet").symlink_to(secret)
    result = CliRunner().invoke(main, ["snapshot-id", "--landing-dir", str(landing)])
    assert result.exit_code == 1, result.output
    assert "digits.parquet: is a symlink; Tracks does not follow links" in result.output
    with pytest.raises(UnsafePathError, match="is a symlink"):
        create_snapshot(landing, tmp_path / "snapshots")
    assert not (tmp_path / "snapshots").exists() or not any((tmp_path / "snapshots").rglob("*"))
