"""Contamination: how much of what an evaluation asks is already in the training snapshot.

N-grams of words, 13 long, as GPT-3 measured it (Brown et al. 2020, appendix C): text is
lower-cased and cut into runs of letters, digits and underscores, so reflowed whitespace,
changed punctuation or markup do not hide a copy, and identifiers in code count as words.
Thirteen words (about 70 characters of this corpus) almost never repeat by chance in prose.
Character n-grams would also see code's punctuation, but they match on boilerplate (a
50-character run of grammar notation) that is no copy of an answer.

The figure is the share of the evaluation's distinct 13-grams (every prompt and reference)
that occur anywhere in the training text; an item with any such n-gram is "dirty". Measured on
the Python 3.11 corpus: 0.000 with the corpus's split, which keeps topics sharing any 13-gram
on one side; 0.347 (6 of 16 items dirty) when the same topics were split one by one, because
pydoc's topics repeat whole sections of each other. :data:`THRESHOLD` sits between.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.digests import sha256_json

NGRAM_WORDS = 13
THRESHOLD = 0.05
CONTAMINATION_VERSION = "word-13gram-v1"
_WORD = re.compile(r"[a-z0-9_]+")
_SHOWN_ITEMS = 5


def words(text: str) -> list[str]:
    """``text`` lower-cased and cut into words (runs of letters, digits and underscores)."""
    return _WORD.findall(text.lower())


def word_ngrams(text: str, n: int = NGRAM_WORDS) -> set[tuple[str, ...]]:
    """The distinct n-grams of ``text``'s words (none when it has fewer than n words)."""
    tokens = words(text)
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def training_ngrams(texts: Iterable[str], n: int = NGRAM_WORDS) -> set[tuple[str, ...]]:
    """Every n-gram of every training text (n-grams never span two documents)."""
    found: set[tuple[str, ...]] = set()
    for text in texts:
        found |= word_ngrams(text, n)
    return found


@dataclass(frozen=True)
class ContaminationReport:
    """The overlap figure and what it was measured between."""

    ngram_words: int
    threshold: float
    training_snapshot_id: str
    training_digest: str  # of the training texts it was measured against
    evaluation_ngrams: int
    overlapping_ngrams: int
    items: int
    dirty_item_ids: tuple[str, ...]

    @property
    def overlap_fraction(self) -> float:
        if not self.evaluation_ngrams:
            return 0.0
        return self.overlapping_ngrams / self.evaluation_ngrams

    @property
    def dirty_fraction(self) -> float:
        return len(self.dirty_item_ids) / self.items if self.items else 0.0

    @property
    def contaminated(self) -> bool:
        return self.overlap_fraction > self.threshold

    def summary(self) -> str:
        verdict = "above" if self.contaminated else "within"
        shown = ", ".join(self.dirty_item_ids[:_SHOWN_ITEMS])
        dirty = f"; dirty items: {shown}" if shown else ""
        return (
            f"{self.overlapping_ngrams} of {self.evaluation_ngrams} evaluation "
            f"{self.ngram_words}-grams ({self.overlap_fraction:.3f}) occur in training snapshot "
            f"{self.training_snapshot_id}, {verdict} the threshold {self.threshold}; "
            f"{len(self.dirty_item_ids)} of {self.items} items dirty{dirty}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": CONTAMINATION_VERSION,
            "ngram_words": self.ngram_words,
            "threshold": self.threshold,
            "training_snapshot_id": self.training_snapshot_id,
            "training_digest": self.training_digest,
            "evaluation_ngrams": self.evaluation_ngrams,
            "overlapping_ngrams": self.overlapping_ngrams,
            "overlap_fraction": self.overlap_fraction,
            "items": self.items,
            "dirty_items": len(self.dirty_item_ids),
            "dirty_fraction": self.dirty_fraction,
            "dirty_item_ids": list(self.dirty_item_ids),
            "contaminated": self.contaminated,
        }


def measure_contamination(
    items: Sequence[tuple[str, str]],
    training_texts: Sequence[str],
    *,
    training_snapshot_id: str,
    threshold: float = THRESHOLD,
    n: int = NGRAM_WORDS,
) -> ContaminationReport:
    """Overlap between evaluation ``items`` (id, text) and ``training_texts``."""
    seen = training_ngrams(training_texts, n)
    evaluation: set[tuple[str, ...]] = set()
    dirty: list[str] = []
    for item_id, text in items:
        grams = word_ngrams(text, n)
        evaluation |= grams
        if grams & seen:
            dirty.append(item_id)
    return ContaminationReport(
        ngram_words=n,
        threshold=threshold,
        training_snapshot_id=training_snapshot_id,
        training_digest="sha256:" + sha256_json(list(training_texts)),
        evaluation_ngrams=len(evaluation),
        overlapping_ngrams=len(evaluation & seen),
        items=len(items),
        dirty_item_ids=tuple(dirty),
    )
