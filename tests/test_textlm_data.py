"""The text-lm corpus, landing and data checks on real landed and snapshotted Parquet files."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipeline.data.checks import CheckOutcome
from pipeline.textlm.columns import SPLIT_EVAL, SPLIT_TRAIN
from pipeline.textlm.contamination import training_ngrams, word_ngrams
from pipeline.textlm.contract import (
    LENGTH_RULE,
    NON_EMPTY_RULE,
    SPLIT_LEAK_RULE,
    VALID_UTF8_RULE,
    check_text_contract,
)
from pipeline.textlm.corpus import build_documents, chunk_text, load_topics
from pipeline.textlm.drift import BYTE_JS_RULE, drift_vs_previous
from pipeline.textlm.landing import TextDrift, corpus_metadata, write_text_landing
from pipeline.textlm.quality import check_text_quality
from tests.textlm_support import landed_frame


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> dict[TextDrift | None, pd.DataFrame]:
    root = tmp_path_factory.mktemp("textlm-landing")
    return {drift: landed_frame(root, drift) for drift in (None, *TextDrift)}


def _only(outcome: CheckOutcome, rule: str):
    matches = [f for f in outcome.failures if f.rule == rule]
    assert len(matches) == 1, f"expected one {rule!r} failure in: {outcome.summary}"
    return matches[0]


def test_the_corpus_is_cpythons_own_cut_and_split_without_leaking(tmp_path: Path) -> None:
    topics = load_topics()
    assert len(topics) > 50 and all("".join(chunk_text(t)) == t for t in topics.values())
    documents, info = build_documents(topics)
    assert (documents, info) == build_documents(topics)  # deterministic
    assert info.python_version == ".".join(map(str, sys.version_info[:3]))
    assert 0.15 <= info.eval_characters / info.characters <= 0.25
    # No topic on both sides, and no 13-word sequence of the eval split in the train split.
    train = [d for d in documents if d.split == SPLIT_TRAIN]
    held = [d for d in documents if d.split == SPLIT_EVAL]
    assert not {d.topic for d in train} & {d.topic for d in held}
    seen = training_ngrams(d.text for d in train)
    assert not any(word_ngrams(d.text) & seen for d in held)

    path = write_text_landing(tmp_path)
    recorded = corpus_metadata(path)
    assert recorded is not None and recorded["corpus"] == info.to_dict()
    assert pq.read_table(path).num_rows == info.documents


def test_clean_corpus_passes_contract_and_drift(frames) -> None:
    contract = check_text_contract(frames[None])
    assert contract.passed, contract.summary
    assert drift_vs_previous(frames[None], frames[None]).passed
    assert drift_vs_previous(frames[None], None).passed


def test_invalid_utf8_survives_landing_and_snapshot_and_fails_naming_rows(frames) -> None:
    frame = frames[TextDrift.INVALID_UTF8]
    outcome = check_text_contract(frame)
    assert not outcome.passed
    failure = _only(outcome, VALID_UTF8_RULE)
    assert failure.column == "text" and failure.failing_count == 2
    bad_ids = [i for i, t in zip(frame["doc_id"], frame["text"], strict=True) if "\udce9" in t]
    assert sorted(failure.examples) == sorted(bad_ids) and len(bad_ids) == 2
    for doc_id in bad_ids:
        assert f"doc_id {doc_id!r}" in failure.detail
    assert "byte 0xe9 at character 43 is not UTF-8" in failure.detail
    assert [f.rule for f in outcome.failures] == [VALID_UTF8_RULE]  # nothing else broke


def test_empty_documents_fail_naming_rows(frames) -> None:
    frame = frames[TextDrift.EMPTY_DOCUMENT]
    outcome = check_text_contract(frame)
    empty = _only(outcome, NON_EMPTY_RULE)
    blank_ids = [i for i, t in zip(frame["doc_id"], frame["text"], strict=True) if not t.strip()]
    assert empty.failing_count == 2 and sorted(empty.examples) == sorted(blank_ids)
    rows = frame.index[frame["doc_id"].isin(blank_ids)].tolist()
    assert all(f"(row {row})" in empty.detail for row in rows)
    # The zero-length one also breaks the length bound; the whitespace one does not.
    assert _only(outcome, LENGTH_RULE).failing_count == 1


def test_duplicate_id_fails_uniqueness_and_the_split_naming_both_rows(frames) -> None:
    frame = frames[TextDrift.DUPLICATE_ID]
    outcome = check_text_contract(frame)
    duplicated = frame.loc[frame["doc_id"].duplicated(keep=False)]
    (doc_id,) = set(duplicated["doc_id"])
    train_row, eval_row = (duplicated.index[duplicated["split"] == s][0] for s in ("train", "eval"))
    unique = _only(outcome, "field_uniqueness")
    assert unique.column == "doc_id" and unique.examples == (doc_id,)
    leak = _only(outcome, SPLIT_LEAK_RULE)
    assert leak.column == "doc_id"
    assert (
        f"doc_id {doc_id!r} (row {train_row}, train) and doc_id {doc_id!r} "
        f"(row {eval_row}, eval) have the same doc_id"
    ) in leak.detail


def test_split_leak_by_text_names_both_documents(frames) -> None:
    frame = frames[TextDrift.SPLIT_LEAK]
    outcome = check_text_contract(frame)
    assert [f.rule for f in outcome.failures] == [SPLIT_LEAK_RULE]
    leak = outcome.failures[0]
    shared = frame.loc[frame["text"].duplicated(keep=False)]
    train_id = shared.loc[shared["split"] == "train", "doc_id"].item()
    eval_id = shared.loc[shared["split"] == "eval", "doc_id"].item()
    assert leak.column == "text" and set(leak.examples) == {train_id, eval_id}
    assert f"doc_id {train_id!r}" in leak.detail and f"doc_id {eval_id!r}" in leak.detail
    assert "have the same text" in leak.detail
    assert len(outcome.summary) < 400  # names documents, never prints their text


def test_missing_column_and_wrong_split_name_the_column(frames) -> None:
    renamed = frames[None].rename(columns={"text": "body"})
    summary = check_text_contract(renamed).summary
    assert "column 'text': rule 'column_in_dataframe' failed: column is missing" in summary
    assert "column 'body': rule 'column_in_schema' failed: column is unexpected" in summary
    wrong = frames[None].copy()
    wrong.loc[5, "split"] = "test"
    failure = check_text_contract(wrong).failures[0]
    assert failure.column == "split" and failure.examples == (wrong.loc[5, "doc_id"],)


def test_shouted_text_drifts_by_byte_distribution(frames) -> None:
    outcome = drift_vs_previous(frames[TextDrift.SHOUTED], frames[None])
    assert not outcome.passed
    failure = outcome.failures[0]
    assert failure.rule == BYTE_JS_RULE and failure.examples[0] > 0.5
    assert "'e'" in failure.detail  # the byte that moved most is named


def test_quality_suite_passes_the_corpus_and_names_bad_documents(frames) -> None:
    assert check_text_quality(frames[None]).passed
    empty = check_text_quality(frames[TextDrift.EMPTY_DOCUMENT])
    blank = [f for f in empty.failures if "regex" in f.rule]
    assert blank and blank[0].failing_count == 2
    assert set(blank[0].examples) <= set(frames[TextDrift.EMPTY_DOCUMENT]["doc_id"])
    duplicate = check_text_quality(frames[TextDrift.DUPLICATE_ID])
    assert any(f.rule == "expect_column_values_to_be_unique" for f in duplicate.failures)
    # Bad bytes do not crash GX: the contract names them, the suite sees them escaped.
    assert check_text_quality(frames[TextDrift.INVALID_UTF8]).passed
