"""Training tensors from a verified snapshot, and the seeded sampler that is the data cursor."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.trainer.model import IMAGE_SIDE, NUM_CLASSES


class BadInputError(Exception):
    """The snapshot is readable but not what training needs (shape, dtype, labels, size)."""

    def __init__(self, snapshot_dir: str | Path, problem: str) -> None:
        super().__init__(f"snapshot {snapshot_dir}: {problem}")
        self.snapshot_dir = str(snapshot_dir)


@dataclass(frozen=True)
class TrainingData:
    snapshot_id: str
    manifest_sha256: str
    train_images: torch.Tensor
    train_labels: torch.Tensor
    eval_images: torch.Tensor
    eval_labels: torch.Tensor

    def to(self, device: torch.device) -> TrainingData:
        if device.type == "cpu":
            return self
        return replace(
            self,
            train_images=self.train_images.to(device),
            train_labels=self.train_labels.to(device),
            eval_images=self.eval_images.to(device),
            eval_labels=self.eval_labels.to(device),
        )


def load_training_data(snapshot_dir: str | Path, *, ledger: Any = None) -> TrainingData:
    """Open the snapshot, require its blocking checks' verdict, verify its bytes, split it.

    Raises the data layer's errors (``BlockedSnapshotError``, ``SnapshotIntegrityError`` …) or
    :class:`BadInputError`: the trainer never trains on a snapshot the gate did not pass, by
    whatever path it was started.
    """
    from pipeline.data.columns import PIXEL_COLUMNS, PIXEL_MAX, PIXEL_MIN
    from pipeline.data.dataset import split_tensors
    from pipeline.data.gate import ensure_checks_passed
    from pipeline.data.snapshot import open_snapshot, read_snapshot_frame

    snapshot = open_snapshot(Path(snapshot_dir))
    ensure_checks_passed(snapshot, snapshot_root=snapshot.path.parent, ledger=ledger)
    frame = read_snapshot_frame(snapshot)
    # Checked again on the bytes actually read: the verdict vouches for the manifest, and the
    # trainer's own guard costs one pass over 64 columns.
    pixels = frame[list(PIXEL_COLUMNS)]
    if (
        pixels.isna().any().any()
        or (pixels < PIXEL_MIN).any().any()
        or (pixels > PIXEL_MAX).any().any()
    ):
        raise BadInputError(
            snapshot_dir, f"pixel values fall outside {PIXEL_MIN}..{PIXEL_MAX} (or are null)"
        )
    train_images, train_labels = split_tensors(frame, "train")
    eval_images, eval_labels = split_tensors(frame, "eval")
    for split, images, labels in (
        ("train", train_images, train_labels),
        ("eval", eval_images, eval_labels),
    ):
        expected = (1, IMAGE_SIDE, IMAGE_SIDE)
        if images.dtype != torch.float32 or tuple(images.shape[1:]) != expected:
            raise BadInputError(
                snapshot_dir,
                f"{split} images are {images.dtype} {tuple(images.shape)}, "
                f"expected float32 [N, {', '.join(map(str, expected))}]",
            )
        if labels.dtype != torch.int64 or labels.shape != (images.shape[0],):
            raise BadInputError(
                snapshot_dir, f"{split} labels are {labels.dtype} {tuple(labels.shape)}"
            )
        if labels.numel() and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
            raise BadInputError(snapshot_dir, f"{split} labels fall outside 0..{NUM_CLASSES - 1}")
        if not torch.isfinite(images).all():
            raise BadInputError(snapshot_dir, f"{split} images hold NaN or Inf")
    return TrainingData(
        snapshot_id=snapshot.snapshot_id,
        manifest_sha256=snapshot.manifest_sha256,
        train_images=train_images,
        train_labels=train_labels,
        eval_images=eval_images,
        eval_labels=eval_labels,
    )


class EpochSampler:
    """Batches in a seeded random order per epoch: the data cursor a checkpoint saves.

    The order of epoch ``e`` depends only on ``seed + e``, so a resumed process that knows
    (epoch, position) draws exactly the batches the interrupted one would have drawn.
    Incomplete last batches are dropped, so every step sees ``batch_size`` examples.

    Batch *numbers* count the seeded order from 1 over the whole run (epoch after epoch): in
    a run that skipped nothing, step n trains on batch n. A loss spike's rollback names ranges
    of them never to deal (:meth:`skip_batches`); the cursor moves past them as it reaches
    them, and the ranges are part of its state, so a resumed process skips the same batches.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int) -> None:
        if batch_size > num_examples:
            raise ValueError(
                f"batch_size {batch_size} exceeds the {num_examples} training examples"
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches already drawn (or skipped) in this epoch
        self.skipped: list[tuple[int, int]] = []  # [first, last] batch numbers never dealt
        self._order: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    @property
    def dealt(self) -> int:
        """Batches of the run's order dealt or skipped so far: the number of the last one."""
        return self.epoch * self.batches_per_epoch + self.position

    def skip_batches(self, first: int, last: int) -> None:
        """Never deal batches ``first``..``last`` (numbers; see the class doc)."""
        if not 1 <= first <= last:
            raise ValueError(f"batch range {first}..{last} is not a range of batch numbers")
        self.skipped.append((first, last))

    def _is_skipped(self, number: int) -> bool:
        return any(first <= number <= last for first, last in self.skipped)

    def next_indices(self) -> torch.Tensor:
        while True:
            if self.position >= self.batches_per_epoch:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            if not self._is_skipped(self.dealt + 1):
                break
            self.position += 1  # moved past: no example of it is ever drawn
        if self._order is None:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order = torch.randperm(self.num_examples, generator=generator)
        start = self.position * self.batch_size
        self.position += 1
        return self._order[start : start + self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            "skipped": [list(r) for r in self.skipped],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_examples", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data cursor {key}={state[key]} in the checkpoint, {getattr(self, key)} now"
                )
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
        # Checkpoints written before skip ranges existed have none.
        self.skipped = [(int(first), int(last)) for first, last in state.get("skipped", [])]
