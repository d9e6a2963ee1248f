"""The text table as it lands, is snapshotted and is trained on: one place for its columns."""

from __future__ import annotations

DOC_ID = "doc_id"
SPLIT = "split"
TEXT = "text"
COLUMNS: tuple[str, ...] = (DOC_ID, SPLIT, TEXT)

SPLIT_TRAIN = "train"
SPLIT_EVAL = "eval"
SPLITS: tuple[str, ...] = (SPLIT_TRAIN, SPLIT_EVAL)

# Length bounds on one document, in characters. The corpus writer cuts topics into pieces of
# about CHUNK_TARGET_CHARS; a document past the maximum is a producer that forgot to cut.
MIN_TEXT_CHARS = 1
MAX_TEXT_CHARS = 8192
