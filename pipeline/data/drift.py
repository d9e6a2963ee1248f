"""Drift against the previous snapshot: a warning, not a gate (the data may really have moved)."""

from __future__ import annotations

import pandas as pd

from pipeline.data.checks import CheckFailure, CheckOutcome
from pipeline.data.columns import LABEL, PIXEL_COLUMNS

DRIFT_CHECK = "drift_vs_previous"
# Total-variation distance between label distributions: 0 same, 1 disjoint. Two random
# 20% resamples of digits differ by ~0.03; 0.10 means the class mix really changed.
LABEL_TV_THRESHOLD = 0.10
# Mean intensity of one pixel, in raw units (0..16). Resampling moves a mean by ~0.3.
PIXEL_MEAN_SHIFT_THRESHOLD = 1.0
LABEL_TV_RULE = f"label_tv_distance <= {LABEL_TV_THRESHOLD}"
PIXEL_SHIFT_RULE = f"pixel_mean_shift <= {PIXEL_MEAN_SHIFT_THRESHOLD}"


def drift_vs_previous(current_df: pd.DataFrame, previous_df: pd.DataFrame | None) -> CheckOutcome:
    """Compare ``current_df`` with the previous snapshot's rows.

    Flags a label distribution whose total-variation distance exceeds
    :data:`LABEL_TV_THRESHOLD`, and each pixel whose mean moved more than
    :data:`PIXEL_MEAN_SHIFT_THRESHOLD`. Passes when there is no previous snapshot.
    Columns missing on either side are skipped: the schema contract reports those.
    """
    if previous_df is None:
        return CheckOutcome(
            passed=True,
            check=DRIFT_CHECK,
            failures=(),
            summary="no previous snapshot to compare with",
        )

    failures: list[CheckFailure] = []
    facts: list[str] = []
    if LABEL in current_df.columns and LABEL in previous_df.columns:
        tv = label_tv_distance(current_df[LABEL], previous_df[LABEL])
        facts.append(f"label TV distance {tv:.3f}")
        if tv > LABEL_TV_THRESHOLD:
            failures.append(
                CheckFailure(
                    column=LABEL,
                    rule=LABEL_TV_RULE,
                    failing_count=1,
                    examples=(round(tv, 4),),
                    detail=f"label distribution moved by total-variation distance {tv:.3f}",
                )
            )

    # Largest shift first, so the summary leads with the pixel that moved most.
    shifts = sorted(
        pixel_mean_shifts(current_df, previous_df).items(),
        key=lambda item: -abs(item[1][1] - item[1][0]),
    )
    if shifts:
        worst, (before, after) = shifts[0]
        facts.append(f"largest pixel mean shift {abs(after - before):.2f} ({worst})")
    for name, (before, after) in shifts:
        if abs(after - before) > PIXEL_MEAN_SHIFT_THRESHOLD:
            failures.append(
                CheckFailure(
                    column=name,
                    rule=PIXEL_SHIFT_RULE,
                    failing_count=1,
                    examples=(round(before, 3), round(after, 3)),
                    detail=f"mean moved from {before:.2f} to {after:.2f}",
                )
            )
    return CheckOutcome.from_failures(
        DRIFT_CHECK,
        failures,
        passed_summary="no drift: " + (", ".join(facts) if facts else "no comparable columns"),
    )


def label_tv_distance(current: pd.Series, previous: pd.Series) -> float:
    """Total-variation distance between two label distributions (nulls ignored)."""
    p = current.value_counts(normalize=True, dropna=True)
    q = previous.value_counts(normalize=True, dropna=True)
    p, q = p.align(q, fill_value=0.0)
    return float((p - q).abs().sum() / 2)


def pixel_mean_shifts(
    current_df: pd.DataFrame, previous_df: pd.DataFrame
) -> dict[str, tuple[float, float]]:
    """(previous mean, current mean) of every pixel column both frames have."""
    shared = [c for c in PIXEL_COLUMNS if c in current_df.columns and c in previous_df.columns]
    before = previous_df[shared].apply(pd.to_numeric, errors="coerce").mean()
    after = current_df[shared].apply(pd.to_numeric, errors="coerce").mean()
    return {name: (float(before[name]), float(after[name])) for name in shared}
