"""Dagster table metadata: typed columns the UI renders as a table, built from plain rows.

A table keeps each number as a number (the Markdown tables it replaces rounded and truncated
them), and its schema names each column's type and, where the name is not enough, its meaning.
"""

from __future__ import annotations

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
