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
# The text-lm model's columns: a prompt in, its continuation out.
PROMPT_COLUMN = "prompt"
CONTINUATION_COLUMN = "continuation"

log = logging.getLogger(__name__)


def model_signature(family: str = "digits-cnn") -> ModelSignature:
    """digits-cnn: 64 ``long`` pixel columns in, one ``long`` column ``digit`` out; text-lm: a
    ``string`` column ``prompt`` in, a ``string`` ``continuation`` out (``max_new_tokens`` a
    parameter, default 64)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    if family == "text-lm":
        return ModelSignature(
            inputs=Schema([ColSpec("string", PROMPT_COLUMN)]),
            outputs=Schema([ColSpec("string", CONTINUATION_COLUMN)]),
            params=ParamSchema([ParamSpec("max_new_tokens", "long", 64)]),
        )
    return ModelSignature(
        inputs=Schema([ColSpec("long", name) for name in PIXEL_COLUMNS]),
        outputs=Schema([ColSpec("long", OUTPUT_COLUMN)]),
    )


def input_example(
    snapshot_root: Path, snapshot_id: str, family: str = "digits-cnn"
) -> pd.DataFrame | None:
    """The first :data:`EXAMPLE_ROWS` rows of the snapshot's eval split, pixel columns only
    (text-lm: the first prompts of the snapshot's prompt set).

    None (with a log line) when the snapshot cannot be read: an example illustrates the model,
    it is never a reason to refuse a promotion the gate passed.
    """
    from pipeline.data.snapshot import open_snapshot, read_snapshot_frame

    try:
        if family == "text-lm":
            return _prompt_example(open_snapshot(snapshot_root, snapshot_id))
        frame = read_snapshot_frame(open_snapshot(snapshot_root, snapshot_id))
    except Exception as exc:
        log.warning(
            "no input example from snapshot %s: %s: %s", snapshot_id, type(exc).__name__, exc
        )
        return None
    rows = frame[frame[SPLIT] == SPLIT_EVAL]
    return rows[list(PIXEL_COLUMNS)].head(EXAMPLE_ROWS).astype("int64").reset_index(drop=True)


def _prompt_example(snapshot: object) -> pd.DataFrame:
    import pandas as pd

    from pipeline.evaluation.eval_set import text_eval_set

    items = text_eval_set(snapshot).prompt_set.items[:EXAMPLE_ROWS]
    return pd.DataFrame({PROMPT_COLUMN: [item.prompt for item in items]})
