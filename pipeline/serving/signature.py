"""What the served model takes and returns, as MLflow shows it on the model and version pages.

The signature is the snapshot's own contract: 64 integer pixel columns ``px_00``..``px_63``
(values 0..16) in, one integer digit out. MLflow enforces it on ``pyfunc`` input: a DataFrame
with those columns is served (other columns, such as a snapshot's ``label``, are dropped), a
bare array or float pixels are refused by name. The input example is real: the first rows of
the promoted snapshot's eval split.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.data.columns import PIXEL_COLUMNS, SPLIT, SPLIT_EVAL

if TYPE_CHECKING:
    import pandas as pd
    from mlflow.models import ModelSignature

OUTPUT_COLUMN = "digit"
EXAMPLE_ROWS = 2

log = logging.getLogger(__name__)


def model_signature() -> ModelSignature:
    """64 ``long`` pixel columns in, one ``long`` column ``digit`` out."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("long", name) for name in PIXEL_COLUMNS]),
        outputs=Schema([ColSpec("long", OUTPUT_COLUMN)]),
    )


def input_example(snapshot_root: Path, snapshot_id: str) -> pd.DataFrame | None:
    """The first :data:`EXAMPLE_ROWS` rows of the snapshot's eval split, pixel columns only.

    None (with a log line) when the snapshot cannot be read: an example illustrates the model,
    it is never a reason to refuse a promotion the gate passed.
    """
    from pipeline.data.snapshot import open_snapshot, read_snapshot_frame

    try:
        frame = read_snapshot_frame(open_snapshot(snapshot_root, snapshot_id))
    except Exception as exc:
        log.warning(
            "no input example from snapshot %s: %s: %s", snapshot_id, type(exc).__name__, exc
        )
        return None
    rows = frame[frame[SPLIT] == SPLIT_EVAL]
    return rows[list(PIXEL_COLUMNS)].head(EXAMPLE_ROWS).astype("int64").reset_index(drop=True)
