from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.data import COLUMNS, PIXEL_COLUMNS, Drift, landing_files, write_digits_landing
from pipeline.digests import sha256_file


def test_landing_file_has_the_digits_columns_in_order_with_int64_values(tmp_path: Path) -> None:
    path = write_digits_landing(tmp_path / "landing")
    table = pq.read_table(path)
    assert tuple(table.column_names) == COLUMNS
    assert table.num_rows == 1797
    for name in ("sample_id", "label", *PIXEL_COLUMNS):
        assert str(table.schema.field(name).type) == "int64"
    df = table.to_pandas()
    assert df["sample_id"].is_unique
    assert sorted(df["sample_id"]) == list(range(1797))
    assert df[list(PIXEL_COLUMNS)].min().min() == 0
    assert df[list(PIXEL_COLUMNS)].max().max() == 16


def test_eval_split_is_about_a_fifth_of_every_label(tmp_path: Path) -> None:
    df = pq.read_table(write_digits_landing(tmp_path)).to_pandas()
    assert set(df["split"]) == {"train", "eval"}
    eval_share = (df["split"] == "eval").groupby(df["label"]).mean()
    assert eval_share.between(0.18, 0.22).all(), eval_share


def test_same_seed_writes_identical_bytes_and_another_seed_another_split(tmp_path: Path) -> None:
    first = sha256_file(write_digits_landing(tmp_path / "a"))
    again = sha256_file(write_digits_landing(tmp_path / "b"))
    other = sha256_file(write_digits_landing(tmp_path / "c", seed=1))
    assert first == again
    assert first != other


def test_renamed_column_drift_calls_label_digit(tmp_path: Path) -> None:
    path = write_digits_landing(tmp_path, drift=Drift.RENAMED_COLUMN)
    names = pq.read_schema(path).names
    assert "label" not in names
    assert names[2] == "digit"


def test_landing_files_are_sorted_and_skip_hidden_and_temp_files(tmp_path: Path) -> None:
    write_digits_landing(tmp_path, file_name="b.parquet")
    write_digits_landing(tmp_path, file_name="a.parquet")
    (tmp_path / ".a.parquet.123.tmp").write_bytes(b"half a file")
    (tmp_path / ".hidden.parquet").write_bytes(b"x")
    (tmp_path / "_temporary").mkdir()
    (tmp_path / "_temporary" / "part.parquet").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not data")
    assert [p.name for p in landing_files(tmp_path)] == ["a.parquet", "b.parquet"]
    assert landing_files(tmp_path / "does-not-exist") == []


def test_landing_write_leaves_no_temp_file_behind(tmp_path: Path) -> None:
    write_digits_landing(tmp_path, drift=Drift.NULLS)
    assert [p.name for p in tmp_path.iterdir()] == ["digits.parquet"]


def test_landing_file_name_must_be_visible_parquet(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"digits\.csv"):
        write_digits_landing(tmp_path, file_name="digits.csv")
