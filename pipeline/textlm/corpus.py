"""The text-lm corpus: the Python language reference that ships inside CPython itself.

Why this corpus: ``pydoc_data.topics`` is part of the standard library (``help("if")`` reads
it), so every Python has it with no download, no network and no extra package, and a fresh
machine can land, train and evaluate the ``text-lm`` family as the digits family does with
scikit-learn's bundled digits. It is real English technical prose mixed with grammar and code
(about 465k characters in 79 topics on Python 3.11, nearly all ASCII with a few typographic
characters), big enough for a small byte-level model to learn something measurable in minutes
and small enough to read whole. It changes between Python versions, so what a snapshot holds
is pinned by the Python version and the corpus digest recorded with it (:class:`CorpusInfo`).

Documents: each topic is cut at blank lines into pieces of about :data:`CHUNK_TARGET_CHARS`
characters (ids ``<topic>/<nnn>``, stable for one corpus digest). The train/eval split keeps
every piece of a topic on one side, and every topic that shares text with another on that
other's side: pydoc's topics repeat whole sections of each other (``specialnames`` holds most
of ``customization``; ``typesseq-mutable`` repeats ``typesseq``'s notes), and a topic-by-topic
split put a third of the eval split's 13-word sequences into training (measured: 0.347, 6 of 16
prompts dirty; see :mod:`pipeline.textlm.contamination`). So topics that share any 13-word
sequence form one group (79 topics make 52 groups on Python 3.11), groups are taken in a
salted-hash order, and each joins eval while eval holds under :data:`EVAL_FRACTION` of the
characters and would not pass :data:`EVAL_FRACTION_MAX` with it; the rest is train.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from dataclasses import dataclass
from typing import Any

from pipeline.digests import sha256_json
from pipeline.textlm.columns import MAX_TEXT_CHARS, SPLIT_EVAL, SPLIT_TRAIN
from pipeline.textlm.contamination import word_ngrams

CORPUS_NAME = "pydoc_data.topics"
CORPUS_FORMAT = "tracks-textlm-corpus/1"
CHUNK_TARGET_CHARS = 2048
EVAL_FRACTION = 0.2
EVAL_FRACTION_MAX = 0.25
# Part of what decides the split: changing it moves topics between train and eval, so it is
# recorded in CorpusInfo beside the fraction.
SPLIT_SALT = "tracks-textlm-split-v1"
_PARAGRAPH_BREAK = re.compile(r"(\n[ \t]*\n)")


@dataclass(frozen=True)
class Document:
    """One landed row: a piece of one topic, on one side of the split."""

    doc_id: str
    split: str
    text: str

    @property
    def topic(self) -> str:
        return self.doc_id.rpartition("/")[0] or self.doc_id


@dataclass(frozen=True)
class CorpusInfo:
    """Exactly which corpus a landing file holds, and how it was cut and split."""

    name: str
    python_version: str
    corpus_sha256: str  # over the topics as CPython ships them (names and texts)
    documents_sha256: str  # over the landed rows (doc_id, split, text)
    topics: int
    characters: int
    documents: int
    train_documents: int
    eval_documents: int
    duplicates_dropped: int
    chunk_target_chars: int
    eval_fraction: float
    eval_characters: int
    split_salt: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CORPUS_FORMAT,
            "name": self.name,
            "python_version": self.python_version,
            "corpus_sha256": self.corpus_sha256,
            "documents_sha256": self.documents_sha256,
            "topics": self.topics,
            "characters": self.characters,
            "documents": self.documents,
            "train_documents": self.train_documents,
            "eval_documents": self.eval_documents,
            "duplicates_dropped": self.duplicates_dropped,
            "chunk_target_chars": self.chunk_target_chars,
            "eval_fraction": self.eval_fraction,
            "eval_characters": self.eval_characters,
            "split_salt": self.split_salt,
        }

    @property
    def source(self) -> str:
        """One line for a snapshot manifest's ``source``: the corpus, Python and digest."""
        return f"{self.name} (Python {self.python_version}) sha256:{self.corpus_sha256}"


def load_topics() -> dict[str, str]:
    """The topics CPython ships (``pydoc_data.topics.topics``), by name."""
    from pydoc_data import topics

    return dict(topics.topics)


def corpus_digest(topics: dict[str, str]) -> str:
    """sha256 of the canonical corpus: the sorted (name, text) pairs as canonical JSON."""
    return sha256_json({"format": CORPUS_FORMAT, "topics": sorted(topics.items())})


def documents_digest(documents: list[Document]) -> str:
    """sha256 of the landed rows in doc_id order; equal digests, equal landing rows."""
    rows = sorted((d.doc_id, d.split, d.text) for d in documents)
    return sha256_json({"format": CORPUS_FORMAT, "rows": rows})


def topic_groups(topics: dict[str, str]) -> dict[str, str]:
    """Each topic's group, named by its first member: topics sharing a 13-word sequence."""
    parent = {name: name for name in topics}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    first_seen: dict[tuple[str, ...], str] = {}
    for name in sorted(topics):
        for gram in word_ngrams(topics[name]):
            other = first_seen.setdefault(gram, name)
            a, b = root(name), root(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {name: root(name) for name in topics}


def assign_splits(topics: dict[str, str]) -> dict[str, str]:
    """``train`` or ``eval`` for every topic (see the module docstring)."""
    groups = topic_groups(topics)
    members: dict[str, list[str]] = {}
    for name, group in groups.items():
        members.setdefault(group, []).append(name)
    total = sum(len(text) for text in topics.values())
    order = sorted(members, key=lambda g: hashlib.sha256(f"{SPLIT_SALT}:{g}".encode()).digest())
    split = dict.fromkeys(topics, SPLIT_TRAIN)
    held_out = 0
    for group in order:
        if held_out >= EVAL_FRACTION * total:
            break
        size = sum(len(topics[name]) for name in members[group])
        if held_out + size <= EVAL_FRACTION_MAX * total:
            held_out += size
            split.update(dict.fromkeys(members[group], SPLIT_EVAL))
    return split


def chunk_text(text: str, *, target: int = CHUNK_TARGET_CHARS) -> list[str]:
    """Cut ``text`` at blank lines into pieces of about ``target`` characters.

    Joined, the pieces are ``text`` exactly: each piece keeps the blank lines that end it. A
    paragraph longer than :data:`MAX_TEXT_CHARS` is cut at line ends, a line longer than that
    at the limit, so no piece breaks the contract's length bound.
    """
    pieces = _PARAGRAPH_BREAK.split(text)
    # re.split with a group alternates paragraph, separator, paragraph …: glue each separator
    # to the paragraph before it.
    pieces.append("")  # so every paragraph has a separator after it, the last an empty one
    paragraphs = [pieces[i] + pieces[i + 1] for i in range(0, len(pieces) - 1, 2)]
    chunks: list[str] = []
    current = ""
    for paragraph in (p for para in paragraphs for p in _bounded(para)):
        if current and len(current) + len(paragraph) > target:
            chunks.append(current)
            current = ""
        current += paragraph
    if current:
        chunks.append(current)
    return chunks


def _bounded(paragraph: str) -> list[str]:
    if len(paragraph) <= MAX_TEXT_CHARS:
        return [paragraph]
    out: list[str] = []
    current = ""
    for line in paragraph.splitlines(keepends=True):
        for start in range(0, len(line), MAX_TEXT_CHARS):
            part = line[start : start + MAX_TEXT_CHARS]
            if current and len(current) + len(part) > MAX_TEXT_CHARS:
                out.append(current)
                current = ""
            current += part
    if current:
        out.append(current)
    return out


def build_documents(
    topics: dict[str, str] | None = None,
) -> tuple[list[Document], CorpusInfo]:
    """The corpus as landing rows (sorted by doc_id) and the record of what it is.

    Whitespace-only pieces are left out (the contract refuses empty documents), and a piece
    whose text already appeared under an earlier id is dropped and counted: the same text twice
    could land on both sides of the split, which the contract refuses as a leak.
    """
    if topics is None:
        documents, info = _shipped_corpus()
        return list(documents), info
    documents: list[Document] = []
    seen: set[str] = set()
    dropped = 0
    splits = assign_splits(topics)
    for topic in sorted(topics):
        split = splits[topic]
        for index, piece in enumerate(chunk_text(topics[topic])):
            if not piece.strip():
                continue
            if piece in seen:
                dropped += 1
                continue
            seen.add(piece)
            documents.append(Document(f"{topic}/{index:03d}", split, piece))
    info = CorpusInfo(
        name=CORPUS_NAME,
        python_version=".".join(map(str, sys.version_info[:3])),
        corpus_sha256=corpus_digest(topics),
        documents_sha256=documents_digest(documents),
        topics=len(topics),
        characters=sum(len(text) for text in topics.values()),
        documents=len(documents),
        train_documents=sum(d.split == SPLIT_TRAIN for d in documents),
        eval_documents=sum(d.split == SPLIT_EVAL for d in documents),
        duplicates_dropped=dropped,
        chunk_target_chars=CHUNK_TARGET_CHARS,
        eval_fraction=EVAL_FRACTION,
        eval_characters=sum(len(d.text) for d in documents if d.split == SPLIT_EVAL),
        split_salt=SPLIT_SALT,
    )
    return documents, info


@functools.cache
def _shipped_corpus() -> tuple[tuple[Document, ...], CorpusInfo]:
    # The shipped corpus cannot change within a process; grouping its topics costs a second.
    documents, info = build_documents(load_topics())
    return tuple(documents), info
