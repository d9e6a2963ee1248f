"""Config that cannot be trusted is refused by name, and still leaves its attempt's receipt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.ledger import Ledger
from pipeline.retry import RetryPolicyError, load_retry_policy
from pipeline.trainer import exit_codes
from pipeline.trainer.config import ConfigError, TrainConfig

REPO = Path(__file__).resolve().parent.parent
BASE = {
    "seed": 0, "max_steps": 10, "checkpoint_every_steps": 5, "batch_size": 8,
    "learning_rate": 0.01, "optimizer": "adam", "model": {"channels": 4, "hidden": 8},
    "snapshot_dir": "/nonexistent",
}  # fmt: skip


def test_duplicate_keys_name_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(BASE) + "learning_rate: 100.0\n")
    with pytest.raises(ConfigError, match=r"train.yaml.*duplicate key 'learning_rate'"):
        TrainConfig.load(path)
    with pytest.raises(RetryPolicyError, match="duplicate key 'oom'"):
        load_retry_policy("oom: {max_attempts: 1}\noom: {max_attempts: 9}\n")


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**40}, "seed"),
        ({"learning_rate": float("inf")}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"lr_schedule": {"kind": "cosine", "min_lr": -0.1}}, "lr_schedule.min_lr"),
        ({"momentum": 1.5}, "momentum"),
        ({"weight_decay": float("inf")}, "weight_decay"),
        ({"model_family": "../etc"}, "model family"),
    ],
)
def test_values_that_would_fail_deep_in_training_are_refused_by_key(change: dict, key: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        TrainConfig.from_dict({**BASE, **change}, source="train.yaml")


def test_a_config_that_does_not_load_still_leaves_an_attempt_row(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**BASE, "seed": -1}))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.trainer", "--config", str(path), "--run-id", "r1",
         "--store", str(tmp_path / "store"), "--ledger-url", url],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == exit_codes.CONFIG_ERROR, done.stderr[-2000:]
    [attempt] = Ledger.open(url).attempts("r1")
    assert attempt.status == "failed" and attempt.termination_reason == "user_code_error"
    assert "seed" in attempt.termination_detail
    assert attempt.config_snapshot["unloadable_config"] == str(path)
    assert attempt.launched_by["via"] == "cli"
