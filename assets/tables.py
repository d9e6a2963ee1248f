"""Dagster table metadata: typed columns the UI renders as a table, built from plain rows.

A table keeps each number as a number (the Markdown tables it replaces rounded and truncated
them), and its schema names each column's type and, where the name is not enough, its meaning.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from pipeline.states import CheckpointState

Cell = str | int | float | bool | None

# Metrics that count examples: stored as floats (a metrics dict holds floats), shown as ints.
COUNT_METRICS = frozenset({"support", "examples"})
# What a metric column says when its name alone does not.
_METRIC_DESCRIPTIONS = {"support": "examples in the slice", "examples": "examples evaluated"}


class TableRowError(ValueError):
    """A row does not have exactly the table's columns."""

    def __init__(self, table: str, index: int, missing: set[str], extra: set[str]) -> None:
        super().__init__(
            f"table {table!r} row {index}: missing columns {sorted(missing)}, "
            f"unknown columns {sorted(extra)}"
        )


def table(
    name: str, columns: Sequence[dg.TableColumn], rows: Iterable[Mapping[str, Cell]]
) -> dg.TableMetadataValue:
    """``rows`` as a table with ``columns`` (in that order); each row must have every column.

    Dagster only says "all records must have the same fields"; this names the table and row.
    """
    names = [c.name for c in columns]
    if len(set(names)) != len(names):
        raise ValueError(f"table {name!r} names a column twice: {names}")
    records = []
    for index, row in enumerate(rows):
        if set(row) != set(names):
            raise TableRowError(name, index, set(names) - set(row), set(row) - set(names))
        records.append(dg.TableRecord({n: row[n] for n in names}))
    return dg.MetadataValue.table(records=records, schema=dg.TableSchema(columns=list(columns)))


def metric_columns(
    metrics: Iterable[Mapping[str, Any] | None], description: str
) -> list[dg.TableColumn]:
    """One column per metric name any row reports, sorted by name.

    Floats, except a count (``COUNT_METRICS``) whose every value is whole: an int.
    """
    values: dict[str, list[Any]] = {}
    for row in metrics:
        for key, value in (row or {}).items():
            values.setdefault(key, []).append(value)
    return [
        dg.TableColumn(
            key,
            "int" if key in COUNT_METRICS and all(_whole(v) for v in values[key]) else "float",
            _METRIC_DESCRIPTIONS.get(key, description),
        )
        for key in sorted(values)
    ]


def metric_cells(
    metrics: Mapping[str, Any] | None, columns: Sequence[dg.TableColumn]
) -> dict[str, Cell]:
    """The row's value for each metric column; empty (None) where the row has no such metric
    or it is not a finite number (JSON, and so the UI, has no NaN)."""
    cells: dict[str, Cell] = {}
    for column in columns:
        value = (metrics or {}).get(column.name)
        if value is None or not math.isfinite(float(value)):
            cells[column.name] = None
        else:
            cells[column.name] = int(value) if column.type == "int" else float(value)
    return cells


def checkpoint_lineage_table(checkpoints: Sequence[Any]) -> dg.TableMetadataValue:
    """One row per checkpoint of a run (the ledger's ``CheckpointRecord``s, oldest first)."""
    metrics = metric_columns(
        (c.metrics for c in checkpoints),
        "recorded with the checkpoint when it was committed; empty where it has none",
    )
    columns = [
        dg.TableColumn("step", "int", "global step the checkpoint holds"),
        dg.TableColumn("attempt", "int", "attempt number that wrote it"),
        dg.TableColumn("state", "string", "one of: " + ", ".join(CheckpointState)),
        dg.TableColumn("checkpoint", "string", "the checkpoint's folder name"),
        dg.TableColumn(
            "parent", "string", "folder name of the committed checkpoint it built on; empty: none"
        ),
        dg.TableColumn(
            "manifest_sha256", "string", "SHA-256 of its MANIFEST.json; empty until committed"
        ),
        *metrics,
    ]
    rows = [
        {
            "step": c.step,
            "attempt": c.attempt_no,
            "state": str(c.state),
            "checkpoint": Path(c.path).name,
            "parent": Path(c.parent_path).name if c.parent_path else None,
            "manifest_sha256": c.manifest_sha256,
            **metric_cells(c.metrics, metrics),
        }
        for c in checkpoints
    ]
    return table("checkpoint_lineage", columns, rows)


def _whole(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and float(value).is_integer()


def _cell(value: Any) -> Cell:
    """A scalar stays itself; a list (or an empty mapping) becomes its compact JSON."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def flat_items(values: Mapping[str, Any], prefix: str = "") -> dict[str, Cell]:
    """Nested mappings as one level of dotted keys (``budget_left.attempts``), in order."""
    flat: dict[str, Cell] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            flat |= flat_items(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = _cell(value)
    return flat


def fields_table(name: str, values: Mapping[str, Any], description: str) -> dg.TableMetadataValue:
    """A record as rows of ``field`` and ``value`` (nested fields dotted), as it was written."""
    columns = [
        dg.TableColumn("field", "string"),
        dg.TableColumn("value", "string", description),
    ]
    return table(name, columns, [{"field": k, "value": v} for k, v in flat_items(values).items()])


def _shown(value: Cell) -> str | None:
    # One column holds strings, numbers and booleans: shown as the config file would hold them.
    return None if value is None else value if isinstance(value, str) else json.dumps(value)


def config_table(
    config: Mapping[str, Any], previous: Mapping[str, Any] | None
) -> dg.TableMetadataValue:
    """Every key of ``config`` (dotted) beside its value in ``previous``, the changed ones first.

    Without a ``previous`` config the ``previous`` and ``changed`` columns are empty: nothing
    was compared, which is not the same as nothing changed.
    """
    now, before = flat_items(config), flat_items(previous or {})
    keys = list(now) + [k for k in before if k not in now]
    changed = [k for k in keys if previous is not None and now.get(k) != before.get(k)]
    columns = [
        dg.TableColumn("key", "string", "dotted path in the trainer config"),
        dg.TableColumn("value", "string", "what this attempt trained with; empty: not set"),
        dg.TableColumn("previous", "string", "the same key in config_compared_with"),
        dg.TableColumn("changed", "bool", "differs from config_compared_with; empty: none"),
    ]
    rows = [
        {
            "key": key,
            "value": _shown(now.get(key)),
            "previous": _shown(before.get(key)) if previous is not None else None,
            "changed": key in changed if previous is not None else None,
        }
        for key in [*changed, *(k for k in keys if k not in changed)]
    ]
    return table("config", columns, rows)


def commits_table(
    commits: Sequence[Mapping[str, Any]], checkpoints: Sequence[Any]
) -> dg.TableMetadataValue:
    """One row per checkpoint this attempt committed (the trainer's reports, in order), with
    the metrics the ledger recorded for it."""
    recorded = {str(c.path): c.metrics for c in checkpoints}
    metrics = metric_columns(
        (recorded.get(str(c.get("path"))) for c in commits),
        "recorded with the checkpoint when it was committed; empty where it has none",
    )
    columns = [
        dg.TableColumn("step", "int", "global step the checkpoint holds"),
        dg.TableColumn("path", "string", "the checkpoint's folder"),
        dg.TableColumn(
            "stall_seconds", "float", "seconds training waited for the commit; empty: not reported"
        ),
        *metrics,
    ]
    rows = [
        {
            "step": int(c["step"]),
            "path": str(c.get("path")),
            "stall_seconds": None if c.get("stall_seconds") is None else float(c["stall_seconds"]),
            **metric_cells(recorded.get(str(c.get("path"))), metrics),
        }
        for c in commits
        if "step" in c
    ]
    return table("checkpoints_committed", columns, rows)


LOSS_TABLE_ROWS = 10


def loss_table(steps: Sequence[Mapping[str, Any]]) -> dg.TableMetadataValue:
    """The trainer's step reports, ``LOSS_TABLE_ROWS`` of them spread evenly (first and last
    kept): the loss curve's numbers, which a log row shows where it shows no picture."""
    from pipeline.plots import evenly

    reported = [s for s in steps if s.get("loss") is not None]
    columns = [
        dg.TableColumn("step", "int", "global step"),
        dg.TableColumn("loss", "float", "training loss the trainer reported at that step"),
        dg.TableColumn("lr", "float", "learning rate; empty: not reported"),
        dg.TableColumn("examples_per_second", "float", "throughput; empty: not reported"),
    ]

    def number(value: Any) -> float | None:
        return None if value is None or not math.isfinite(float(value)) else float(value)

    rows = [
        {
            "step": int(s["step"]),
            "loss": number(s["loss"]),
            "lr": number(s.get("lr")),
            "examples_per_second": number(s.get("examples_per_second")),
        }
        for s in evenly(reported, LOSS_TABLE_ROWS)
    ]
    return table("loss_by_step", columns, rows)


def confusion_matrix_table(
    matrix: Sequence[Sequence[int]], labels: Sequence[Any]
) -> dg.TableMetadataValue:
    """Rows are the true label, one column per predicted label; ``correct`` is the diagonal."""
    predicted = [str(label) for label in labels]
    columns = [
        dg.TableColumn("label", "string", "the true label"),
        *(dg.TableColumn(p, "int", f"examples of this label predicted as {p}") for p in predicted),
        dg.TableColumn("correct", "int", "the diagonal: examples predicted as their label"),
        dg.TableColumn("examples", "int", "examples of this label"),
    ]
    rows = [
        {
            "label": str(label),
            **{p: int(v) for p, v in zip(predicted, row, strict=True)},
            "correct": int(row[i]),
            "examples": int(sum(row)),
        }
        for i, (label, row) in enumerate(zip(labels, matrix, strict=True))
    ]
    return table("confusion_matrix", columns, rows)
