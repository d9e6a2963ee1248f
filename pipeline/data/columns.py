"""The digits table as it lands, is snapshotted and is trained on: one place for its columns."""

from __future__ import annotations

SAMPLE_ID = "sample_id"
SPLIT = "split"
LABEL = "label"
PIXEL_COLUMNS: tuple[str, ...] = tuple(f"px_{i:02d}" for i in range(64))
COLUMNS: tuple[str, ...] = (SAMPLE_ID, SPLIT, LABEL, *PIXEL_COLUMNS)

SPLIT_TRAIN = "train"
SPLIT_EVAL = "eval"
SPLITS: tuple[str, ...] = (SPLIT_TRAIN, SPLIT_EVAL)

LABELS: tuple[int, ...] = tuple(range(10))
PIXEL_MIN = 0
PIXEL_MAX = 16
IMAGE_SIDE = 8
