"""The text data-quality suite (great-expectations): the documents a model may learn from.

As :mod:`pipeline.data.quality` does for the digits: an ephemeral GX context, expectations
carrying our rule names in their meta, each failure a :class:`CheckFailure`. Failing rows are
named by ``doc_id`` (GX's ``unexpected_index_list``), never by their text. GX is imported
inside :func:`check_text_quality`: it takes seconds to import.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline.data.checks import TABLE, CheckFailure, CheckOutcome, distinct_examples
from pipeline.textlm.columns import (
    COLUMNS,
    DOC_ID,
    MAX_TEXT_CHARS,
    MIN_TEXT_CHARS,
    SPLIT,
    SPLIT_EVAL,
    SPLITS,
    TEXT,
)
from pipeline.textlm.contract import escape_undecodable

if TYPE_CHECKING:
    from great_expectations import ExpectationSuite

QUALITY_CHECK = "data_quality"
SUITE_NAME = "text_quality"
EVAL_SHARE_MIN = 0.05
EVAL_SHARE_MAX = 0.5
EVAL_SHARE_RULE = f"eval_share_between({EVAL_SHARE_MIN}, {EVAL_SHARE_MAX})"
SPLITS_RULE = "every split (train, eval) has rows"
_BLANK = r"^\s*$"


def check_text_quality(df: pd.DataFrame) -> CheckOutcome:
    """Run the great-expectations suite on ``df`` in an ephemeral context.

    Expectations: at least one row; the three columns exist; none null; ``doc_id`` unique;
    ``split`` in {train, eval}; ``text`` not blank and ``MIN_TEXT_CHARS``..``MAX_TEXT_CHARS``
    characters long; the eval split between 5% and 50% of documents; both splits present.
    """
    os.environ["GX_ANALYTICS_ENABLED"] = "false"  # before the import: no phoning home
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_definition = (
        context.data_sources.add_pandas("text")
        .add_dataframe_asset("snapshot")
        .add_batch_definition_whole_dataframe("whole_snapshot")
    )
    present = set(map(str, df.columns))
    suite = build_text_quality_suite(present_columns=present)
    # GX stores failing values in its results; a lone surrogate there breaks it as it breaks
    # pandera, so it sees the bad bytes as escapes (the contract's valid_utf8 names them).
    frame, _ = escape_undecodable(df)
    batch = batch_definition.get_batch(batch_parameters={"dataframe": frame})
    # Pass or fail first; only a failing suite is run again for the rows a failure names.
    result = batch.validate(suite, result_format="BOOLEAN_ONLY")
    if not result.success:
        result_format: dict[str, Any] = {"result_format": "COMPLETE"}
        if DOC_ID in present:
            result_format["unexpected_index_column_names"] = [DOC_ID]
        result = batch.validate(suite, result_format=result_format)
    failures = _failures(result.results) + _missing_splits(df)
    return CheckOutcome.from_failures(
        QUALITY_CHECK,
        failures,
        passed_summary=f"{len(result.results)} expectations met on {len(df)} documents",
    )


def build_text_quality_suite(present_columns: set[str]) -> ExpectationSuite:
    """The suite for a frame with ``present_columns``; value rules only for columns present."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    expectations: list[Any] = []

    def add(expectation: Any, rule: str, kind: str = "rows") -> None:
        expectation.meta = {"rule": rule, "kind": kind}
        expectations.append(expectation)

    add(gxe.ExpectTableRowCountToBeBetween(min_value=1), "row_count >= 1", kind="table")
    for column in COLUMNS:
        add(gxe.ExpectColumnToExist(column=column), "expect_column_to_exist", kind="exists")
        if column in present_columns:
            add(
                gxe.ExpectColumnValuesToNotBeNull(column=column),
                "expect_column_values_to_not_be_null",
            )
    if DOC_ID in present_columns:
        add(gxe.ExpectColumnValuesToBeUnique(column=DOC_ID), "expect_column_values_to_be_unique")
    if SPLIT in present_columns:
        add(
            gxe.ExpectColumnValuesToBeInSet(column=SPLIT, value_set=list(SPLITS)),
            f"expect_column_values_to_be_in_set({', '.join(SPLITS)})",
        )
        # At least 5% of documents are eval, at least 50% are not.
        add(
            gxe.ExpectColumnValuesToBeInSet(
                column=SPLIT, value_set=[SPLIT_EVAL], mostly=EVAL_SHARE_MIN
            ),
            EVAL_SHARE_RULE,
            kind="share",
        )
        add(
            gxe.ExpectColumnValuesToNotBeInSet(
                column=SPLIT, value_set=[SPLIT_EVAL], mostly=1 - EVAL_SHARE_MAX
            ),
            EVAL_SHARE_RULE,
            kind="share",
        )
    if TEXT in present_columns:
        add(
            gxe.ExpectColumnValuesToNotMatchRegex(column=TEXT, regex=_BLANK),
            "expect_column_values_to_not_match_regex(blank)",
        )
        add(
            gxe.ExpectColumnValueLengthsToBeBetween(
                column=TEXT, min_value=MIN_TEXT_CHARS, max_value=MAX_TEXT_CHARS
            ),
            f"expect_column_value_lengths_to_be_between({MIN_TEXT_CHARS}, {MAX_TEXT_CHARS})",
        )
    return gx.ExpectationSuite(name=SUITE_NAME, expectations=expectations)


def _failures(results: list[Any]) -> list[CheckFailure]:
    column_level: list[CheckFailure] = []
    row_level: list[CheckFailure] = []
    share_failed = False
    for result in results:
        if result.success:
            continue
        config = result.expectation_config
        meta = config.meta or {}
        rule = meta.get("rule", config.type)
        kind = meta.get("kind", "rows")
        column = str(config.kwargs.get("column", TABLE))
        observed = dict(result.result or {})
        error = _raised(result)
        if error is not None:
            column_level.append(
                CheckFailure(column, rule, 0, detail=f"expectation raised: {error}")
            )
        elif kind == "table":
            count = observed.get("observed_value")
            column_level.append(CheckFailure(TABLE, rule, 1, detail=f"table has {count} rows"))
        elif kind == "exists":
            column_level.append(CheckFailure(column, rule, 1, (column,), "column is missing"))
        elif kind == "share":
            share_failed = True
        else:
            ids = [row.get(DOC_ID) for row in observed.get("unexpected_index_list") or []]
            count = int(observed.get("unexpected_count") or 0)
            shown = ", ".join(repr(i) for i in distinct_examples(ids))
            row_level.append(
                CheckFailure(
                    column=column,
                    rule=rule,
                    failing_count=count,
                    examples=distinct_examples(ids),
                    detail=f"{count} row(s), doc_id {shown}" if shown else None,
                )
            )
    if share_failed:
        row_level.append(
            CheckFailure(
                SPLIT, EVAL_SHARE_RULE, 1, detail="the eval split's share is out of bounds"
            )
        )
    return column_level + row_level


def _missing_splits(df: pd.DataFrame) -> list[CheckFailure]:
    # A snapshot without an eval split passes every row rule and only fails at evaluation,
    # after the training is spent; it is bad data, stopped here.
    if SPLIT not in df.columns:
        return []
    present = set(df[SPLIT].dropna().astype(str))
    missing = [s for s in SPLITS if s not in present]
    if not missing:
        return []
    return [
        CheckFailure(
            SPLIT, SPLITS_RULE, len(missing), detail=f"no rows in split(s) {', '.join(missing)}"
        )
    ]


def _raised(result: Any) -> str | None:
    info = result.exception_info or {}
    if info.get("raised_exception"):
        return str(info.get("exception_message"))
    for nested in info.values():
        if isinstance(nested, dict) and nested.get("raised_exception"):
            return str(nested.get("exception_message"))
    return None
