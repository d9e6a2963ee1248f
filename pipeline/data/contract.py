"""The schema contract: what a digits snapshot must look like before anything trains on it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.typing.pandas import Series

from pipeline.data.checks import TABLE, CheckFailure, CheckOutcome, distinct_examples
from pipeline.data.columns import (
    LABELS,
    PIXEL_COLUMNS,
    PIXEL_MAX,
    PIXEL_MIN,
    SPLITS,
)

CONTRACT_CHECK = "schema_contract"


class _DigitsIdentity(pa.DataFrameModel):
    sample_id: Series[np.int64] = pa.Field(unique=True)
    split: Series[str] = pa.Field(isin=list(SPLITS))
    label: Series[np.int64] = pa.Field(in_range={"min_value": LABELS[0], "max_value": LABELS[-1]})

    class Config:
        name = "DigitsContract"
        strict = True  # exact columns: a renamed or extra column is a contract failure
        coerce = False  # a float pixel column is news, not something to paper over


# Sixty-four identical pixel fields, declared from the column list rather than by hand so
# the contract and the landing writer can never disagree about which pixels exist.
DigitsContract: type[pa.DataFrameModel] = type(
    "DigitsContract",
    (_DigitsIdentity,),
    {
        "__module__": __name__,
        "__doc__": "Strict contract for a digits snapshot: columns, dtypes, ranges, uniqueness.",
        "__annotations__": {name: Series[np.int64] for name in PIXEL_COLUMNS},
        **{
            name: pa.Field(in_range={"min_value": PIXEL_MIN, "max_value": PIXEL_MAX})
            for name in PIXEL_COLUMNS
        },
    },
)


def check_schema_contract(df: pd.DataFrame) -> CheckOutcome:
    """Validate ``df`` against :data:`DigitsContract`, collecting every failure.

    Never raises for bad data: the outcome lists each broken (column, rule) with the number
    of failing rows and a few example values.
    """
    try:
        DigitsContract.validate(df, lazy=True)
    except pa.errors.SchemaErrors as exc:
        failures = _failures(exc.failure_cases, df)
    except pa.errors.SchemaError as exc:  # raised even under lazy=True for a few checks
        failures = [
            CheckFailure(
                column=str(getattr(exc.schema, "name", None) or TABLE),
                rule=str(exc.check) if exc.check is not None else "schema",
                failing_count=1,
                detail=str(exc).splitlines()[0],
            )
        ]
    else:
        failures = []
    return CheckOutcome.from_failures(
        CONTRACT_CHECK,
        failures,
        passed_summary=f"{len(df)} rows, {len(df.columns)} columns match DigitsContract",
    )


def _failures(cases: pd.DataFrame, df: pd.DataFrame) -> list[CheckFailure]:
    column_level: list[CheckFailure] = []
    row_level: list[CheckFailure] = []
    table_cases = cases[cases["schema_context"] == "DataFrameSchema"]
    for check, failure_case in zip(table_cases["check"], table_cases["failure_case"], strict=True):
        column_level.append(_table_failure(str(check), failure_case))
    # Missing columns first: for a renamed column the summary then reads "label is missing;
    # digit is unexpected", cause before symptom.
    column_level.sort(key=lambda f: f.rule != "column_in_dataframe")

    column_cases = cases[cases["schema_context"] != "DataFrameSchema"]
    # groupby(sort=False) keeps pandera's order, which follows the contract's column order.
    for (column, check), group in column_cases.groupby(["column", "check"], sort=False):
        column, check = str(column), str(check)
        if check.startswith("dtype("):
            actual = df[column].dtype if column in df.columns else "absent"
            column_level.append(
                CheckFailure(column, check, 1, (str(actual),), detail=f"column has dtype {actual}")
            )
            continue
        row_level.append(
            CheckFailure(
                column=column,
                rule=check,
                failing_count=_row_count(group),
                examples=distinct_examples(group["failure_case"]),
            )
        )
    return column_level + row_level


def _table_failure(check: str, failure_case: Any) -> CheckFailure:
    name = str(failure_case)
    if check == "column_in_dataframe":
        return CheckFailure(name, check, 1, (name,), detail="column is missing")
    if check == "column_in_schema":
        return CheckFailure(name, check, 1, (name,), detail="column is unexpected")
    return CheckFailure(TABLE, check, 1, distinct_examples([failure_case]), detail=name)


def _row_count(group: pd.DataFrame) -> int:
    index = group["index"].dropna()
    return int(index.nunique()) if len(index) else len(group)
