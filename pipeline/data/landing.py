"""Landing files: the digits data set written as Parquet, clean or drifted on purpose."""

from __future__ import annotations

import os
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import ids, safepath
from pipeline.data._fs import fsync_dir, fsync_file
from pipeline.data.columns import (
    LABEL,
    LABELS,
    PIXEL_COLUMNS,
    SAMPLE_ID,
    SPLIT,
    SPLIT_EVAL,
    SPLIT_TRAIN,
)
from pipeline.data.families import FAMILY_LANDING_SUBDIRS

if TYPE_CHECKING:
    import pyarrow as pa

DEFAULT_FILE_NAME = "digits.parquet"
EVAL_FRACTION = 0.2


class Drift(StrEnum):
    """Ways to land bad data on purpose (tests, drills, ``tracks landing digits --drift``)."""

    RENAMED_COLUMN = "renamed_column"  # label is called "digit"
    LABEL_OUT_OF_RANGE = "label_out_of_range"  # some labels are 10, 11 or 12
    PIXEL_OUT_OF_RANGE = "pixel_out_of_range"  # some pixels are 40
    NULLS = "nulls"  # some pixels are null


def write_digits_landing(
    landing_dir: Path,
    *,
    drift: Drift | None = None,
    file_name: str | None = None,
    seed: int = 0,
) -> Path:
    """Write scikit-learn's digits as one Parquet file in ``landing_dir`` and return its path.

    Columns: ``sample_id``, ``split`` (stratified ~20% ``eval``), ``label``, ``px_00`` …
    ``px_63``. ``drift`` spoils the data in one known way. The same arguments always give
    the same bytes, so landing the same data twice keeps the same snapshot id. The file
    appears atomically: a reader sees the old file or the new one, never half of one.
    """
    # Imported here: scikit-learn and pyarrow are only needed to produce landing data; a
    # trainer lists a snapshot's files through this module and never writes any.
    import pyarrow as pa
    from sklearn.datasets import load_digits

    digits = load_digits()
    labels = digits.target.astype(np.int64)
    pixels = digits.data.astype(np.int64)
    rng = np.random.default_rng(seed)
    columns: dict[str, pa.Array] = {
        SAMPLE_ID: pa.array(np.arange(len(labels), dtype=np.int64)),
        SPLIT: pa.array(_stratified_split(labels, rng), pa.string()),
        LABEL: pa.array(labels),
    }
    for index, name in enumerate(PIXEL_COLUMNS):
        columns[name] = pa.array(pixels[:, index])
    if drift is not None:
        columns = _apply_drift(columns, Drift(drift), rng)

    # One plain .parquet name, never a path: `../x.parquet` would land outside the folder, and a
    # hidden name would never be seen by landing_files (the data silently never snapshotted).
    name = ids.landing_file_name(file_name or DEFAULT_FILE_NAME)
    # Not resolved: a symlinked landing folder is refused, never written through.
    path = safepath.under(_landing_folder(landing_dir), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table_atomically(pa.table(columns), path)
    return path


def landing_files(landing_dir: Path) -> list[Path]:
    """The Parquet files under ``landing_dir`` in sorted order, skipping hidden and temp files.

    Another family's landing folder directly below (``text-lm/``) is not this folder's data:
    the digits land in the landing root itself, and a text file must never enter their snapshot.

    A file reached through a symlink is refused (:class:`~pipeline.safepath.UnsafePathError`),
    not skipped: a snapshot would otherwise copy bytes from outside the folder, or quietly
    leave data out. So is a landing folder that is a symlink, or lies under one.
    """
    _landing_folder(landing_dir)
    landing_dir = Path(landing_dir)
    if not landing_dir.is_dir():
        return []
    found = []
    for path in landing_dir.rglob("*.parquet"):
        relative = path.relative_to(landing_dir)
        # Dot- and underscore-prefixed names are in-flight writes (ours, Spark's _temporary).
        if any(part.startswith((".", "_")) for part in relative.parts):
            continue
        if len(relative.parts) > 1 and relative.parts[0] in FAMILY_LANDING_SUBDIRS:
            continue
        safepath.no_symlinks(landing_dir, path)
        if path.is_file():
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(landing_dir).as_posix())


def _landing_folder(landing_dir: Path) -> Path:
    # Every component is checked, not only those below a root: TracksSettings resolves what the
    # operator configured (TRACKS_HOME, a TRACKS_LANDING outside it), so a link left in the
    # path was made under TRACKS_HOME, or is the landing folder itself.
    return safepath.no_symlinked_folder(Path(landing_dir), "the landing folder")


def _stratified_split(labels: np.ndarray, rng: np.random.Generator) -> list[str]:
    split = np.full(len(labels), SPLIT_TRAIN, dtype=object)
    for label in LABELS:
        members = np.flatnonzero(labels == label)
        n_eval = round(len(members) * EVAL_FRACTION)
        split[rng.permutation(members)[:n_eval]] = SPLIT_EVAL
    return split.tolist()


def _apply_drift(
    columns: dict[str, pa.Array], drift: Drift, rng: np.random.Generator
) -> dict[str, pa.Array]:
    import pyarrow as pa

    n_rows = len(columns[SAMPLE_ID])
    rows = np.sort(rng.choice(n_rows, size=12, replace=False))
    if drift is Drift.RENAMED_COLUMN:
        return {("digit" if name == LABEL else name): values for name, values in columns.items()}
    if drift is Drift.LABEL_OUT_OF_RANGE:
        labels = columns[LABEL].to_numpy().copy()
        labels[rows] = np.resize([10, 11, 12], len(rows))
        return {**columns, LABEL: pa.array(labels)}
    if drift is Drift.PIXEL_OUT_OF_RANGE:
        # Centre pixels, so the spoiled values sit among ordinary ink, not in a blank border.
        spoiled = dict(columns)
        for name in ("px_27", "px_36"):
            values = columns[name].to_numpy().copy()
            values[rows[:6]] = 40
            spoiled[name] = pa.array(values)
        return spoiled
    if drift is Drift.NULLS:
        spoiled = dict(columns)
        mask = np.zeros(n_rows, dtype=bool)
        mask[rows[:6]] = True
        for name in ("px_20", "px_43"):
            # Nulls in an int64 Parquet column: what a producer with missing values writes.
            spoiled[name] = pa.array(columns[name].to_numpy(), pa.int64(), mask=mask)
        return spoiled
    raise AssertionError(f"unhandled drift {drift!r}")


def write_table_atomically(table: pa.Table, path: Path) -> None:
    # A hidden temp file in the same directory: invisible to landing_files, and os.replace
    # within one filesystem is atomic, so a sensor never snapshots half a file.
    import pyarrow.parquet as pq

    handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    temp = Path(temp_name)
    try:
        pq.write_table(table, temp)
        fsync_file(temp)
        os.chmod(temp, 0o644)  # mkstemp makes 0o600; landing files are read by other users
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
