"""The data layer: landing files, content-addressed snapshots, checks and training tensors.

Heavy libraries are imported where they are used (great-expectations in
``check_data_quality``, torch in ``split_tensors``), so importing this package stays quick.
"""

from pipeline.data.checks import CheckFailure, CheckOutcome
from pipeline.data.columns import COLUMNS, LABEL, PIXEL_COLUMNS, SAMPLE_ID, SPLIT, SPLITS
from pipeline.data.contract import CONTRACT_CHECK, DigitsContract, check_schema_contract
from pipeline.data.dataset import eval_task_set_version, split_tensors
from pipeline.data.drift import DRIFT_CHECK, drift_vs_previous
from pipeline.data.errors import (
    DataError,
    EmptySplitError,
    LandingChangedError,
    MissingColumnError,
    NoLandingFilesError,
    SnapshotIntegrityError,
    SnapshotMismatchError,
    SnapshotNotFoundError,
    UnknownSplitError,
)
from pipeline.data.landing import Drift, landing_files, write_digits_landing
from pipeline.data.quality import QUALITY_CHECK, check_data_quality
from pipeline.data.snapshot import (
    LandingFile,
    Snapshot,
    create_snapshot,
    describe_landing,
    list_snapshots,
    open_snapshot,
    read_snapshot_frame,
    snapshot_id_for,
    verify_snapshot,
)

__all__ = [
    "COLUMNS",
    "CONTRACT_CHECK",
    "DRIFT_CHECK",
    "LABEL",
    "PIXEL_COLUMNS",
    "QUALITY_CHECK",
    "SAMPLE_ID",
    "SPLIT",
    "SPLITS",
    "CheckFailure",
    "CheckOutcome",
    "DataError",
    "DigitsContract",
    "Drift",
    "EmptySplitError",
    "LandingChangedError",
    "LandingFile",
    "MissingColumnError",
    "NoLandingFilesError",
    "Snapshot",
    "SnapshotIntegrityError",
    "SnapshotMismatchError",
    "SnapshotNotFoundError",
    "UnknownSplitError",
    "check_data_quality",
    "check_schema_contract",
    "create_snapshot",
    "describe_landing",
    "drift_vs_previous",
    "eval_task_set_version",
    "landing_files",
    "list_snapshots",
    "open_snapshot",
    "read_snapshot_frame",
    "snapshot_id_for",
    "split_tensors",
    "verify_snapshot",
    "write_digits_landing",
]
