"""The trainer's way into a snapshot: its columns as arrays, read without pandas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data import create_snapshot, read_snapshot_frame, write_digits_landing
from pipeline.data.columnar import ColumnValuesError, read_snapshot_columns
from pipeline.data.columns import COLUMNS, LABEL, SAMPLE_ID, SPLIT, SPLITS
from pipeline.data.dataset import split_arrays, split_tensors
from pipeline.data.errors import MissingColumnError
from pipeline.data.landing import Drift
from pipeline.data.snapshot import Snapshot
from pipeline.trainer.families import BadInputError, digits_examples

REPO = Path(__file__).resolve().parent.parent


def _snapshot_of(root: Path, tables: dict[str, pa.Table]) -> Snapshot:
    """A snapshot of ``tables``, each written as one landing file (row groups of 100 rows:
    each column comes back in several chunks)."""
    landing = root / "landing"
    landing.mkdir(parents=True)
    for name, table in tables.items():
        pq.write_table(table, landing / name, row_group_size=100)
    return create_snapshot(landing, root / "snapshots")


def test_two_files_read_as_arrays_give_the_frames_tensors_bit_for_bit(tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    write_digits_landing(landing, file_name="part-1.parquet")
    write_digits_landing(landing, file_name="part-2.parquet", seed=3)
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    columns = read_snapshot_columns(snapshot, COLUMNS)
    frame = read_snapshot_frame(snapshot)
    for name in COLUMNS:
        assert columns[name].tolist() == frame[name].tolist(), name
    assert columns[LABEL].dtype == np.int64 and columns[SPLIT].dtype.kind == "U"
    for split in SPLITS:
        images, labels = split_arrays(columns, split)
        expected_images, expected_labels = split_tensors(frame, split)
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
        assert images.dtype == torch.float32 and labels.dtype == torch.int64


def test_chunked_sliced_and_unicode_columns_come_back_whole(tmp_path: Path) -> None:
    texts = ["train", "ëval", "", "train✓"] * 60
    table = pa.table(
        {
            "n": pa.array(range(240), pa.int16()),
            "x": pa.array([i / 4 for i in range(240)], pa.float32()),
            "s": pa.array(texts, pa.string()),
            "big": pa.array(texts, pa.large_string()),
        }
    )
    snapshot = _snapshot_of(tmp_path, {"t.parquet": table})
    got = read_snapshot_columns(snapshot, ("n", "x", "s", "big"))
    assert got["n"].dtype == np.int16 and got["n"].tolist() == list(range(240))
    assert got["x"].dtype == np.float32 and got["x"].tolist() == [i / 4 for i in range(240)]
    assert got["s"].tolist() == texts and got["big"].tolist() == texts
    assert all(array.flags.writeable for array in got.values())


@pytest.mark.parametrize(
    ("column", "values", "problem"),
    [
        ("px_07", pa.array([1, None, 3], pa.int64()), "holds 1 null values"),
        ("px_07", pa.array([True, False, True]), "is of type bool, not numbers or strings"),
    ],
    ids=["null", "bool"],
)
def test_a_column_the_reader_cannot_turn_into_an_array_is_named_with_its_file(
    tmp_path: Path, column: str, values: pa.Array, problem: str
) -> None:
    snapshot = _snapshot_of(tmp_path, {"bad.parquet": pa.table({column: values})})
    with pytest.raises(ColumnValuesError) as raised:
        read_snapshot_columns(snapshot, (column,))
    assert str(raised.value) == (
        f"column {column!r} of {snapshot.snapshot_id}/data/bad.parquet {problem}"
    )


def test_a_missing_column_names_the_file_that_lacks_it(tmp_path: Path) -> None:
    snapshot = _snapshot_of(tmp_path, {"thin.parquet": pa.table({SAMPLE_ID: [1, 2]})})
    with pytest.raises(MissingColumnError, match=r"'label' is missing from .*/data/thin\.parquet"):
        read_snapshot_columns(snapshot, (SAMPLE_ID, LABEL))


def test_the_trainer_refuses_null_and_nan_pixels_as_bad_input(tmp_path: Path) -> None:
    landing = tmp_path / "nulls"
    write_digits_landing(landing, drift=Drift.NULLS)
    nulls = create_snapshot(landing, tmp_path / "snapshots")
    with pytest.raises(BadInputError, match=r"column 'px_\d\d' of .* holds \d+ null values"):
        digits_examples(nulls)

    frame = read_snapshot_frame(nulls, verify=False).fillna(0)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    nan = pa.array([float("nan"), *[0.0] * (len(frame) - 1)], pa.float64())
    table = table.set_column(table.schema.get_field_index("px_05"), "px_05", nan)
    with pytest.raises(BadInputError, match=r"outside 0\.\.16 \(or are NaN\) in px_05"):
        digits_examples(_snapshot_of(tmp_path / "nan", {"nan.parquet": table}))


def test_a_trainer_reading_its_snapshot_never_imports_pandas(tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    write_digits_landing(landing)
    snapshot = create_snapshot(landing, tmp_path / "snapshots")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pipeline.data.snapshot import open_snapshot\n"
        "from pipeline.trainer.families import digits_examples\n"
        f"(train, _), _ = digits_examples(open_snapshot(Path({str(snapshot.path)!r})))\n"
        "assert train.shape[1:] == (1, 8, 8), train.shape\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pandas'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
