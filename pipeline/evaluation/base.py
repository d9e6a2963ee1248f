"""What an evaluator is: a named, versioned, deterministic function of a model and eval data."""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    import pandas as pd
    import torch
    from torch import nn

NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True, eq=False)
class EvaluatorResult:
    """What one evaluator found: aggregate and per-slice metrics, and every example's output."""

    metrics: dict[str, float]
    slice_metrics: dict[str, dict[str, float]]  # {"class=3": {"accuracy": 0.97, "support": 36}}
    raw_outputs: pd.DataFrame  # one row per example (per noise level where there are levels)
    failures: pd.DataFrame  # a deterministic sample of the wrong predictions
    confusion_matrix: list[list[int]] | None = None  # rows: true label, columns: predicted


@runtime_checkable
class Evaluator(Protocol):
    """One evaluator. ``version`` is a digest of its code, so a changed evaluator is a new one."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def required(self) -> bool: ...

    @property
    def decoding_params(self) -> dict[str, Any]: ...

    @property
    def judge_model(self) -> str: ...

    @property
    def rubric_version(self) -> str: ...

    def evaluate(
        self,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        sample_ids: Sequence[Any],
    ) -> EvaluatorResult: ...


@functools.cache
def code_digest(cls: type) -> str:
    """``src:sha256:<16 hex>`` over the source of ``cls`` and its Tracks base classes."""
    digest = hashlib.sha256()
    for klass in cls.__mro__:
        if klass is cls or (klass.__module__.startswith("pipeline.") and klass is not Evaluator):
            digest.update(klass.__qualname__.encode())
            digest.update(inspect.getsource(klass).encode())
    return "src:sha256:" + digest.hexdigest()[:16]


class ClassifierEvaluator:
    """Shared machinery for evaluators of a classifier: batched argmax decoding, output frames.

    Subclasses set ``name`` and implement ``evaluate``; everything here is part of their
    ``version``, so a change to decoding changes every evaluator's version.
    """

    name: ClassVar[str]
    required: ClassVar[bool] = True
    judge_model: ClassVar[str] = NOT_APPLICABLE
    rubric_version: ClassVar[str] = NOT_APPLICABLE
    batch_size: ClassVar[int] = 256
    temperature: ClassVar[float] = 1.0
    failure_sample_size: ClassVar[int] = 25

    @property
    def version(self) -> str:
        return code_digest(type(self))

    @property
    def decoding_params(self) -> dict[str, Any]:
        return {
            "decision": "argmax",
            "temperature": self.temperature,
            "batch_size": self.batch_size,
        }

    def evaluate(
        self,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        sample_ids: Sequence[Any],
    ) -> EvaluatorResult:
        raise NotImplementedError

    def predict_proba(self, model: nn.Module, images: torch.Tensor) -> np.ndarray:
        """Class probabilities ``[N, C]`` (softmax of logits / temperature), in eval mode."""
        import torch

        model.eval()
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(images), self.batch_size):
                logits = model(images[start : start + self.batch_size].float())
                chunks.append(torch.softmax(logits / self.temperature, dim=1))
        return torch.cat(chunks).numpy().astype(np.float64)

    @staticmethod
    def outputs_frame(
        sample_ids: Sequence[Any], labels: np.ndarray, probabilities: np.ndarray
    ) -> pd.DataFrame:
        """One row per example: prediction, confidence, correctness and every probability."""
        import pandas as pd

        predictions = probabilities.argmax(axis=1)
        frame = pd.DataFrame(
            {
                "sample_id": list(sample_ids),
                "label": labels.astype(np.int64),
                "prediction": predictions.astype(np.int64),
                "confidence": probabilities.max(axis=1),
                "correct": predictions == labels,
            }
        )
        for k in range(probabilities.shape[1]):
            frame[f"prob_{k}"] = probabilities[:, k]
        return frame

    def sample_failures(self, outputs: pd.DataFrame) -> pd.DataFrame:
        """The most confident wrong predictions first: the ones worth a person's minute."""
        wrong = outputs[~outputs["correct"]]
        ordered = wrong.sort_values(
            ["confidence", "sample_id"], ascending=[False, True], kind="stable"
        )
        return ordered.head(self.failure_sample_size).reset_index(drop=True)

    @staticmethod
    def accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
        return float((labels == predictions).mean()) if len(labels) else float("nan")
