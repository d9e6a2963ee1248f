"""The eval split of a snapshot as tensors, with the ids and digest an evaluation records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.evaluation.errors import EvalSetError

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from pipeline.textlm.eval_set import TextEvalSet


@dataclass(frozen=True, eq=False)
class EvalSet:
    """Images ``[N, 1, 8, 8]`` float32 in [0, 1], int64 labels, and their sample ids in order."""

    snapshot_id: str
    task_set_version: str  # digest of the eval rows: equal digests, equal task sets
    images: torch.Tensor
    labels: torch.Tensor
    sample_ids: list[Any]

    def __post_init__(self) -> None:
        if len(self.labels) == 0:
            raise EvalSetError(self.snapshot_id, "the eval split is empty")
        if not len(self.images) == len(self.labels) == len(self.sample_ids):
            raise EvalSetError(
                self.snapshot_id,
                f"{len(self.images)} images, {len(self.labels)} labels and "
                f"{len(self.sample_ids)} sample ids do not line up",
            )

    @classmethod
    def from_snapshot(cls, snapshot: Any) -> EvalSet:
        """Read an opened ``pipeline.data.snapshot.Snapshot`` and take its eval split."""
        from pipeline.data.snapshot import read_snapshot_frame

        return cls.from_frame(read_snapshot_frame(snapshot), snapshot_id=snapshot.snapshot_id)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, *, snapshot_id: str) -> EvalSet:
        """The eval split of a snapshot frame, via ``pipeline.data.dataset``."""
        import numpy as np

        from pipeline.data.dataset import eval_task_set_version, split_tensors

        images, labels = split_tensors(frame, "eval")
        # split_tensors orders rows by sample_id; ids must follow the same order, so check it.
        rows = frame[frame["split"] == "eval"].sort_values("sample_id", kind="stable")
        if len(rows) != len(labels) or not np.array_equal(
            rows["label"].to_numpy(dtype=np.int64), labels.numpy()
        ):
            raise EvalSetError(
                snapshot_id, "split_tensors did not return the eval rows in sample_id order"
            )
        return cls(
            snapshot_id=snapshot_id,
            task_set_version=eval_task_set_version(frame),
            images=images,
            labels=labels,
            sample_ids=rows["sample_id"].tolist(),
        )


def text_eval_set(snapshot: Any, training_snapshot: Any | None = None) -> TextEvalSet:
    """The text-lm evaluation inputs of an opened text snapshot (verified as it is read).

    ``training_snapshot`` is the snapshot the evaluated run trained on (the contamination
    check's reference); None or the same snapshot: ``snapshot`` itself.
    """
    from pipeline.data.families import TEXT
    from pipeline.textlm.eval_set import TextEvalSet
    from pipeline.textlm.landing import read_text_snapshot_frame

    for opened in (snapshot, training_snapshot):
        if opened is not None and opened.family != TEXT:
            raise EvalSetError(
                opened.snapshot_id, f"holds {opened.family} data, not {TEXT} documents"
            )
    frame = read_text_snapshot_frame(snapshot)
    same = training_snapshot is None or training_snapshot.snapshot_id == snapshot.snapshot_id
    return TextEvalSet.from_frame(
        frame,
        snapshot_id=snapshot.snapshot_id,
        training_frame=None if same else read_text_snapshot_frame(training_snapshot),
        training_snapshot_id=None if same else training_snapshot.snapshot_id,
    )
