"""``TrainConfig``: every key checked, errors that name the file and the key, a stable digest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.trainer import ConfigError, TrainConfig

MINIMAL: dict[str, Any] = {
    "seed": 0,
    "max_steps": 60,
    "checkpoint_every_steps": 10,
    "batch_size": 32,
    "learning_rate": 0.003,
    "optimizer": "adam",
    "model": {"channels": 8, "hidden": 32, "dropout": 0.1},
    "snapshot_dir": "snapshots/digits-abc",
}


def _write(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_loads_yaml_fills_defaults_and_resolves_snapshot_dir_against_the_file(
    tmp_path: Path,
) -> None:
    config = TrainConfig.load(_write(tmp_path, MINIMAL))
    assert config.snapshot_dir == str(tmp_path / "snapshots" / "digits-abc")
    resolved = config.to_dict()
    assert resolved["model"] == {"channels": 8, "hidden": 32, "dropout": 0.1}
    assert resolved["lr_schedule"]["kind"] == "constant"
    assert resolved["keep_last_k"] == 3 and resolved["max_wall_seconds"] is None
    # The digest is of the resolved dict: spelling a default out changes nothing.
    explicit = TrainConfig.load(_write(tmp_path, {**MINIMAL, "keep_last_k": 3}))
    assert explicit.sha256() == config.sha256()
    assert TrainConfig.from_dict(resolved).to_dict() == resolved


def test_accepts_the_orchestrators_resolved_config() -> None:
    from_assets = {
        **MINIMAL, "model_family": "digits-cnn", "weight_decay": 0.0, "keep_last_k": 3,
        "snapshot_dir": "/data/snapshots/digits-abc",
    }  # fmt: skip
    assert TrainConfig.from_dict(from_assets).snapshot_dir == "/data/snapshots/digits-abc"


def test_numbers_in_exponent_notation_are_numbers(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "learning_rate": 0.123}).replace("0.123", "3e-4"))
    assert TrainConfig.load(path).learning_rate == 3e-4


@pytest.mark.parametrize(
    ("change", "key", "problem"),
    [
        ({"learning_rat": 0.1}, "learning_rat", "is not a known key"),
        ({"model": {"channels": 8, "hiden": 3}}, "model.hiden", "is not a known key"),
        ({"seed": None}, "seed", "must not be null"),
        ({"seed": "zero"}, "seed", "must be an integer"),
        ({"max_steps": 1.5}, "max_steps", "must be an integer"),
        ({"max_steps": True}, "max_steps", "must be an integer"),
        ({"learning_rate": "fast"}, "learning_rate", "must be a number"),
        ({"optimizer": "lion"}, "optimizer", "must be one of adam, sgd"),
        ({"lr_schedule": {"kind": "linear"}}, "lr_schedule.kind", "must be one of"),
        ({"model": [8, 32]}, "model", "must be a mapping"),
        ({"max_wall_seconds": -1}, "max_wall_seconds", "must be > 0"),
        ({"model": {"dropout": 1.5}}, "model.dropout", "must be in [0, 1)"),
    ],
)
def test_bad_key_is_a_config_error_naming_file_and_key(
    tmp_path: Path, change: dict[str, Any], key: str, problem: str
) -> None:
    path = _write(tmp_path, {**MINIMAL, **change})
    with pytest.raises(ConfigError) as caught:
        TrainConfig.load(path)
    assert caught.value.key == key and caught.value.source == str(path)
    assert str(path) in str(caught.value) and problem in str(caught.value)


def test_missing_snapshot_dir_is_named(tmp_path: Path) -> None:
    values = {k: v for k, v in MINIMAL.items() if k != "snapshot_dir"}
    with pytest.raises(ConfigError, match=r"train\.yaml: snapshot_dir: is required"):
        TrainConfig.load(_write(tmp_path, values))


def test_every_key_but_snapshot_dir_left_out_takes_the_one_default(tmp_path: Path) -> None:
    config = TrainConfig.load(_write(tmp_path, {"snapshot_dir": "snapshots/digits-abc"}))
    assert (config.seed, config.max_steps, config.optimizer) == (0, 300, "adam")
    assert config.model.channels == 16 and config.lr_schedule.kind == "constant"


def test_unreadable_or_non_mapping_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot be read"):
        TrainConfig.load(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: must be a mapping"):
        TrainConfig.load(path)
    path.write_text("seed: [\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: is not valid YAML"):
        TrainConfig.load(path)


def test_config_is_frozen() -> None:
    config = TrainConfig.from_dict(MINIMAL)
    with pytest.raises(AttributeError):
        config.seed = 1  # type: ignore[misc]


def test_async_save_is_on_by_default_and_must_be_a_boolean(tmp_path: Path) -> None:
    assert TrainConfig.from_dict(MINIMAL).async_save is True
    assert TrainConfig.from_dict({**MINIMAL, "async_save": False}).async_save is False
    with pytest.raises(ConfigError, match="async_save: must be true or false, got 'yes'"):
        TrainConfig.from_dict({**MINIMAL, "async_save": "yes"})
    with pytest.raises(ConfigError, match="async_save: must be true or false, got 1"):
        TrainConfig.from_dict({**MINIMAL, "async_save": 1})


def test_operational_settings_do_not_change_the_config_digest() -> None:
    base = TrainConfig.from_dict(dict(MINIMAL))
    operated = TrainConfig.from_dict(
        {
            **MINIMAL,
            "async_save": False,
            "keep_last_k": 9,
            "log_every_steps": 1,
            "max_wall_seconds": 60,
        }
    )
    assert operated.sha256() == base.sha256()
    assert operated.to_dict() != base.to_dict()  # the snapshot still records them
    assert TrainConfig.from_dict({**MINIMAL, "batch_size": 7}).sha256() != base.sha256()
