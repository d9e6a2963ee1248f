"""The model families the trainer trains, one row each: everything that differs between them.

A family decides how the examples come out of a verified snapshot, the model built from the
config's ``model`` section, the batch loss, the evaluation metrics a checkpoint records, and what
the spike drill does to a batch. Everything else (the data cursor, checkpoints, receipts, resume,
retries) is the same code for every family and never names one: a family's examples are two
tensors, ``inputs`` and ``targets``, indexed by example on their first dimension.

Imports are lazy: the trainer's start-up is measured, and a digits run never imports text-lm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.data.families import DIGITS as DIGITS_CNN
from pipeline.data.families import TEXT as TEXT_LM
from pipeline.data.families import UnknownFamilyError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from pipeline.data.snapshot import Snapshot

# A batch, or a split: inputs and targets, examples on the first dimension.
Examples = tuple["torch.Tensor", "torch.Tensor"]


class BadInputError(Exception):
    """The snapshot is readable but not what training needs (shape, dtype, labels, size)."""

    def __init__(self, snapshot_dir: str | Path, problem: str) -> None:
        super().__init__(f"snapshot {snapshot_dir}: {problem}")
        self.snapshot_dir = str(snapshot_dir)


@dataclass(frozen=True)
class Family:
    """One model family's row of the table (see the module doc)."""

    name: str
    """The family's name: TrainConfig.model_family, Snapshot.family, the ledger's column."""
    load_examples: Callable[[Snapshot, Mapping[str, Any]], tuple[Examples, Examples]]
    """The (train, eval) examples of a verified snapshot, shaped by the ``model`` section."""
    build_model: Callable[[Mapping[str, Any]], torch.nn.Module]
    """The model from the config's ``model`` section (its keys are the family's own)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Mean loss of a batch: the model's outputs on ``inputs``, and ``targets``."""
    evaluate: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], dict[str, float]]
    """Held-out metrics (eval mode, no grad, no RNG): ``eval_loss`` always, then the family's."""
    corrupt: Callable[[torch.Tensor, torch.Tensor], Examples]
    """The spike drill's batch (TRACKS_FAULT_SPIKE_BATCHES): new tensors whose loss jumps."""
    metrics: tuple[str, ...]
    """The names :attr:`evaluate` returns (a checkpoint's best_metric is one of them)."""


def family(name: str) -> Family:
    """The row of ``name``; :class:`UnknownFamilyError` names it and the known families."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise UnknownFamilyError(name) from None


def _digits_examples(snapshot: Snapshot, section: Mapping[str, Any]) -> tuple[Examples, Examples]:
    return digits_examples(snapshot)


def _text_examples(snapshot: Snapshot, section: Mapping[str, Any]) -> tuple[Examples, Examples]:
    return text_examples(snapshot, block_size=int(section["block_size"]))


def digits_examples(snapshot: Snapshot) -> tuple[Examples, Examples]:
    """digits-cnn: images ``float32 [N, 1, 8, 8]`` in 0..1 and labels ``int64 [N]``."""
    import torch

    from pipeline.data.columnar import ColumnValuesError, read_snapshot_columns
    from pipeline.data.columns import COLUMNS, PIXEL_COLUMNS, PIXEL_MAX, PIXEL_MIN
    from pipeline.data.dataset import split_arrays
    from pipeline.trainer.model import IMAGE_SIDE, NUM_CLASSES

    snapshot_dir = snapshot.path
    # Arrays, not a DataFrame: the trainer never imports pandas (pipeline/data/columnar.py).
    try:
        columns = read_snapshot_columns(snapshot, COLUMNS)
    except ColumnValuesError as exc:
        raise BadInputError(snapshot_dir, str(exc)) from exc
    # Checked again on the bytes actually read: the verdict vouches for the manifest, and the
    # trainer's own guard costs one pass over 64 columns.
    for name in PIXEL_COLUMNS:
        pixels = columns[name]
        # Written so that NaN (whose comparisons are all false) fails it too.
        if pixels.size and not (pixels.min() >= PIXEL_MIN and pixels.max() <= PIXEL_MAX):
            raise BadInputError(
                snapshot_dir,
                f"pixel values fall outside {PIXEL_MIN}..{PIXEL_MAX} (or are NaN) in {name}",
            )
    train_images, train_labels = split_arrays(columns, "train")
    eval_images, eval_labels = split_arrays(columns, "eval")
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
    return (train_images, train_labels), (eval_images, eval_labels)


def text_examples(snapshot: Snapshot, *, block_size: int) -> tuple[Examples, Examples]:
    """text-lm: windows of ``block_size + 1`` tokens; inputs are their first ``block_size``
    tokens, targets their last ``block_size`` (int64 ``[N, block_size]`` both).

    Training windows start every half block (each byte is seen twice an epoch); evaluation
    windows every block, so each held-out token is predicted exactly once.
    """
    from pipeline.textlm.columns import SPLIT_EVAL
    from pipeline.textlm.data import (
        TextDataError,
        split_documents,
        token_stream,
        token_windows,
        training_windows,
    )
    from pipeline.textlm.landing import read_text_snapshot_frame
    from pipeline.textlm.tokenizer import VOCAB_SIZE

    frame = read_text_snapshot_frame(snapshot)
    try:
        train = training_windows(frame, block_size=block_size)
        held_out = split_documents(frame, SPLIT_EVAL)
        evaluation = token_windows(token_stream(held_out.texts), block_size, block_size)
    except TextDataError as exc:
        raise BadInputError(
            snapshot.path, f"no windows of {block_size + 1} tokens (model.block_size + 1): {exc}"
        ) from exc
    for split, windows in (("train", train), ("eval", evaluation)):
        if windows.numel() and (windows.min() < 0 or windows.max() >= VOCAB_SIZE):
            raise BadInputError(snapshot.path, f"{split} tokens fall outside 0..{VOCAB_SIZE - 1}")
    return (train[:, :-1], train[:, 1:]), (evaluation[:, :-1], evaluation[:, 1:])


# digits-cnn: [N, 1, 8, 8] float images and int64 class labels.


def _digits_model(section: Mapping[str, Any]) -> torch.nn.Module:
    from pipeline.trainer.model import build_model

    return build_model(dict(section))


def _classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits, targets)


def _digits_evaluate(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    total_loss, correct = 0.0, 0
    with _eval_mode(model), torch.no_grad():
        for start in range(0, len(targets), 512):
            logits = model(inputs[start : start + 512])
            batch = targets[start : start + 512]
            total_loss += F.cross_entropy(logits, batch, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == batch).sum().item())
    count = max(len(targets), 1)
    return {"eval_loss": total_loss / count, "eval_accuracy": correct / count}


def _digits_corrupt(inputs: torch.Tensor, targets: torch.Tensor) -> Examples:
    # Pixels scaled by 1000: activations, logits and the loss explode on that batch alone.
    return inputs * 1e3, targets


# text-lm: windows of block_size + 1 byte tokens; inputs are their first block_size tokens,
# targets their last block_size (the next byte at every position).


def _text_model(section: Mapping[str, Any]) -> torch.nn.Module:
    from pipeline.textlm.model import build_model

    return build_model(dict(section))


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _text_evaluate(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> dict[str, float]:
    """eval_loss (nats per token), eval_bits_per_byte, eval_accuracy (next-token arg-max).

    Bits per byte count the predictions of bytes only: the end-of-text token a window predicts
    at a document's end is in eval_loss, not in the bytes, as in the held-out evaluator (whose
    windows and contexts differ, so the two figures are close, not equal).
    """
    import torch
    import torch.nn.functional as F

    from pipeline.textlm.tokenizer import EOT_ID

    total_nats, byte_nats, tokens, byte_count, correct = 0.0, 0.0, 0, 0, 0
    with _eval_mode(model), torch.no_grad():
        for start in range(0, len(targets), 64):
            logits = model(inputs[start : start + 64])
            batch = targets[start : start + 64].reshape(-1)
            nats = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch, reduction="none"
            ).double()
            is_byte = batch != EOT_ID
            total_nats += float(nats.sum().item())
            byte_nats += float(nats[is_byte].sum().item())
            tokens += batch.numel()
            byte_count += int(is_byte.sum().item())
            correct += int((logits.reshape(-1, logits.shape[-1]).argmax(dim=1) == batch).sum())
    return {
        "eval_loss": total_nats / max(tokens, 1),
        "eval_bits_per_byte": byte_nats / math.log(2) / max(byte_count, 1),
        "eval_accuracy": correct / max(tokens, 1),
    }


def _text_corrupt(inputs: torch.Tensor, targets: torch.Tensor) -> Examples:
    # Every target replaced by a fixed permutation of the vocabulary (ids stay in range, so
    # the batch still runs): the model is asked for the wrong next byte everywhere, and its
    # loss on that batch jumps well above the recent ones.
    from pipeline.textlm.tokenizer import VOCAB_SIZE

    return inputs, (targets * 97 + 131) % VOCAB_SIZE


class _eval_mode:
    """``model.eval()`` for the block, then the mode it had (the trajectory is untouched)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.was_training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)


FAMILIES: dict[str, Family] = {
    DIGITS_CNN: Family(
        name=DIGITS_CNN,
        load_examples=_digits_examples,
        build_model=_digits_model,
        loss=_classification_loss,
        evaluate=_digits_evaluate,
        corrupt=_digits_corrupt,
        metrics=("eval_loss", "eval_accuracy"),
    ),
    TEXT_LM: Family(
        name=TEXT_LM,
        load_examples=_text_examples,
        build_model=_text_model,
        loss=_next_token_loss,
        evaluate=_text_evaluate,
        corrupt=_text_corrupt,
        metrics=("eval_loss", "eval_bits_per_byte", "eval_accuracy"),
    ),
}
