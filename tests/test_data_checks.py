"""Schema contract (pandera) and data quality (great-expectations) on real landing files."""

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipeline.data import (
    COLUMNS,
    CheckOutcome,
    DigitsContract,
    Drift,
    check_data_quality,
    check_schema_contract,
    write_digits_landing,
)


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> dict[Drift | None, pd.DataFrame]:
    root = tmp_path_factory.mktemp("landing")
    return {
        drift: pq.read_table(write_digits_landing(root / str(drift), drift=drift)).to_pandas()
        for drift in (None, *Drift)
    }


def _failure(outcome: CheckOutcome, column: str, rule_part: str):
    matches = [f for f in outcome.failures if f.column == column and rule_part in f.rule]
    assert matches, f"no failure for {column!r} / {rule_part!r} in: {outcome.summary}"
    return matches[0]


def test_contract_declares_exactly_the_landing_columns() -> None:
    schema = DigitsContract.to_schema()
    assert tuple(schema.columns) == COLUMNS
    assert schema.strict is True


def test_clean_data_passes_contract_and_quality(frames) -> None:
    contract = check_schema_contract(frames[None])
    quality = check_data_quality(frames[None])
    assert contract.passed, contract.summary
    assert quality.passed, quality.summary
    assert contract.failures == () and quality.failures == ()
    assert "1797 rows" in contract.summary


def test_renamed_column_fails_contract_naming_label_missing_and_digit_unexpected(frames) -> None:
    outcome = check_schema_contract(frames[Drift.RENAMED_COLUMN])
    assert not outcome.passed
    assert outcome.check == "schema_contract"
    assert "column 'label': rule 'column_in_dataframe' failed: column is missing" in outcome.summary
    assert "column 'digit': rule 'column_in_schema' failed: column is unexpected" in outcome.summary
    assert "\n" not in outcome.summary


def test_renamed_column_fails_quality_cleanly_naming_label(frames) -> None:
    outcome = check_data_quality(frames[Drift.RENAMED_COLUMN])
    assert not outcome.passed
    failure = _failure(outcome, "label", "expect_column_to_exist")
    assert failure.detail == "column is missing"
    assert outcome.summary.startswith("column 'label': rule 'expect_column_to_exist' failed")
    assert not any("raised" in (f.detail or "") for f in outcome.failures)


def test_out_of_range_labels_fail_contract_and_quality_naming_label(frames) -> None:
    df = frames[Drift.LABEL_OUT_OF_RANGE]
    contract = check_schema_contract(df)
    failure = _failure(contract, "label", "in_range(0, 9)")
    assert failure.failing_count == 12
    assert set(failure.examples) == {10, 11, 12}
    assert contract.summary.startswith(
        "column 'label': rule 'in_range(0, 9)' failed for 12 rows, e.g. 10, 11, 12"
    )

    quality = check_data_quality(df)
    failure = _failure(quality, "label", "expect_column_values_to_be_in_set")
    assert failure.failing_count == 12
    assert set(failure.examples) == {10, 11, 12}
    assert "column 'label'" in quality.summary


def test_out_of_range_pixels_are_caught_by_both_checks(frames) -> None:
    df = frames[Drift.PIXEL_OUT_OF_RANGE]
    for outcome, rule in (
        (check_schema_contract(df), "in_range(0, 16)"),
        (check_data_quality(df), "expect_column_values_to_be_between(0, 16)"),
    ):
        assert not outcome.passed
        for column in ("px_27", "px_36"):
            failure = _failure(outcome, column, rule)
            assert failure.failing_count == 6
            assert failure.examples == (40,)


def test_null_pixels_are_caught_by_both_checks(frames) -> None:
    df = frames[Drift.NULLS]
    contract = check_schema_contract(df)
    quality = check_data_quality(df)
    for column in ("px_20", "px_43"):
        assert _failure(contract, column, "not_nullable").failing_count == 6
        assert _failure(contract, column, "dtype").detail == "column has dtype float64"
        failure = _failure(quality, column, "expect_column_values_to_not_be_null")
        assert failure.failing_count == 6
    assert not contract.passed and not quality.passed


def test_duplicate_ids_unknown_split_and_extra_column_are_all_collected(frames) -> None:
    df = frames[None].copy()
    df.loc[[1, 2], "sample_id"] = 0
    df.loc[5, "split"] = "test"
    df["note"] = "x"
    outcome = check_schema_contract(df)
    assert _failure(outcome, "sample_id", "field_uniqueness").failing_count == 3
    assert _failure(outcome, "split", "isin").examples == ("test",)
    assert _failure(outcome, "note", "column_in_schema").detail == "column is unexpected"
    assert "\n" not in outcome.summary


def test_unbalanced_labels_fail_quality_per_class(frames) -> None:
    df = frames[None]
    # Keep all the zeros and a quarter of everything else: zeros become ~31% of rows.
    unbalanced = df[(df["label"] == 0) | (df["sample_id"] % 4 == 0)].reset_index(drop=True)
    outcome = check_data_quality(unbalanced)
    failure = _failure(outcome, "label", "class_share_between(0.05, 0.15)")
    assert 0 in failure.examples
    assert "0=0.3" in (failure.detail or "")


def test_outcomes_are_json_safe(frames) -> None:
    outcome = check_schema_contract(frames[Drift.NULLS])
    text = json.dumps(outcome.to_dict(), allow_nan=False)
    assert "px_20" in text
