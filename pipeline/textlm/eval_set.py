"""What the text-lm evaluators read: the eval split, its prompt set, its judge, the training text.

Built from the snapshot the checkpoint is evaluated on and, for the contamination check, the
snapshot it was trained on (the same one in the normal graph; another when an evaluation set
is landed on its own). Everything here is derived deterministically from those two snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.textlm.columns import SPLIT_EVAL, SPLIT_TRAIN
from pipeline.textlm.data import TextDocuments, split_documents
from pipeline.textlm.judge import CharNgramJudge
from pipeline.textlm.prompts import PROMPT_COUNT, PromptSet, build_prompt_set, judge_documents

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, eq=False)
class TextEvalSet:
    """The eval documents and everything derived from them, with the training texts."""

    snapshot_id: str
    eval_documents: TextDocuments
    prompt_set: PromptSet
    judge: CharNgramJudge
    training_snapshot_id: str
    training_texts: tuple[str, ...]

    @property
    def task_set_version(self) -> str:
        """sha256 of the eval documents (ids and texts): equal digests, equal task sets."""
        return self.eval_documents.digest

    @classmethod
    def from_frame(
        cls,
        frame: pd.DataFrame,
        *,
        snapshot_id: str,
        training_frame: pd.DataFrame | None = None,
        training_snapshot_id: str | None = None,
        prompt_count: int = PROMPT_COUNT,
    ) -> TextEvalSet:
        """From a snapshot frame that passed the text contract (and its training snapshot's)."""
        eval_documents = split_documents(frame, SPLIT_EVAL)
        prompt_set = build_prompt_set(eval_documents, count=prompt_count)
        if training_frame is None:
            training_frame, training_snapshot_id = frame, snapshot_id
        training = split_documents(training_frame, SPLIT_TRAIN)
        return cls(
            snapshot_id=snapshot_id,
            eval_documents=eval_documents,
            prompt_set=prompt_set,
            judge=CharNgramJudge.fit(judge_documents(eval_documents, prompt_set)),
            training_snapshot_id=training_snapshot_id or snapshot_id,
            training_texts=training.texts,
        )
