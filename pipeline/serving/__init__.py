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
TEXT_MODEL_CODE_PATH = Path(__file__).with_name("textlm_model.py")


def model_code_path(family: str) -> Path:
    """The models-from-code file of ``family``'s served model."""
    from pipeline.data.families import TEXT

    return TEXT_MODEL_CODE_PATH if family == TEXT else MODEL_CODE_PATH


__all__ = [
    "MODEL_CODE_PATH",
    "TEXT_MODEL_CODE_PATH",
    "CommittedCheckpoint",
    "UnreadableCheckpointError",
    "load_committed_checkpoint",
    "load_model_from_files",
    "model_code_path",
    "model_from_state",
    "open_committed_checkpoint",
]
