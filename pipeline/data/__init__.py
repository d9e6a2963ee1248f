"""The data layer: landing files, content-addressed snapshots, checks and training tensors.

Importing this package loads none of its modules: each name below is imported from its module
on first use. A trainer that only opens and reads a snapshot so loads neither pandera,
great-expectations nor the drift and landing code (measured: 0.45 CPU-seconds of a trainer's
start-up); heavy libraries inside the modules are imported where they are used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from pipeline.data.families import (
        DEFAULT_FAMILY,
        FAMILIES,
        UnknownFamilyError,
        landing_dir_for,
    )
    from pipeline.data.landing import Drift, landing_files, write_digits_landing
    from pipeline.data.quality import QUALITY_CHECK, check_data_quality
    from pipeline.data.snapshot import (
        LandingFile,
        Snapshot,
        create_snapshot,
        describe_landing,
        family_of_snapshot,
        list_snapshots,
        open_snapshot,
        read_snapshot_frame,
        snapshot_id_for,
        verify_snapshot,
    )

# Each exported name and the module that defines it.
_HOME = {
    **dict.fromkeys(("CheckFailure", "CheckOutcome"), "checks"),
    **dict.fromkeys(
        ("COLUMNS", "LABEL", "PIXEL_COLUMNS", "SAMPLE_ID", "SPLIT", "SPLITS"), "columns"
    ),
    **dict.fromkeys(("CONTRACT_CHECK", "DigitsContract", "check_schema_contract"), "contract"),
    **dict.fromkeys(("eval_task_set_version", "split_tensors"), "dataset"),
    **dict.fromkeys(("DRIFT_CHECK", "drift_vs_previous"), "drift"),
    **dict.fromkeys(
        (
            "DataError",
            "EmptySplitError",
            "LandingChangedError",
            "MissingColumnError",
            "NoLandingFilesError",
            "SnapshotIntegrityError",
            "SnapshotMismatchError",
            "SnapshotNotFoundError",
            "UnknownSplitError",
        ),
        "errors",
    ),
    **dict.fromkeys(
        ("DEFAULT_FAMILY", "FAMILIES", "UnknownFamilyError", "landing_dir_for"), "families"
    ),
    **dict.fromkeys(("Drift", "landing_files", "write_digits_landing"), "landing"),
    **dict.fromkeys(("QUALITY_CHECK", "check_data_quality"), "quality"),
    **dict.fromkeys(
        (
            "LandingFile",
            "Snapshot",
            "create_snapshot",
            "describe_landing",
            "family_of_snapshot",
            "list_snapshots",
            "open_snapshot",
            "read_snapshot_frame",
            "snapshot_id_for",
            "verify_snapshot",
        ),
        "snapshot",
    ),
}

__all__ = [
    "COLUMNS",
    "CONTRACT_CHECK",
    "DEFAULT_FAMILY",
    "DRIFT_CHECK",
    "FAMILIES",
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
    "UnknownFamilyError",
    "UnknownSplitError",
    "check_data_quality",
    "check_schema_contract",
    "create_snapshot",
    "describe_landing",
    "drift_vs_previous",
    "eval_task_set_version",
    "family_of_snapshot",
    "landing_dir_for",
    "landing_files",
    "list_snapshots",
    "open_snapshot",
    "read_snapshot_frame",
    "snapshot_id_for",
    "split_tensors",
    "verify_snapshot",
    "write_digits_landing",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'pipeline.data' has no attribute {name!r}")
    value = getattr(import_module(f"pipeline.data.{home}"), name)
    globals()[name] = value  # found once; later lookups never come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
