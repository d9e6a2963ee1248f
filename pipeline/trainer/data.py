"""Training tensors from a verified snapshot, and the seeded sampler that is the data cursor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.trainer.config import MODEL_SECTIONS, ConfigError

# BadInputError lives with the families that raise it; it is the data's error, named here too.
from pipeline.trainer.families import BadInputError, family

__all__ = ["BadInputError", "EpochSampler", "TrainingData", "load_training_data"]


@dataclass(frozen=True)
class TrainingData:
    """A snapshot's examples: ``inputs`` and ``targets`` per split, examples on dimension 0.

    What an example is belongs to the family (:mod:`pipeline.trainer.families`): an image and
    its label, or a window of tokens and the next token at each position.
    """

    snapshot_id: str
    manifest_sha256: str
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    eval_inputs: torch.Tensor
    eval_targets: torch.Tensor
    family: str

    @property
    def num_train_examples(self) -> int:
        return int(self.train_targets.shape[0])

    def to(self, device: torch.device) -> TrainingData:
        if device.type == "cpu":
            return self
        return replace(
            self,
            train_inputs=self.train_inputs.to(device),
            train_targets=self.train_targets.to(device),
            eval_inputs=self.eval_inputs.to(device),
            eval_targets=self.eval_targets.to(device),
        )


def load_training_data(
    snapshot_dir: str | Path,
    *,
    model_family: str,
    model_section: Mapping[str, Any] | None = None,
    ledger: Any = None,
) -> TrainingData:
    """Open the snapshot, require its blocking checks' verdict, verify its bytes, split it.

    Raises the data layer's errors (``BlockedSnapshotError``, ``SnapshotIntegrityError`` …),
    :class:`BadInputError`, or :class:`ConfigError` when the snapshot holds another family's
    data than ``model_family``: the trainer never trains on a snapshot the gate did not pass,
    by whatever path it was started. ``model_section``: the config's ``model`` (a text
    window is ``block_size + 1`` tokens); None: the family's defaults.
    """
    from pipeline.data.gate import ensure_checks_passed
    from pipeline.data.snapshot import open_snapshot

    row = family(model_family)
    if model_section is None:
        model_section = asdict(MODEL_SECTIONS[row.name]())
    snapshot = open_snapshot(Path(snapshot_dir))
    if snapshot.family != row.name:
        raise ConfigError(
            "config",
            "model_family",
            f"is {row.name}, but snapshot {snapshot.snapshot_id} holds {snapshot.family} data",
        )
    ensure_checks_passed(snapshot, snapshot_root=snapshot.path.parent, ledger=ledger)
    (train_inputs, train_targets), (eval_inputs, eval_targets) = row.load_examples(
        snapshot, model_section
    )
    for split, inputs, targets in (
        ("train", train_inputs, train_targets),
        ("eval", eval_inputs, eval_targets),
    ):
        if inputs.shape[0] != targets.shape[0] or inputs.shape[0] == 0:
            raise BadInputError(
                snapshot.path,
                f"{split} split has {inputs.shape[0]} inputs and {targets.shape[0]} targets",
            )
    return TrainingData(
        snapshot_id=snapshot.snapshot_id,
        manifest_sha256=snapshot.manifest_sha256,
        train_inputs=train_inputs,
        train_targets=train_targets,
        eval_inputs=eval_inputs,
        eval_targets=eval_targets,
        family=row.name,
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
