"""The served text-lm model (prompt -> continuation), logged with MLflow "models from code".

MLflow copies this file into the model and runs it at load time; the weights travel as the
``weights`` (safetensors) and ``trainer_state`` (JSON) artifacts, as for the digits model.
Nothing is pickled. Loading needs the Tracks package (``pipeline``) importable.
"""

from __future__ import annotations

from typing import Any

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

from pipeline.serving.loading import load_model_from_files
from pipeline.serving.signature import PROMPT_COLUMN


class TextContinuation(PythonModel):
    """The greedy continuation of each row's ``prompt`` (``max_new_tokens``, default 64)."""

    def load_context(self, context: Any) -> None:
        self._model = load_model_from_files(
            context.artifacts["weights"], context.artifacts["trainer_state"]
        )

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> list[str]:
        from pipeline.serving.champion import continue_prompts

        if isinstance(model_input, pd.DataFrame):
            if PROMPT_COLUMN not in model_input.columns:
                raise ValueError(f"input has no {PROMPT_COLUMN!r} column")
            prompts = [str(p) for p in model_input[PROMPT_COLUMN]]
        else:
            prompts = [str(p) for p in model_input]
        max_new_tokens = int((params or {}).get("max_new_tokens", 64))
        return continue_prompts(self._model, prompts, max_new_tokens=max_new_tokens)


mlflow.models.set_model(TextContinuation())
