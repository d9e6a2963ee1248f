"""The data-quality suite (great-expectations): the digits a model may learn from.

GX is imported inside :func:`check_data_quality`: it takes seconds to import, and the
Dagster code location imports this module just to wire the asset check.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline.data.checks import TABLE, CheckFailure, CheckOutcome, distinct_examples
from pipeline.data.columns import LABEL, LABELS, PIXEL_COLUMNS, PIXEL_MAX, PIXEL_MIN, SPLIT, SPLITS

QUALITY_CHECK = "data_quality"
SUITE_NAME = "digits_quality"
CLASS_SHARE_MIN = 0.05
CLASS_SHARE_MAX = 0.15
CLASS_SHARE_RULE = f"class_share_between({CLASS_SHARE_MIN}, {CLASS_SHARE_MAX})"
REQUIRED_COLUMNS: tuple[str, ...] = (SPLIT, LABEL, *PIXEL_COLUMNS)

if TYPE_CHECKING:
    from great_expectations import ExpectationSuite


def check_data_quality(df: pd.DataFrame) -> CheckOutcome:
    """Run the great-expectations suite on ``df`` in an ephemeral context.

    Expectations: at least one row; every required column exists; label and pixels not
    null; pixels in 0..16; label in 0..9; split in {train, eval}; each label's share of rows
    between 5% and 15%. A missing column fails as "column is missing", it does not crash.
    """
    # Before the import: GX reads this when it starts, and a pipeline must not phone home.
    os.environ["GX_ANALYTICS_ENABLED"] = "false"
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # Progress bars would write tqdm noise into every Dagster step log.
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_definition = (
        context.data_sources.add_pandas("digits")
        .add_dataframe_asset("snapshot")
        .add_batch_definition_whole_dataframe("whole_snapshot")
    )
    suite = build_quality_suite(present_columns=set(map(str, df.columns)))
    batch = batch_definition.get_batch(batch_parameters={"dataframe": df})
    # Pass or fail first (half the CPU of a summary, measured on the digits: 0.4 s against
    # 0.9 s); only a failing suite is run again for the counts and examples a failure names.
    result = batch.validate(suite, result_format="BOOLEAN_ONLY")
    if not result.success:
        result = batch.validate(suite, result_format="SUMMARY")
    failures = _failures(result.results) + _missing_splits(df)
    return CheckOutcome.from_failures(
        QUALITY_CHECK,
        failures,
        passed_summary=f"{len(result.results)} expectations met on {len(df)} rows",
    )


SPLITS_RULE = "every split (train, eval) has rows"


def _missing_splits(df: pd.DataFrame) -> list[CheckFailure]:
    # A snapshot without an eval split would pass every row rule and only fail in training,
    # after the accelerator is spent; it is bad data, stopped here.
    if SPLIT not in df.columns:
        return []
    present = set(df[SPLIT].dropna().astype(str))
    missing = [s for s in SPLITS if s not in present]
    if not missing:
        return []
    return [
        CheckFailure(
            column=SPLIT,
            rule=SPLITS_RULE,
            failing_count=len(missing),
            detail=f"no rows in split(s) {', '.join(missing)}",
        )
    ]


def build_quality_suite(present_columns: set[str]) -> ExpectationSuite:
    """The ExpectationSuite for a frame with ``present_columns``.

    Value expectations are only added for columns that exist; a missing required column is
    reported by its own ``expect_column_to_exist`` instead of a metric error.
    """
    import great_expectations as gx
    import great_expectations.expectations as gxe

    expectations: list[Any] = []

    def add(expectation: Any, rule: str, kind: str = "rows", **meta: Any) -> None:
        # meta travels with each result, so a failure is reported in our words, not GX's.
        expectation.meta = {"rule": rule, "kind": kind, **meta}
        expectations.append(expectation)

    add(gxe.ExpectTableRowCountToBeBetween(min_value=1), "row_count >= 1", kind="table")
    for column in REQUIRED_COLUMNS:
        add(gxe.ExpectColumnToExist(column=column), "expect_column_to_exist", kind="exists")

    if LABEL in present_columns:
        add(gxe.ExpectColumnValuesToNotBeNull(column=LABEL), "expect_column_values_to_not_be_null")
        add(
            gxe.ExpectColumnValuesToBeInSet(column=LABEL, value_set=list(LABELS)),
            f"expect_column_values_to_be_in_set({LABELS[0]}..{LABELS[-1]})",
        )
        # Class balance, per class: at least 5% of labels are k, and at least 85% are not k.
        for label in LABELS:
            add(
                gxe.ExpectColumnValuesToBeInSet(
                    column=LABEL, value_set=[label], mostly=CLASS_SHARE_MIN
                ),
                CLASS_SHARE_RULE,
                kind="class_share_min",
                label=label,
            )
            add(
                gxe.ExpectColumnValuesToNotBeInSet(
                    column=LABEL, value_set=[label], mostly=1 - CLASS_SHARE_MAX
                ),
                CLASS_SHARE_RULE,
                kind="class_share_max",
                label=label,
            )
    if SPLIT in present_columns:
        add(gxe.ExpectColumnValuesToNotBeNull(column=SPLIT), "expect_column_values_to_not_be_null")
        add(
            gxe.ExpectColumnValuesToBeInSet(column=SPLIT, value_set=list(SPLITS)),
            f"expect_column_values_to_be_in_set({', '.join(SPLITS)})",
        )
    for column in PIXEL_COLUMNS:
        if column not in present_columns:
            continue
        add(gxe.ExpectColumnValuesToNotBeNull(column=column), "expect_column_values_to_not_be_null")
        add(
            gxe.ExpectColumnValuesToBeBetween(
                column=column, min_value=PIXEL_MIN, max_value=PIXEL_MAX
            ),
            f"expect_column_values_to_be_between({PIXEL_MIN}, {PIXEL_MAX})",
        )
    # One constructor call: suite.add_expectation compares each new expectation with every
    # earlier one, which costs more than validating this suite on 1.8k rows.
    return gx.ExpectationSuite(name=SUITE_NAME, expectations=expectations)


def _failures(results: list[Any]) -> list[CheckFailure]:
    column_level: list[CheckFailure] = []
    row_level: list[CheckFailure] = []
    class_shares: dict[int, float] = {}
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
        elif kind in ("class_share_min", "class_share_max"):
            class_shares[int(meta["label"])] = _class_share(observed, kind)
        else:
            row_level.append(
                CheckFailure(
                    column=column,
                    rule=rule,
                    failing_count=int(observed.get("unexpected_count") or 0),
                    examples=distinct_examples(observed.get("partial_unexpected_list") or []),
                )
            )
    if class_shares:
        shown = ", ".join(f"{label}={share:.3f}" for label, share in sorted(class_shares.items()))
        row_level.append(
            CheckFailure(
                column=LABEL,
                rule=CLASS_SHARE_RULE,
                failing_count=len(class_shares),
                examples=tuple(sorted(class_shares)),
                detail=f"share of rows per label out of bounds: {shown}",
            )
        )
    return column_level + row_level


def _class_share(observed: dict[str, Any], kind: str) -> float:
    # GX reports the share of rows that broke the rule; for "is k" that is 1 - share(k),
    # for "is not k" it is share(k). Nulls are excluded, as GX's "mostly" excludes them.
    unexpected = (observed.get("unexpected_percent_nonmissing") or 0.0) / 100
    return 1 - unexpected if kind == "class_share_min" else unexpected


def _raised(result: Any) -> str | None:
    info = result.exception_info or {}
    if info.get("raised_exception"):
        return str(info.get("exception_message"))
    # When several metrics fail, GX nests the details one level down, keyed by metric id.
    for nested in info.values():
        if isinstance(nested, dict) and nested.get("raised_exception"):
            return str(nested.get("exception_message"))
    return None
