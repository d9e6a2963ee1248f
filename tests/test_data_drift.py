from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipeline.data import drift_vs_previous, write_digits_landing


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    root: Path = tmp_path_factory.mktemp("landing")
    return pq.read_table(write_digits_landing(root)).to_pandas()


def test_first_snapshot_has_nothing_to_drift_from(digits: pd.DataFrame) -> None:
    outcome = drift_vs_previous(digits, None)
    assert outcome.passed
    assert outcome.check == "drift_vs_previous"
    assert "no previous snapshot" in outcome.summary


def test_a_resample_of_the_same_data_does_not_drift(digits: pd.DataFrame) -> None:
    resample = digits.sample(frac=0.8, random_state=0)
    outcome = drift_vs_previous(resample, digits)
    assert outcome.passed, outcome.summary
    assert "label TV distance" in outcome.summary


def test_a_changed_class_mix_drifts_on_label(digits: pd.DataFrame) -> None:
    mostly_zeros_and_ones = digits[digits["label"].isin([0, 1]) | (digits["sample_id"] % 5 == 0)]
    outcome = drift_vs_previous(mostly_zeros_and_ones, digits)
    assert not outcome.passed
    failure = next(f for f in outcome.failures if f.column == "label")
    assert failure.rule == "label_tv_distance <= 0.1"
    assert failure.examples[0] > 0.1
    assert outcome.summary.startswith("column 'label': rule 'label_tv_distance <= 0.1' failed")


def test_brighter_pixels_drift_naming_the_pixel_that_moved_most(digits: pd.DataFrame) -> None:
    brighter = digits.copy()
    brighter["px_10"] = (brighter["px_10"] + 4).clip(upper=16)
    brighter["px_50"] = (brighter["px_50"] + 2).clip(upper=16)
    outcome = drift_vs_previous(brighter, digits)
    assert not outcome.passed
    assert [f.column for f in outcome.failures] == ["px_10", "px_50"]
    before, after = outcome.failures[0].examples
    assert after > before
    assert "label" not in {f.column for f in outcome.failures}


def test_drift_skips_columns_missing_on_one_side(digits: pd.DataFrame) -> None:
    renamed = digits.rename(columns={"label": "digit"})
    outcome = drift_vs_previous(renamed, digits)
    assert outcome.passed, outcome.summary
