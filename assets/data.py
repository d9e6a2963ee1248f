"""``data_snapshot`` and its checks: the immutable, content-addressed input of every run."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg

from assets.partitions import snapshot_partitions
from resources import StorageResource

SCHEMA_CONTRACT = "schema_contract"
DATA_QUALITY = "data_quality"
DRIFT_VS_PREVIOUS = "drift_vs_previous"


class SnapshotConfig(dg.Config):
    landing_dir: str | None = None
    """Folder of landing Parquet files; defaults to the deployment's landing folder."""


def _check_result(name: str, outcome: Any, severity: dg.AssetCheckSeverity) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=name,
        passed=outcome.passed,
        severity=severity,
        description=outcome.summary,
        metadata={
            "summary": dg.MetadataValue.text(outcome.summary),
            "failures": dg.MetadataValue.json([f.to_dict() for f in outcome.failures]),
        },
    )


def _previous_snapshot_frame(storage: StorageResource, current_id: str) -> Any:
    from pipeline.data.snapshot import list_snapshots, read_snapshot_frame

    # Drift only warns: an unreadable older snapshot must not fail this one, so no verification.
    previous = [s for s in list_snapshots(storage.snapshots()) if s.snapshot_id != current_id]
    if not previous:
        return None
    return read_snapshot_frame(previous[-1], verify=False)


@dg.asset(
    partitions_def=snapshot_partitions,
    group_name="data",
    kinds={"parquet"},
    description="An immutable, content-addressed copy of the landing files with manifest.json.",
    check_specs=[
        dg.AssetCheckSpec(
            SCHEMA_CONTRACT,
            asset="data_snapshot",
            blocking=True,
            description="pandera contract: exact columns, dtypes, label 0..9, pixels 0..16.",
        ),
        dg.AssetCheckSpec(
            DATA_QUALITY,
            asset="data_snapshot",
            blocking=True,
            description="great-expectations suite: ranges, nulls, label set and balance.",
        ),
        dg.AssetCheckSpec(
            DRIFT_VS_PREVIOUS,
            asset="data_snapshot",
            description="Label distribution and pixel means against the previous snapshot (warns).",
        ),
    ],
)
def data_snapshot(
    context: dg.AssetExecutionContext, config: SnapshotConfig, storage: StorageResource
) -> Iterator[dg.MaterializeResult | dg.AssetCheckResult]:
    from pipeline.data.contract import check_schema_contract
    from pipeline.data.drift import drift_vs_previous
    from pipeline.data.quality import check_data_quality
    from pipeline.data.snapshot import create_snapshot, read_snapshot_frame

    landing = Path(config.landing_dir) if config.landing_dir else storage.landing()
    snapshot = create_snapshot(
        landing, storage.snapshots(), expected_id=context.partition_key, source=str(landing)
    )
    frame = read_snapshot_frame(snapshot)
    manifest = snapshot.manifest
    yield dg.MaterializeResult(
        metadata={
            "snapshot_id": snapshot.snapshot_id,
            "path": dg.MetadataValue.path(str(snapshot.path)),
            "manifest_sha256": snapshot.manifest_sha256,
            "dagster/row_count": snapshot.row_count,
            "files": dg.MetadataValue.md(
                "\n".join(
                    ["| file | bytes | rows | sha256 |", "|---|---:|---:|---|"]
                    + [
                        f"| {f['name']} | {f['bytes']} | {f['rows']} | `{f['sha256'][:16]}` |"
                        for f in manifest["files"]
                    ]
                )
            ),
            "dagster/column_schema": dg.TableSchema(
                columns=[dg.TableColumn(c["name"], c["dtype"]) for c in manifest["columns"]]
            ),
        },
        data_version=dg.DataVersion(snapshot.manifest_sha256),
    )
    yield _check_result(SCHEMA_CONTRACT, check_schema_contract(frame), dg.AssetCheckSeverity.ERROR)
    yield _check_result(DATA_QUALITY, check_data_quality(frame), dg.AssetCheckSeverity.ERROR)
    previous = _previous_snapshot_frame(storage, snapshot.snapshot_id)
    yield _check_result(
        DRIFT_VS_PREVIOUS, drift_vs_previous(frame, previous), dg.AssetCheckSeverity.WARN
    )
