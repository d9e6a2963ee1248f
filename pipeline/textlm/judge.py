"""The judge: a character n-gram model that scores a continuation, needing no network.

Fitted on held-out reference text (the eval documents no prompt was cut from), it scores a
sample by the mean negative log-likelihood, in bits per character, of the output given the
prompt before it: lower reads more like the Python reference, higher reads like noise. It is
small enough to pin completely: its version, its parameters and a digest of every count it
holds (:attr:`CharNgramJudge.digest`), and the rubric below, hashed
(:data:`RUBRIC_VERSION`). A judge that changes in any way is a different digest.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pipeline.digests import sha256_bytes, sha256_json, short_digest

JUDGE_VERSION = "char-ngram-judge-v1"
ORDER = 4
ADD_K = 0.1
# Interpolation weights of the 1-, 2-, 3- and 4-gram estimates: fixed, not fitted, so the
# judge is its counts and nothing else; most weight on the longest context.
WEIGHTS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4)
# Every character the reference text never used: a lone surrogate, which no text that passed
# the contract holds, so it can never collide with a real character.
UNKNOWN = "\udfff"

RUBRIC = f"""\
Judge {JUDGE_VERSION}: how much a continuation reads like the Python language reference.
Score: the mean negative log-likelihood, in bits per character, of the output's characters,
each given up to {ORDER - 1} characters before it (the prompt's tail, then the output itself),
under a character {ORDER}-gram model fitted on held-out reference text: add-k smoothing
(k={ADD_K}) at each order, interpolated with fixed weights {list(WEIGHTS)} (1- to {ORDER}-gram).
Lower is better. Characters the reference never used count as one unknown symbol. An empty
output scores log2 of the alphabet size, as bad as guessing uniformly. The output is scored as
text: bytes that are not UTF-8 are U+FFFD, an unknown character.
"""
RUBRIC_VERSION = "rubric:sha256:" + sha256_bytes(RUBRIC.encode())[:16]


class JudgeError(ValueError):
    """A judge that cannot be fitted (no reference text)."""


@dataclass(frozen=True, eq=False)
class CharNgramJudge:
    """A fitted judge: the alphabet and the n-gram counts of its reference text."""

    alphabet: frozenset[str]
    counts: Mapping[str, int] = field(repr=False)  # "context+char" -> count, contexts 0..ORDER-1
    reference_characters: int

    @classmethod
    def fit(cls, texts: Iterable[str]) -> CharNgramJudge:
        """Count every 1- to ORDER-gram of each text (n-grams never cross two texts)."""
        counts: Counter[str] = Counter()
        alphabet: set[str] = set()
        characters = 0
        for text in texts:
            alphabet.update(text)
            characters += len(text)
            for n in range(1, ORDER + 1):
                counts.update(text[i : i + n] for i in range(len(text) - n + 1))
        if not characters:
            raise JudgeError("the judge has no reference text to fit on")
        # Read-only: the digest is cached, so the table must never change under it.
        return cls(frozenset(alphabet), MappingProxyType(dict(counts)), characters)

    def __post_init__(self) -> None:
        # Context totals: how often each context of length 1..ORDER-1 was followed by anything.
        totals: Counter[str] = Counter()
        for gram, count in self.counts.items():
            if len(gram) > 1:
                totals[gram[:-1]] += count
        object.__setattr__(self, "_totals", totals)
        unigrams = sum(c for g, c in self.counts.items() if len(g) == 1)
        object.__setattr__(self, "_unigrams", unigrams)

    @property
    def vocabulary_size(self) -> int:
        return len(self.alphabet) + 1  # and UNKNOWN

    @functools.cached_property
    def digest(self) -> str:
        """``sha256:<hex>`` over the version, parameters, alphabet and every count (cached:
        the table is immutable, and hashing ~25k counts costs a noticeable fraction of a second)."""
        return "sha256:" + sha256_json(self.describe_table())

    def describe_table(self) -> dict[str, Any]:
        return {
            "version": JUDGE_VERSION,
            "order": ORDER,
            "add_k": ADD_K,
            "weights": list(WEIGHTS),
            "alphabet": sorted(self.alphabet),
            "counts": sorted(self.counts.items()),
        }

    @property
    def model_name(self) -> str:
        """What an evaluation records as ``judge_model``: version and table digest."""
        return f"{JUDGE_VERSION}:{short_digest(self.digest)}"

    def describe(self) -> dict[str, Any]:
        return {
            "judge_model": self.model_name,
            "version": JUDGE_VERSION,
            "digest": self.digest,
            "rubric_version": RUBRIC_VERSION,
            "order": ORDER,
            "add_k": ADD_K,
            "weights": list(WEIGHTS),
            "alphabet_size": self.vocabulary_size,
            "reference_characters": self.reference_characters,
        }

    def char_bits(self, context: str, char: str) -> float:
        """-log2 P(char | the last ORDER-1 characters of context)."""
        char = char if char in self.alphabet else UNKNOWN
        context = "".join(c if c in self.alphabet else UNKNOWN for c in context[-(ORDER - 1) :])
        vocabulary = self.vocabulary_size
        totals: Counter[str] = self._totals  # type: ignore[attr-defined]
        probability = 0.0
        for n, weight in enumerate(WEIGHTS):  # n characters of context
            history = context[len(context) - n :] if n else ""
            if n and len(history) < n:
                seen, total = 0, 0  # not enough context: the add-k estimate is uniform
            elif n:
                seen, total = self.counts.get(history + char, 0), totals.get(history, 0)
            else:
                seen, total = self.counts.get(char, 0), self._unigrams  # type: ignore[attr-defined]
            probability += weight * (seen + ADD_K) / (total + ADD_K * vocabulary)
        return -math.log2(probability)

    def score(self, output: str, *, context: str = "") -> float:
        """Mean bits per character of ``output`` after ``context`` (see :data:`RUBRIC`)."""
        if not output:
            return math.log2(self.vocabulary_size)
        text = context[-(ORDER - 1) :] + output
        offset = len(text) - len(output)
        bits = sum(self.char_bits(text[:i], text[i]) for i in range(offset, len(text)))
        return bits / len(output)
