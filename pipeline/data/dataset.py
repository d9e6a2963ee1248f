"""From a verified snapshot (a frame, or its columns as arrays) to what training and evaluation
consume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from pipeline.data.columns import (
    IMAGE_SIDE,
    LABEL,
    PIXEL_COLUMNS,
    PIXEL_MAX,
    SAMPLE_ID,
    SPLIT,
    SPLIT_EVAL,
    SPLITS,
)
from pipeline.data.errors import EmptySplitError, MissingColumnError, UnknownSplitError
from pipeline.digests import sha256_json

if TYPE_CHECKING:
    import pandas as pd
    import torch

# Bump when the canonical form below changes: equal eval rows must keep an equal version.
TASK_SET_FORMAT = "digits-eval-rows/v1"


def split_tensors(df: pd.DataFrame, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``float32 [N, 1, 8, 8]`` scaled to 0..1 and labels ``int64 [N]`` of one split.

    Rows are ordered by ``sample_id``, so the same snapshot always gives the same tensors.
    """
    return split_arrays(_arrays_of(df), split)


def split_arrays(
    columns: Mapping[str, np.ndarray], split: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_tensors` of columns read as arrays (``read_snapshot_columns``: the trainer's
    way in, which never imports pandas); the same tensors, bit for bit, from the same rows."""
    # torch is imported here: it is slow to import, and Dagster loads this package to wire assets.
    import torch

    rows = _split_rows(columns, split)
    pixels = np.stack([columns[name][rows] for name in PIXEL_COLUMNS], axis=1)
    pixels = pixels.astype(np.float32) / np.float32(PIXEL_MAX)
    images = torch.from_numpy(np.ascontiguousarray(pixels.reshape(-1, 1, IMAGE_SIDE, IMAGE_SIDE)))
    labels = torch.from_numpy(columns[LABEL][rows].astype(np.int64))  # a copy torch can own
    return images, labels


def eval_task_set_version(df: pd.DataFrame) -> str:
    """sha256 of the canonical eval rows: the "task set version" an evaluation records.

    Depends only on the eval rows' ids, labels and pixels, not on file layout, row order
    or the train rows.
    """
    arrays = _arrays_of(df)
    rows = _split_rows(arrays, SPLIT_EVAL)
    columns = [SAMPLE_ID, LABEL, *PIXEL_COLUMNS]
    values = np.stack([arrays[name][rows] for name in columns], axis=1).astype(np.int64)
    return sha256_json({"format": TASK_SET_FORMAT, "columns": columns, "rows": values.tolist()})


def _arrays_of(df: pd.DataFrame) -> dict[str, np.ndarray]:
    return {name: df[name].to_numpy() for name in df.columns}


def _split_rows(columns: Mapping[str, np.ndarray], split: str) -> np.ndarray:
    """The positions of ``split``'s rows, ordered by ``sample_id`` (stable: ties keep their
    order)."""
    if split not in SPLITS:
        raise UnknownSplitError(split, SPLITS)
    for column in (SAMPLE_ID, SPLIT, LABEL, *PIXEL_COLUMNS):
        if column not in columns:
            raise MissingColumnError(column, "the snapshot's rows")
    rows = np.flatnonzero(columns[SPLIT] == split)
    if rows.size == 0:
        raise EmptySplitError(split)
    return rows[np.argsort(columns[SAMPLE_ID][rows], kind="stable")]
