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
    return split_arrays({name: df[name].to_numpy() for name in df.columns}, split)


def split_arrays(
    columns: Mapping[str, np.ndarray], split: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_tensors` of columns read as arrays (``read_snapshot_columns``: the trainer's
    way in, which never imports pandas); the same tensors, bit for bit, from the same rows."""
    # torch is imported here: it is slow to import, and Dagster loads this package to wire assets.
    import torch

    if split not in SPLITS:
        raise UnknownSplitError(split, SPLITS)
    for column in (SAMPLE_ID, SPLIT, LABEL, *PIXEL_COLUMNS):
        if column not in columns:
            raise MissingColumnError(column, "the snapshot's rows")
    rows = np.flatnonzero(columns[SPLIT] == split)
    if rows.size == 0:
        raise EmptySplitError(split)
    rows = rows[np.argsort(columns[SAMPLE_ID][rows], kind="stable")]
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
    rows = _split_rows(df, SPLIT_EVAL)
    columns = [SAMPLE_ID, LABEL, *PIXEL_COLUMNS]
    return sha256_json(
        {
            "format": TASK_SET_FORMAT,
            "columns": columns,
            "rows": rows[columns].to_numpy(dtype=np.int64).tolist(),
        }
    )


def _split_rows(df: pd.DataFrame, split: str) -> pd.DataFrame:
    if split not in SPLITS:
        raise UnknownSplitError(split, SPLITS)
    for column in (SAMPLE_ID, SPLIT, LABEL, *PIXEL_COLUMNS):
        if column not in df.columns:
            raise MissingColumnError(column, "the snapshot frame")
    rows = df.loc[df[SPLIT] == split].sort_values(SAMPLE_ID, kind="stable")
    if rows.empty:
        raise EmptySplitError(split)
    return rows
