"""The served digits classifier, logged with MLflow "models from code".

MLflow copies this file into the model and runs it at load time; the weights travel as the
``weights`` (safetensors) and ``trainer_state`` (JSON) artifacts. Nothing is pickled. Loading
needs the Tracks package (``pipeline``) importable, as it is in the Tracks image.
"""

from __future__ import annotations

from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from pipeline.serving.loading import PIXEL_COLUMNS, PIXEL_MAX, load_model_from_files


class DigitsClassifier(PythonModel):
    """Predicts a digit label for each row of 64 pixels (``px_00``..``px_63``, values 0..16)."""

    def load_context(self, context: Any) -> None:
        self._model = load_model_from_files(
            context.artifacts["weights"], context.artifacts["trainer_state"]
        )

    # Through pyfunc, MLflow first enforces the logged signature (pipeline/serving/signature.py):
    # a DataFrame with the 64 integer pixel columns. The ndarray path (rows of 64 pixels, or
    # [N, 8, 8] images) serves callers of this class itself.
    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> np.ndarray:
        import torch

        pixels = _pixels(model_input)
        images = torch.from_numpy(pixels / PIXEL_MAX).reshape(-1, 1, 8, 8)
        with torch.inference_mode():
            logits = self._model(images)
        return logits.argmax(dim=1).numpy().astype(np.int64)


def _pixels(model_input: Any) -> np.ndarray:
    if isinstance(model_input, pd.DataFrame):
        missing = [c for c in PIXEL_COLUMNS if c not in model_input.columns]
        if missing:
            raise ValueError(f"input is missing pixel columns {', '.join(missing[:5])}")
        array = model_input[PIXEL_COLUMNS].to_numpy()
    else:
        array = np.asarray(model_input)
    array = array.astype(np.float32, copy=False)
    if array.size % 64 != 0:
        raise ValueError(f"input of shape {array.shape} is not rows of 64 pixels")
    return array.reshape(-1, 64)


mlflow.models.set_model(DigitsClassifier())
