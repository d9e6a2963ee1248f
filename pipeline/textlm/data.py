"""Training tensors for text-lm: the train documents as one token stream, cut into windows.

The stream is each train document, in ``doc_id`` order, begun by EOT (``[EOT] doc1 [EOT]
doc2 …``), as :meth:`ByteTokenizer.encode_document` makes it, so the model learns where a
document starts. Windows of ``block_size + 1`` tokens start every ``stride`` tokens; a window
is one training example (inputs its first ``block_size`` tokens, targets its last), so the
trainer's seeded epoch sampler, which deals example indices, is the data cursor unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from pipeline.digests import sha256_json
from pipeline.textlm.columns import DOC_ID, SPLIT, SPLIT_EVAL, SPLIT_TRAIN, TEXT
from pipeline.textlm.tokenizer import TOKENIZER

EVAL_SET_FORMAT = "tracks-textlm-eval/1"


class TextDataError(ValueError):
    """Text that cannot become training windows (too short, empty split); names the split."""


@dataclass(frozen=True)
class TextDocuments:
    """One split's documents, ``doc_id`` order."""

    split: str
    doc_ids: tuple[str, ...]
    texts: tuple[str, ...]

    @property
    def digest(self) -> str:
        """sha256 of the (doc_id, text) pairs: the eval split's "task set version"."""
        return sha256_json(
            {
                "format": EVAL_SET_FORMAT,
                "split": self.split,
                "rows": list(zip(self.doc_ids, self.texts, strict=True)),
            }
        )


def split_documents(frame: pd.DataFrame, split: str) -> TextDocuments:
    """The rows of ``split`` in ``doc_id`` order (a frame that passed the text contract)."""
    if split not in (SPLIT_TRAIN, SPLIT_EVAL):
        raise TextDataError(f"split {split!r} is not one of {SPLIT_TRAIN}, {SPLIT_EVAL}")
    rows = frame.loc[frame[SPLIT] == split].sort_values(DOC_ID, kind="stable")
    if rows.empty:
        raise TextDataError(f"split {split!r} has no documents")
    return TextDocuments(split, tuple(map(str, rows[DOC_ID])), tuple(map(str, rows[TEXT])))


def token_stream(texts: Sequence[str]) -> torch.Tensor:
    """``[EOT] text1 [EOT] text2 …`` as int64 token ids."""
    ids: list[int] = []
    for text in texts:
        ids.extend(TOKENIZER.encode_document(text))
    return torch.tensor(ids, dtype=torch.int64)


def token_windows(stream: torch.Tensor, block_size: int, stride: int) -> torch.Tensor:
    """Windows ``[N, block_size + 1]`` of ``stream`` starting every ``stride`` tokens."""
    if stride < 1:
        raise TextDataError(f"stride must be >= 1, got {stride}")
    if len(stream) < block_size + 1:
        raise TextDataError(
            f"{len(stream)} tokens cannot fill one window of {block_size + 1} tokens"
        )
    return stream.unfold(0, block_size + 1, stride).contiguous()


def training_windows(
    frame: pd.DataFrame, *, block_size: int, stride: int | None = None
) -> torch.Tensor:
    """The train split's windows; ``stride`` defaults to half a block (each byte seen twice)."""
    documents = split_documents(frame, SPLIT_TRAIN)
    return token_windows(token_stream(documents.texts), block_size, stride or block_size // 2)
