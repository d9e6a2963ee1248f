"""What a data check found, as a record a person, the ledger and the Dagster UI can all read."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

JsonScalar = str | int | float | bool | None

MAX_EXAMPLES = 5
_SHOWN_IN_SUMMARY = 3
TABLE = "<table>"  # the "column" of a failure about the whole table (e.g. row count)


@dataclass(frozen=True)
class CheckFailure:
    """One rule one column broke.

    ``failing_count`` is the number of rows for a row-level rule; for a column-level rule
    (missing, unexpected, wrong dtype, class balance) it is how many things broke it and
    ``detail`` says what was found.
    """

    column: str
    rule: str
    failing_count: int
    examples: tuple[JsonScalar, ...] = ()
    detail: str | None = None

    def describe(self) -> str:
        """One phrase naming the column, the rule and what broke it."""
        head = f"column {self.column!r}: rule {self.rule!r} failed"
        if self.detail:
            return f"{head}: {self.detail}"
        noun = "row" if self.failing_count == 1 else "rows"
        text = f"{head} for {self.failing_count} {noun}"
        if self.examples:
            text += ", e.g. " + ", ".join(_show(value) for value in self.examples)
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form for asset-check metadata and the ledger."""
        return {
            "column": self.column,
            "rule": self.rule,
            "failing_count": self.failing_count,
            "examples": list(self.examples),
            "detail": self.detail,
        }


@dataclass(frozen=True)
class CheckOutcome:
    """The verdict of one check (schema_contract, data_quality, drift_vs_previous)."""

    passed: bool
    check: str
    failures: tuple[CheckFailure, ...]
    summary: str

    @classmethod
    def from_failures(
        cls, check: str, failures: Sequence[CheckFailure], *, passed_summary: str
    ) -> CheckOutcome:
        """Passed when ``failures`` is empty; else a one-line summary of the first few."""
        failures = tuple(failures)
        if not failures:
            return cls(passed=True, check=check, failures=(), summary=passed_summary)
        shown = "; ".join(f.describe() for f in failures[:_SHOWN_IN_SUMMARY])
        hidden = len(failures) - _SHOWN_IN_SUMMARY
        more = f"; and {hidden} more failure{'s' if hidden != 1 else ''}" if hidden > 0 else ""
        return cls(passed=False, check=check, failures=failures, summary=shown + more)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form for asset-check metadata and the ledger."""
        return {
            "passed": self.passed,
            "check": self.check,
            "summary": self.summary,
            "failures": [f.to_dict() for f in self.failures],
        }


def json_scalar(value: Any) -> JsonScalar:
    """A plain Python scalar for ``value`` (numpy and pandas scalars, NaN and NA become None)."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    # pandas.NA, NaT and friends are "missing"; anything else is shown as text. (pandas is
    # imported here, not above: the trainer's data gate reads CheckOutcome without a frame.)
    import pandas as pd

    try:
        if pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return str(value)


def distinct_examples(values: Iterable[Any], limit: int = MAX_EXAMPLES) -> tuple[JsonScalar, ...]:
    """Up to ``limit`` distinct JSON-safe values, in order of first appearance."""
    seen: list[JsonScalar] = []
    for value in values:
        scalar = json_scalar(value)
        if scalar not in seen:
            seen.append(scalar)
            if len(seen) == limit:
                break
    return tuple(seen)


def _show(value: JsonScalar) -> str:
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value)
