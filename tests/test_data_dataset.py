from pathlib import Path

import pandas as pd
import pytest
import torch

from pipeline.data import (
    MissingColumnError,
    UnknownSplitError,
    create_snapshot,
    eval_task_set_version,
    read_snapshot_frame,
    split_tensors,
    write_digits_landing,
)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    root: Path = tmp_path_factory.mktemp("data")
    write_digits_landing(root / "landing")
    return read_snapshot_frame(create_snapshot(root / "landing", root / "snapshots"))


def test_split_tensors_shapes_dtypes_and_scale(digits: pd.DataFrame) -> None:
    train_x, train_y = split_tensors(digits, "train")
    eval_x, eval_y = split_tensors(digits, "eval")
    assert train_x.dtype == torch.float32 and eval_x.dtype == torch.float32
    assert train_y.dtype == torch.int64 and eval_y.dtype == torch.int64
    assert train_x.shape[1:] == (1, 8, 8) and eval_x.shape[1:] == (1, 8, 8)
    assert train_x.shape[0] == train_y.shape[0]
    assert train_x.shape[0] + eval_x.shape[0] == 1797
    assert 340 <= eval_x.shape[0] <= 380
    assert float(train_x.min()) == 0.0 and float(train_x.max()) == 1.0
    assert set(train_y.tolist()) == set(range(10))


def test_split_tensors_follow_sample_id_not_row_order(digits: pd.DataFrame) -> None:
    images, labels = split_tensors(digits, "eval")
    shuffled = digits.sample(frac=1.0, random_state=3)
    again_images, again_labels = split_tensors(shuffled, "eval")
    assert torch.equal(images, again_images)
    assert torch.equal(labels, again_labels)
    first = digits[digits["split"] == "eval"].sort_values("sample_id").iloc[0]
    assert int(labels[0]) == first["label"]
    assert float(images[0, 0, 0, 1]) == first["px_01"] / 16


def test_eval_task_set_version_depends_only_on_eval_rows(digits: pd.DataFrame) -> None:
    version = eval_task_set_version(digits)
    assert len(version) == 64
    assert eval_task_set_version(digits.sample(frac=1.0, random_state=1)) == version
    train_changed = digits.copy()
    train_changed.loc[train_changed["split"] == "train", "px_00"] = 3
    assert eval_task_set_version(train_changed) == version
    eval_changed = digits.copy()
    first_eval = eval_changed.index[eval_changed["split"] == "eval"][0]
    eval_changed.loc[first_eval, "px_33"] = (eval_changed.loc[first_eval, "px_33"] + 1) % 17
    assert eval_task_set_version(eval_changed) != version


def test_unknown_split_and_missing_column_are_named(digits: pd.DataFrame) -> None:
    with pytest.raises(UnknownSplitError, match="'test'"):
        split_tensors(digits, "test")
    with pytest.raises(MissingColumnError, match="'label'"):
        split_tensors(digits.rename(columns={"label": "digit"}), "train")
