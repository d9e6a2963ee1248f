"""The text data contract (pandera, blocking): what a text snapshot must be before training.

Rules: exactly the columns ``doc_id``, ``split``, ``text`` as strings; ``doc_id`` present and
unique; ``split`` in {train, eval}; ``text`` not null, not empty or whitespace only, valid
UTF-8 (no lone surrogate: see :mod:`pipeline.textlm.landing` for why bad bytes arrive as
surrogates), free of U+FFFD (the mark an earlier lossy decode leaves), and within
:data:`~pipeline.textlm.columns.MAX_TEXT_CHARS` characters; and no document crosses the split
(the same ``doc_id`` or the same text in both splits is a leak). Exact text only: near copies
are what the contamination check measures (:mod:`pipeline.textlm.contamination`).

Every failure names the rule and the rows: the offending documents by ``doc_id`` and row
number, never their text (a document is kilobytes; a summary line is not).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pandas as pd
import pandera.pandas as pa
from pandera.typing.pandas import Series

from pipeline.data.checks import TABLE, CheckFailure, CheckOutcome, distinct_examples
from pipeline.textlm.columns import (
    DOC_ID,
    MAX_TEXT_CHARS,
    MIN_TEXT_CHARS,
    SPLIT,
    SPLIT_EVAL,
    SPLIT_TRAIN,
    SPLITS,
    TEXT,
)

CONTRACT_CHECK = "schema_contract"
NON_EMPTY_RULE = "non_empty"
VALID_UTF8_RULE = "valid_utf8"
NO_REPLACEMENT_RULE = "no_replacement_character"
LENGTH_RULE = f"length_between({MIN_TEXT_CHARS}, {MAX_TEXT_CHARS})"
SPLIT_LEAK_RULE = "no_split_leak"
_SHOWN_ROWS = 5
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogates(text: pd.Series) -> pd.Series:
    """True where a text holds a lone surrogate: bytes that were not UTF-8, or a bad producer."""
    return text.map(lambda v: isinstance(v, str) and _SURROGATE.search(v) is not None)


def split_leak_rows(frame: pd.DataFrame) -> pd.Series:
    """True for every row whose doc_id, or whose exact text, is in both splits."""
    leaked = pd.Series(False, index=frame.index)
    if SPLIT not in frame.columns:
        return leaked
    in_train = frame[SPLIT] == SPLIT_TRAIN
    in_eval = frame[SPLIT] == SPLIT_EVAL
    for column in (c for c in (DOC_ID, TEXT) if c in frame.columns):
        both = set(frame.loc[in_train, column].dropna()) & set(frame.loc[in_eval, column].dropna())
        leaked |= frame[column].isin(both) & (in_train | in_eval)
    return leaked


def _each(text: pd.Series, rule: Callable[[str], bool]) -> pd.Series:
    # Python strings, never pandas' string dtype: pyarrow cannot hold a lone surrogate, and a
    # value that is not a string at all is the dtype rule's to report, not every rule's.
    return text.map(lambda v: rule(v) if isinstance(v, str) else True).astype(bool)


class TextContract(pa.DataFrameModel):
    """Strict contract for a text snapshot: columns, types, ids, text, split."""

    doc_id: Series[str] = pa.Field(unique=True, str_length={"min_value": 1})
    split: Series[str] = pa.Field(isin=list(SPLITS))
    text: Series[str]

    @pa.check(TEXT, name=NON_EMPTY_RULE)
    def _non_empty(cls, text: Series[str]) -> Series[bool]:
        return _each(text, lambda v: bool(v.strip()))

    # check_text_contract decides this rule before pandera runs (escape_undecodable); it stays here
    # so a frame validated with TextContract directly cannot pass with bad bytes either.
    @pa.check(TEXT, name=VALID_UTF8_RULE)
    def _valid_utf8(cls, text: Series[str]) -> Series[bool]:
        return _each(text, lambda v: _SURROGATE.search(v) is None)

    @pa.check(TEXT, name=NO_REPLACEMENT_RULE)
    def _no_replacement(cls, text: Series[str]) -> Series[bool]:
        return _each(text, lambda v: "\ufffd" not in v)

    @pa.check(TEXT, name=LENGTH_RULE)
    def _length(cls, text: Series[str]) -> Series[bool]:
        return _each(text, lambda v: MIN_TEXT_CHARS <= len(v) <= MAX_TEXT_CHARS)

    @pa.dataframe_check(name=SPLIT_LEAK_RULE)
    def _no_split_leak(cls, frame: pd.DataFrame) -> Series[bool]:
        return ~split_leak_rows(frame)

    class Config:
        name = "TextContract"
        strict = True  # exact columns: a renamed or extra column is a contract failure
        coerce = False


def check_text_contract(frame: pd.DataFrame) -> CheckOutcome:
    """Validate ``frame`` against :class:`TextContract`, collecting every failure.

    Never raises for bad data: each broken (column, rule) is one failure naming its rows.
    """
    escaped, undecodable = escape_undecodable(frame)
    try:
        TextContract.validate(escaped, lazy=True)
    except pa.errors.SchemaErrors as exc:
        failures = _failures(exc.failure_cases, frame)
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
    if undecodable:
        failures.append(_row_failure(TEXT, VALID_UTF8_RULE, undecodable, frame))
    return CheckOutcome.from_failures(
        CONTRACT_CHECK,
        failures,
        passed_summary=f"{len(frame)} documents, {len(frame.columns)} columns match TextContract",
    )


def escape_undecodable(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[int]]:
    """``frame`` with undecodable texts' bad bytes written as ``\\x..`` escapes, and their rows.

    pandera (0.35, under pandas 3) turns failure cases into an Arrow string column to format
    its message, and Arrow cannot hold a lone surrogate: a bad text failing any rule would
    crash the check (great-expectations likewise). So ``valid_utf8`` is decided on the raw
    values, and the libraries judge the other rules on a copy where those texts are printable.
    """
    if TEXT not in frame.columns:
        return frame, []
    rows = [int(i) for i in frame.index[lone_surrogates(frame[TEXT])]]
    if not rows:
        return frame, []
    escaped = frame.copy()
    for row in rows:
        escaped.at[row, TEXT] = _SURROGATE.sub(_escape, frame.at[row, TEXT])
    return escaped, rows


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    # U+DC80..U+DCFF is a byte surrogateescape kept; any other surrogate came in as text.
    return f"\\x{code - 0xDC00:02x}" if code >= 0xDC80 else f"\\u{code:04x}"


def _failures(cases: pd.DataFrame, frame: pd.DataFrame) -> list[CheckFailure]:
    column_level: list[CheckFailure] = []
    row_level: list[CheckFailure] = []
    # A table-wide check reports one failure case per (row, column); it is one failure.
    cases = cases.assign(
        column=cases["column"].where(cases["schema_context"] != "DataFrameSchema", TABLE)
    )
    for (column, check), group in cases.groupby(["column", "check"], sort=False):
        column, check = str(column), str(check)
        if check == "column_in_dataframe":
            name = str(group["failure_case"].iloc[0])
            column_level.append(CheckFailure(name, check, 1, (name,), "column is missing"))
        elif check == "column_in_schema":
            name = str(group["failure_case"].iloc[0])
            column_level.append(CheckFailure(name, check, 1, (name,), "column is unexpected"))
        elif check.startswith("dtype("):
            kinds = sorted({type(v).__name__ for v in frame[column].dropna()})
            column_level.append(
                CheckFailure(
                    column, check, 1, tuple(kinds), f"holds {', '.join(kinds) or 'no values'}"
                )
            )
        elif group["index"].isna().all():
            # A check that could not run at all (its column is missing or the wrong type):
            # the rule that explains why is reported beside it.
            shown = distinct_examples(str(c) for c in group["failure_case"])
            column_level.append(CheckFailure(column, check, 0, shown, "check could not run"))
        else:
            rows = sorted({int(i) for i in group["index"].dropna()})
            row_level.append(_row_failure(column, check, rows, frame))
    # Missing columns first: a renamed column then reads "text is missing; body is unexpected".
    column_level.sort(key=lambda f: f.rule != "column_in_dataframe")
    return column_level + row_level


def _row_failure(column: str, rule: str, rows: list[int], frame: pd.DataFrame) -> CheckFailure:
    if rule == SPLIT_LEAK_RULE:
        return CheckFailure(
            DOC_ID if _leaks_by_id(frame, rows) else TEXT,
            rule,
            len(rows),
            examples=distinct_examples(_doc_id(frame, r) for r in rows),
            detail=_describe_leaks(frame, rows),
        )
    shown = ", ".join(_describe_row(frame, r, rule) for r in rows[:_SHOWN_ROWS])
    more = f" and {len(rows) - _SHOWN_ROWS} more" if len(rows) > _SHOWN_ROWS else ""
    noun = "row" if len(rows) == 1 else "rows"
    return CheckFailure(
        column,
        rule,
        len(rows),
        examples=distinct_examples(_doc_id(frame, r) for r in rows),
        detail=f"{len(rows)} {noun}: {shown}{more}",
    )


def _doc_id(frame: pd.DataFrame, row: int) -> Any:
    if DOC_ID not in frame.columns:
        return f"row {row}"
    return frame.at[row, DOC_ID]


def _describe_row(frame: pd.DataFrame, row: int, rule: str) -> str:
    where = f"doc_id {_doc_id(frame, row)!r} (row {row})"
    text = frame.at[row, TEXT] if TEXT in frame.columns else None
    if not isinstance(text, str):
        return where
    if rule == VALID_UTF8_RULE:
        offset, bad = next((i, c) for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if ord(bad) >= 0xDC80 else f"U+{ord(bad):04X}"
        return f"{where}: {byte} at character {offset} is not UTF-8"
    if rule == NO_REPLACEMENT_RULE:
        return f"{where}: U+FFFD at character {text.index(chr(0xFFFD))}"
    if rule in (LENGTH_RULE, NON_EMPTY_RULE):
        return f"{where}: {len(text)} characters"
    return where


def _leaks_by_id(frame: pd.DataFrame, rows: list[int]) -> bool:
    ids = frame.loc[rows, DOC_ID]
    return bool(ids.duplicated(keep=False).any())


def _describe_leaks(frame: pd.DataFrame, rows: list[int]) -> str:
    """Each leak as the pair of rows on either side of the split that share an id or a text."""
    pairs: list[str] = []
    leaked = frame.loc[rows]
    for column, what in ((DOC_ID, "the same doc_id"), (TEXT, "the same text")):
        for _, group in leaked.groupby(column, sort=False):
            sides = {s: group[group[SPLIT] == s] for s in (SPLIT_TRAIN, SPLIT_EVAL)}
            if any(side.empty for side in sides.values()):
                continue
            train_row, eval_row = sides[SPLIT_TRAIN].index[0], sides[SPLIT_EVAL].index[0]
            pairs.append(
                f"doc_id {frame.at[train_row, DOC_ID]!r} (row {train_row}, train) and "
                f"doc_id {frame.at[eval_row, DOC_ID]!r} (row {eval_row}, eval) have {what}"
            )
    shown = "; ".join(pairs[:_SHOWN_ROWS])
    more = f"; and {len(pairs) - _SHOWN_ROWS} more" if len(pairs) > _SHOWN_ROWS else ""
    return f"{len(pairs)} document(s) cross the split: {shown}{more}"
