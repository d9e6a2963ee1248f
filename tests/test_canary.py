"""The CI canary: real data and config under strict limits, judged by the asset checks.

Also ``python -m pipeline.checkpoint.restore_check``, the new-process restore the canary (and
every training run) relies on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from definitions import build_definitions
from pipeline.cli import main
from pipeline.digests import sha256_bytes
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from sensors.canary import CanaryVerdict, run_canary
from tests.checkpoint_support import resign
from tests.trainer_support import small_checkpoint

CONDITIONS = [
    "run_succeeded",
    "loss_falls",
    "checkpoint_committed",
    "restores_in_new_process",
    "provenance_complete",
    "within_minutes",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_checkpoint(tmp_path_factory.mktemp("restore"))


def restore_check(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.checkpoint.restore_check", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _flip_a_byte(directory: Path) -> str:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return "model.safetensors"


def _resign_changed_weights(directory: Path) -> str:
    """Change a weight and re-sign MANIFEST.json and COMMITTED: only the probe can tell."""
    path = directory / "model.safetensors"
    tensors = load_safetensors(path.read_bytes())
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.05
    data = save_safetensors(tensors, metadata={"format": "pt"})
    path.write_bytes(data)
    resign(directory, "model.safetensors")
    return "probe.safetensors"


def test_restore_check_restores_in_a_new_process_and_matches_the_probe(checkpoint: Path) -> None:
    proc = restore_check(checkpoint)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.splitlines()
    verdict = json.loads(line)
    assert verdict["ok"] is True
    assert verdict["step"] == 20 and verdict["run_id"] == "r1"
    assert verdict["manifest_sha256"] == sha256_bytes((checkpoint / "MANIFEST.json").read_bytes())
    assert verdict["probe_max_abs_diff"] == 0.0 and verdict["probe_comparison"] == "exact"
    assert verdict["seconds"] > 0


@pytest.mark.parametrize("tamper", [_flip_a_byte, _resign_changed_weights])
def test_restore_check_on_a_tampered_checkpoint_exits_non_zero_naming_the_file(
    checkpoint: Path, tmp_path: Path, tamper
) -> None:
    tampered = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, tampered)
    file = tamper(tampered)

    proc = restore_check(tampered)
    assert proc.returncode != 0
    verdict = json.loads(proc.stdout.splitlines()[-1])
    assert verdict["ok"] is False and verdict["file"] == file
    assert str(tampered) in proc.stderr and file in proc.stderr, proc.stderr


@pytest.mark.slow
def test_canary_on_real_data_passes_every_condition(tracks_home: Path) -> None:
    settings = TracksSettings.from_env()
    with dg.DagsterInstance.get() as instance:
        verdict = run_canary(build_definitions(settings), instance, max_steps=120, max_minutes=5)

    assert verdict.passed, "\n".join(verdict.lines())
    assert [c.name for c in verdict.conditions] == CONDITIONS
    by_name = {c.name: c.detail for c in verdict.conditions}
    assert "probe max abs diff 0" in by_name["restores_in_new_process"]
    assert "holdout_accuracy" in by_name["provenance_complete"]
    # Its own snapshot partition, from its own landing file: never a production snapshot's.
    assert (tracks_home / "canary" / "landing" / "canary-digits.parquet").is_file()
    assert not list(settings.landing_root.iterdir())

    ledger = Ledger.open(settings.ledger_url)
    run = ledger.get_run(verdict.run_id)
    assert run.purpose == "canary" and run.snapshot_id == verdict.snapshot_id
    [attempt] = ledger.attempts(run.run_id)
    assert attempt.termination_reason == "succeeded"
    assert ledger.latest_committed_checkpoint(run.run_id).step == 120
    assert ledger.promotions(run_id=run.run_id) == []  # a canary never promotes


@pytest.mark.slow
def test_canary_whose_loss_does_not_fall_fails_and_the_command_says_why(
    tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with dg.DagsterInstance.get() as instance:
        verdict = run_canary(
            build_definitions(TracksSettings.from_env()),
            instance,
            max_steps=40,
            max_minutes=5,
            training={"learning_rate": 1e-9},
        )
    assert not verdict.passed
    assert [c.name for c in verdict.failed] == ["loss_falls"]
    assert "did not fall enough" in verdict.summary()

    # `tracks canary` prints every condition and exits non-zero with the reason.
    def fake_run_canary(*args: object, **kwargs: object) -> CanaryVerdict:
        return verdict

    monkeypatch.setattr("sensors.canary.run_canary", fake_run_canary)
    result = CliRunner().invoke(main, ["canary"])
    assert result.exit_code == 1
    assert "canary FAILED" in result.output
    assert "FAIL  loss_falls" in result.output
    assert "pass  restores_in_new_process" in result.output
    assert "canary failed: loss_falls" in result.output


@pytest.mark.slow
def test_tracks_canary_from_a_shell_exits_zero(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKS_", "DAGSTER_"))}
    env["TRACKS_HOME"] = str(tmp_path / "home")
    tracks = Path(sys.executable).parent / "tracks"
    proc = subprocess.run(
        [str(tracks), "canary", "--max-steps", "60", "--max-minutes", "5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.startswith("canary PASSED")
    for name in CONDITIONS:
        assert f"pass  {name}" in proc.stdout
