"""The checkpoint protocol: files, MANIFEST.json, COMMITTED last; verify before load; no pickle.

See docs/checkpoints.md, "The directory protocol". :class:`CheckpointManager` owns every
save, resume and retention decision; the functions below are its parts, usable on their own
(evaluators call :func:`verify_checkpoint` and :func:`load_checkpoint`).
"""

from pipeline.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    RestoreDivergedError,
    UnsafeCheckpointError,
)
from pipeline.checkpoint.layout import (
    COMMITTED_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    TRAINER_STATE_FILE,
    checkpoint_dir_name,
    parse_checkpoint_dir_name,
)
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manager import CheckpointConfig, CheckpointManager, validate_probe
from pipeline.checkpoint.state import (
    RNGState,
    StagedCheckpoint,
    Stateful,
    TrainingState,
    stage_checkpoint,
)
from pipeline.checkpoint.verify import (
    CheckpointContents,
    CheckpointInfo,
    checkpoint_dirs,
    is_committed,
    refuse_pickle,
    verify_checkpoint,
)
from pipeline.checkpoint.writer import (
    WrittenCheckpoint,
    commit_checkpoint_dir,
    write_checkpoint_files,
)

__all__ = [
    "COMMITTED_FILE",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "PROBE_FILE",
    "TRAINER_STATE_FILE",
    "CheckpointConfig",
    "CheckpointContents",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "RNGState",
    "RestoreDivergedError",
    "StagedCheckpoint",
    "Stateful",
    "TrainingState",
    "UnsafeCheckpointError",
    "WrittenCheckpoint",
    "checkpoint_dir_name",
    "checkpoint_dirs",
    "commit_checkpoint_dir",
    "is_committed",
    "load_checkpoint",
    "parse_checkpoint_dir_name",
    "refuse_pickle",
    "stage_checkpoint",
    "validate_probe",
    "verify_checkpoint",
    "write_checkpoint_files",
]
