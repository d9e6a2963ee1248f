"""Drift of a text snapshot against the previous passing one: a warning, not a gate.

The distance is Jensen-Shannon over byte frequencies (the model's own vocabulary: it reads
bytes), as a distance (the square root of the divergence, base 2): 0 for the same mix of
bytes, 1 for disjoint ones. Measured on the Python 3.11 corpus: a random 20 of its 280
documents is 0.13 from the whole, 50 documents 0.08, the eval topics 0.08 from the train
topics; the whole corpus upper-cased is 0.79. So 0.20 means the characters really moved.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipeline.data.checks import CheckFailure, CheckOutcome
from pipeline.textlm.columns import TEXT

DRIFT_CHECK = "drift_vs_previous"
BYTE_JS_THRESHOLD = 0.20
BYTE_JS_RULE = f"byte_js_distance <= {BYTE_JS_THRESHOLD}"
_SHOWN_BYTES = 3


def byte_frequencies(texts: pd.Series) -> np.ndarray:
    """Share of each byte value (256) in the UTF-8 bytes of ``texts`` (non-strings skipped).

    Bad bytes kept as surrogates by the reader count as the bytes they were.
    """
    counts = np.zeros(256, dtype=np.int64)
    for text in texts:
        if isinstance(text, str):
            raw = text.encode("utf-8", "surrogateescape")
            counts += np.bincount(np.frombuffer(raw, dtype=np.uint8), minlength=256)
    total = counts.sum()
    return counts / total if total else counts.astype(np.float64)


def js_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon distance (base 2, in [0, 1]) between two distributions."""
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        present = a > 0
        return float((a[present] * np.log2(a[present] / m[present])).sum())

    return float(np.sqrt(max(0.0, (kl(p) + kl(q)) / 2)))


def drift_vs_previous(current_df: pd.DataFrame, previous_df: pd.DataFrame | None) -> CheckOutcome:
    """Compare the byte mix of ``current_df``'s texts with the previous snapshot's.

    Passes when there is no previous snapshot, or when either lacks a ``text`` column (the
    contract reports that). A failure names the bytes whose share moved most.
    """
    if previous_df is None:
        return CheckOutcome(
            passed=True,
            check=DRIFT_CHECK,
            failures=(),
            summary="no previous snapshot to compare with",
        )
    if TEXT not in current_df.columns or TEXT not in previous_df.columns:
        return CheckOutcome(
            passed=True, check=DRIFT_CHECK, failures=(), summary="no text column to compare"
        )
    before = byte_frequencies(previous_df[TEXT])
    after = byte_frequencies(current_df[TEXT])
    distance = js_distance(after, before)
    moved = np.argsort(-np.abs(after - before), kind="stable")[:_SHOWN_BYTES]
    shown = ", ".join(
        f"{_byte_name(int(b))} {before[b]:.4f}->{after[b]:.4f}"
        for b in moved
        if after[b] != before[b]
    )
    facts = f"byte JS distance {distance:.3f}" + (f" (largest moves: {shown})" if shown else "")
    failures = []
    if distance > BYTE_JS_THRESHOLD:
        failures.append(
            CheckFailure(
                column=TEXT,
                rule=BYTE_JS_RULE,
                failing_count=1,
                examples=(round(distance, 4),),
                detail=f"the byte distribution moved: {facts}",
            )
        )
    return CheckOutcome.from_failures(DRIFT_CHECK, failures, passed_summary=f"no drift: {facts}")


def _byte_name(value: int) -> str:
    return repr(chr(value)) if 32 <= value < 127 else f"0x{value:02x}"
