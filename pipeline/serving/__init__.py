"""The served model: a committed checkpoint as an MLflow pyfunc, logged from code, never pickled."""

from pathlib import Path

from pipeline.serving.loading import (
    CommittedCheckpoint,
    UnreadableCheckpointError,
    load_committed_checkpoint,
    load_model_from_files,
    model_from_state,
    open_committed_checkpoint,
)

# The models-from-code file MLflow copies into every logged model (``python_model=`` this path).
MODEL_CODE_PATH = Path(__file__).with_name("digits_model.py")

__all__ = [
    "MODEL_CODE_PATH",
    "CommittedCheckpoint",
    "UnreadableCheckpointError",
    "load_committed_checkpoint",
    "load_model_from_files",
    "model_from_state",
    "open_committed_checkpoint",
]
