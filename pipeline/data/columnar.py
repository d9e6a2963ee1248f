"""A snapshot's columns as numpy arrays, read without pandas.

pyarrow imports pandas the first time ``pq.read_table`` runs or a column is converted to numpy
(``to_numpy``, ``to_pylist``, ``pyarrow.compute.equal`` alike), whether or not a DataFrame is
ever made: 0.2 CPU-seconds on the 2-vCPU VM, in every trainer process and every rank, on every
resume. The trainer needs a few columns as arrays, so it reads them here: ``ParquetFile.read``
and the Arrow buffers themselves (a fixed-width column's values buffer, a string column's
offsets and bytes), which import nothing more.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipeline.data.errors import DataError, MissingColumnError

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.data.snapshot import Snapshot


class ColumnValuesError(DataError):
    """A column holds nulls, or values of a type the reader does not turn into an array."""

    def __init__(self, file: str, column: str, problem: str) -> None:
        super().__init__(f"column {column!r} of {file} {problem}")
        self.file = file
        self.column = column


def read_snapshot_columns(
    snapshot: Snapshot, names: Sequence[str], *, verify: bool = True
) -> dict[str, np.ndarray]:
    """``names`` of every file of ``snapshot`` (verified first unless told not to), in manifest
    order, each as one array: numbers as their own dtype, strings as ``str``.

    Raises :class:`MissingColumnError` naming the file that lacks a column, and
    :class:`ColumnValuesError` for nulls or a type other than numbers and strings.
    """
    import pyarrow.parquet as pq

    from pipeline.data.snapshot import DATA_DIR, verify_snapshot

    if verify:
        verify_snapshot(snapshot)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for entry in snapshot.manifest["files"]:
        relative = f"{snapshot.path.name}/{DATA_DIR}/{entry['name']}"
        parquet = pq.ParquetFile(snapshot.data_dir / entry["name"])
        present = set(parquet.schema_arrow.names)
        for name in names:
            if name not in present:
                raise MissingColumnError(name, relative)
        table = parquet.read(columns=list(names))
        for name in names:
            parts[name].append(_column_values(table.column(name).chunks, relative, name))
    return {
        name: np.concatenate(arrays) if len(arrays) != 1 else arrays[0]
        for name, arrays in parts.items()
    }


def _column_values(chunks: Iterable[pa.Array], file: str, column: str) -> np.ndarray:
    import pyarrow as pa

    values: list[np.ndarray] = []
    for chunk in chunks:
        if not len(chunk):  # an empty row group's buffers may be absent
            continue
        if chunk.null_count:
            raise ColumnValuesError(file, column, f"holds {chunk.null_count} null values")
        kind = chunk.type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            values.append(_fixed_width(chunk, _numpy_dtype(kind)))
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            values.append(_strings(chunk, np.int64 if pa.types.is_large_string(kind) else np.int32))
        else:
            raise ColumnValuesError(file, column, f"is of type {kind}, not numbers or strings")
    if not values:
        return np.empty(0)
    # A copy, always: torch cannot own a read-only view of Arrow's memory.
    return np.concatenate(values) if len(values) != 1 else values[0].copy()


def _numpy_dtype(kind: pa.DataType) -> np.dtype:
    import pyarrow as pa

    letter = "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) else "u"
    return np.dtype(f"{letter}{kind.bit_width // 8}")


def _fixed_width(chunk: pa.Array, dtype: np.dtype) -> np.ndarray:
    data = chunk.buffers()[1]
    return np.frombuffer(data, dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize)


def _strings(chunk: pa.Array, offset_type: type[np.integer]) -> np.ndarray:
    _, offsets_buffer, data = chunk.buffers()
    width = np.dtype(offset_type).itemsize
    offsets = np.frombuffer(
        offsets_buffer, dtype=offset_type, count=len(chunk) + 1, offset=chunk.offset * width
    ).tolist()
    raw = data.to_pybytes() if data is not None else b""
    texts = [raw[start:end].decode("utf-8") for start, end in itertools.pairwise(offsets)]
    return np.array(texts, dtype=str) if texts else np.empty(0, dtype=str)
