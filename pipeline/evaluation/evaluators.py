"""The evaluators Tracks runs on every committed checkpoint, and the registry that names them."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from pipeline.data.families import DIGITS, FAMILIES, TEXT, UnknownFamilyError
from pipeline.evaluation.base import ClassifierEvaluator, Evaluator, EvaluatorResult
from pipeline.evaluation.errors import UnknownEvaluatorError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from torch import nn


class HoldoutAccuracy(ClassifierEvaluator):
    """Accuracy and macro-F1 on the held-out split, per-class accuracy slices, confusion matrix."""

    name: ClassVar[str] = "holdout_accuracy"

    def evaluate(
        self,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        sample_ids: Sequence[Any],
    ) -> EvaluatorResult:
        probabilities = self.predict_proba(model, images)
        truth = labels.numpy().astype(np.int64)
        predictions = probabilities.argmax(axis=1)
        num_classes = probabilities.shape[1]
        confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
        np.add.at(confusion, (truth, predictions), 1)

        slices: dict[str, dict[str, float]] = {}
        f1_scores = []
        for k in range(num_classes):
            support = int(confusion[k].sum())
            predicted = int(confusion[:, k].sum())
            hits = int(confusion[k, k])
            if support:
                slices[f"class={k}"] = {"accuracy": hits / support, "support": float(support)}
            if support or predicted:
                # Macro-F1 over classes that occur in labels or predictions, as scikit-learn does.
                f1_scores.append(2 * hits / (support + predicted))
        outputs = self.outputs_frame(sample_ids, truth, probabilities)
        return EvaluatorResult(
            metrics={
                "accuracy": self.accuracy(truth, predictions),
                "macro_f1": float(np.mean(f1_scores)) if f1_scores else float("nan"),
                "examples": float(len(truth)),
            },
            slice_metrics=slices,
            raw_outputs=outputs,
            failures=self.sample_failures(outputs),
            confusion_matrix=confusion.tolist(),
        )


class NoiseRobustness(ClassifierEvaluator):
    """Accuracy when seeded Gaussian noise is added to the pixels, one slice per noise level."""

    name: ClassVar[str] = "noise_robustness"
    noise_levels: ClassVar[tuple[float, ...]] = (0.0, 0.05, 0.1, 0.2, 0.3)  # std, pixels in [0, 1]
    noise_seed: ClassVar[int] = 20_240_601

    @property
    def decoding_params(self) -> dict[str, Any]:
        return {
            **super().decoding_params,
            "noise_levels": list(self.noise_levels),
            "noise_seed": self.noise_seed,
        }

    def evaluate(
        self,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        sample_ids: Sequence[Any],
    ) -> EvaluatorResult:
        import pandas as pd
        import torch

        truth = labels.numpy().astype(np.int64)
        metrics: dict[str, float] = {}
        slices: dict[str, dict[str, float]] = {}
        frames = []
        for level in self.noise_levels:
            # One generator per level, seeded by the level: adding a level changes no other.
            generator = torch.Generator().manual_seed(self.noise_seed + round(level * 1000))
            noise = torch.randn(images.shape, generator=generator, dtype=torch.float32)
            noisy = (images.float() + level * noise).clamp(0.0, 1.0)
            probabilities = self.predict_proba(model, noisy)
            accuracy = self.accuracy(truth, probabilities.argmax(axis=1))
            metrics[f"accuracy@{level:g}"] = accuracy
            slices[f"noise={level:g}"] = {"accuracy": accuracy, "support": float(len(truth))}
            frame = self.outputs_frame(sample_ids, truth, probabilities)
            frame.insert(1, "noise_level", level)
            frames.append(frame)
        by_level = {level: metrics[f"accuracy@{level:g}"] for level in self.noise_levels}
        metrics["mean_noisy_accuracy"] = float(np.mean([a for lv, a in by_level.items() if lv > 0]))
        metrics["worst_accuracy"] = float(min(by_level.values()))
        outputs = pd.concat(frames, ignore_index=True)
        return EvaluatorResult(
            metrics=metrics,
            slice_metrics=slices,
            raw_outputs=outputs,
            failures=self.sample_failures(outputs),
        )


# The digits-cnn family's evaluators (the family Tracks began with; its callers name them so).
EVALUATORS: dict[str, Evaluator] = {
    evaluator.name: evaluator for evaluator in (HoldoutAccuracy(), NoiseRobustness())
}


@functools.cache
def _text_evaluators() -> dict[str, Any]:
    # Imported on first use: the text evaluators bring torch, and a digits step never needs them.
    # The generation evaluator is registered unbound: it judges with the judge fitted on the
    # eval split it is given (run_evaluation binds it before recording its judge).
    from pipeline.textlm.evaluators import Contamination, GenerationJudged, HeldoutBitsPerByte

    registered = (HeldoutBitsPerByte(), GenerationJudged(), Contamination())
    return {evaluator.name: evaluator for evaluator in registered}


def family_evaluators(family: str = DIGITS) -> dict[str, Any]:
    """The evaluators every committed checkpoint of ``family`` is evaluated by, by name.

    digits-cnn: :class:`Evaluator`s over image tensors; text-lm: the
    ``pipeline.textlm.evaluators`` over a ``TextEvalSet``. Raises ``UnknownFamilyError``.
    """
    if family == DIGITS:
        return dict(EVALUATORS)
    if family == TEXT:
        return dict(_text_evaluators())
    raise UnknownFamilyError(family)


def required_evaluators(family: str = DIGITS) -> list[str]:
    """Names of the evaluators a checkpoint of ``family`` needs complete evaluations from to be
    promoted."""
    return sorted(name for name, e in family_evaluators(family).items() if e.required)


def evaluator_versions() -> dict[str, str]:
    """The current version of every registered evaluator, of every family, by name."""
    return {name: e.version for f in FAMILIES for name, e in family_evaluators(f).items()}


def get_evaluator(name: str, family: str | None = None) -> Any:
    """The registered evaluator called ``name`` (of ``family`` when given, else of any)."""
    for candidate in (family,) if family is not None else FAMILIES:
        found = family_evaluators(candidate).get(name)
        if found is not None:
            return found
    known = sorted(family_evaluators(family)) if family is not None else _all_names()
    raise UnknownEvaluatorError(name, known)


def _all_names() -> list[str]:
    return sorted(name for f in FAMILIES for name in family_evaluators(f))
