"""The versioned prompt set and prompt template of the generation evaluator.

Prompts and their references are cut from the EVAL split, deterministically: documents are
ranked by a salted hash of their ``doc_id``, and each chosen document gives one item, a
paragraph start picked by the same hash; the prompt is the next :data:`PROMPT_CHARS`
characters, the reference the :data:`REFERENCE_CHARS` after them. Same eval split, same
prompt set, same digest. The eval documents no prompt came from are the judge's reference
text (:func:`judge_documents`), so the judge never saw a reference it scores against.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.digests import sha256_bytes, sha256_json
from pipeline.textlm.data import TextDocuments

PROMPT_SET_VERSION = "textlm-prompts-v1"
PROMPT_SALT = "tracks-textlm-prompts-v1"
PROMPT_COUNT = 16
PROMPT_CHARS = 96
REFERENCE_CHARS = 64
PLACEHOLDER = "{prompt}"
_PARAGRAPH_START = re.compile(r"(?:^|\n[ \t]*\n)(?=\S)")


class PromptSetError(ValueError):
    """A prompt set or template that cannot be built or used; names what is wrong."""


@dataclass(frozen=True)
class PromptItem:
    """One prompt: where it was cut from, the prompt and the reference continuation."""

    item_id: str  # "<doc_id>@<character offset>"
    doc_id: str
    prompt: str
    reference: str


@dataclass(frozen=True)
class PromptSet:
    """The prompts an evaluation ran, with what they were cut from and how."""

    version: str
    source_digest: str  # the eval split's digest (TextDocuments.digest)
    items: tuple[PromptItem, ...]
    prompt_chars: int
    reference_chars: int

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` over the version and every item: a changed prompt, a new digest."""
        return "sha256:" + sha256_json(
            {
                "version": self.version,
                "items": [[i.item_id, i.doc_id, i.prompt, i.reference] for i in self.items],
            }
        )

    @property
    def doc_ids(self) -> frozenset[str]:
        return frozenset(item.doc_id for item in self.items)

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "digest": self.digest,
            "items": len(self.items),
            "source_digest": self.source_digest,
            "prompt_chars": self.prompt_chars,
            "reference_chars": self.reference_chars,
        }


@dataclass(frozen=True)
class PromptTemplate:
    """How a prompt becomes the model's input: ``text`` with one ``{prompt}`` placeholder.

    The family's models are base models over raw documents, so the default template is the
    prompt alone; it is recorded (text and digest) all the same, and a changed one is news.
    """

    name: str
    text: str

    def __post_init__(self) -> None:
        if self.text.count(PLACEHOLDER) != 1:
            raise PromptSetError(
                f"prompt template {self.name!r} must hold {PLACEHOLDER} exactly once, "
                f"holds it {self.text.count(PLACEHOLDER)} times"
            )

    @property
    def digest(self) -> str:
        return "sha256:" + sha256_bytes(f"{self.name}\n{self.text}".encode())

    def render(self, prompt: str) -> str:
        return self.text.replace(PLACEHOLDER, prompt)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "text": self.text, "digest": self.digest}


DEFAULT_TEMPLATE = PromptTemplate(name="raw-continuation-v1", text=PLACEHOLDER)


def _rank(doc_id: str) -> int:
    return int(hashlib.sha256(f"{PROMPT_SALT}:{doc_id}".encode()).hexdigest()[:16], 16)


def build_prompt_set(
    eval_documents: TextDocuments,
    *,
    count: int = PROMPT_COUNT,
    prompt_chars: int = PROMPT_CHARS,
    reference_chars: int = REFERENCE_CHARS,
) -> PromptSet:
    """Up to ``count`` items from the eval documents (see the module docstring).

    A document too short for a prompt and a reference from any paragraph start is passed
    over; an eval split with none long enough raises :class:`PromptSetError`.
    """
    span = prompt_chars + reference_chars
    candidates: list[PromptItem] = []
    for doc_id, text in sorted(
        zip(eval_documents.doc_ids, eval_documents.texts, strict=True),
        key=lambda pair: (_rank(pair[0]), pair[0]),
    ):
        starts = [m.end() for m in _PARAGRAPH_START.finditer(text) if m.end() + span <= len(text)]
        if not starts:
            continue
        start = starts[_rank(doc_id) % len(starts)]
        candidates.append(
            PromptItem(
                item_id=f"{doc_id}@{start}",
                doc_id=doc_id,
                prompt=text[start : start + prompt_chars],
                reference=text[start + prompt_chars : start + span],
            )
        )
    # One item per topic first, so a long topic cut into many documents does not fill the set.
    topics: set[str] = set()
    first_of_topic: list[PromptItem] = []
    for item in candidates:
        topic = item.doc_id.rpartition("/")[0] or item.doc_id
        if topic not in topics:
            topics.add(topic)
            first_of_topic.append(item)
    chosen = {item.item_id for item in first_of_topic[:count]}
    items = first_of_topic[:count] + [c for c in candidates if c.item_id not in chosen]
    items = items[:count]
    if not items:
        raise PromptSetError(
            f"no eval document is long enough for a {prompt_chars}-character prompt and a "
            f"{reference_chars}-character reference"
        )
    return PromptSet(
        version=PROMPT_SET_VERSION,
        source_digest=eval_documents.digest,
        items=tuple(items),
        prompt_chars=prompt_chars,
        reference_chars=reference_chars,
    )


def judge_documents(eval_documents: TextDocuments, prompt_set: PromptSet) -> Sequence[str]:
    """The eval texts no prompt was cut from: what the judge is fitted on."""
    used = prompt_set.doc_ids
    return [
        text
        for doc_id, text in zip(eval_documents.doc_ids, eval_documents.texts, strict=True)
        if doc_id not in used
    ]
