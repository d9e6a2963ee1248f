"""``data_snapshot`` and its checks: the immutable, content-addressed input of every run."""

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from assets.partitions import ASSET_GROUP, snapshot_partitions
from assets.tables import table
from resources import LedgerResource, StorageResource

SCHEMA_CONTRACT = "schema_contract"
DATA_QUALITY = "data_quality"
DRIFT_VS_PREVIOUS = "drift_vs_previous"
LANDING_FILES = "landing_files"


def landing_files_spec(landing_root: Path) -> dg.AssetSpec:
    """The landing folder's Parquet files: what ``data_snapshot`` copies. Tracks reads them and
    never writes them (``tracks landing`` and upstream systems do), so they are an external
    asset: drawn in the graph, upstream of data_snapshot, never materialized by Dagster."""
    return dg.AssetSpec(
        LANDING_FILES,
        group_name=ASSET_GROUP,
        kinds={"parquet"},
        description=(
            "Parquet files dropped into the landing folder (`tracks landing`, upstream "
            "systems); data_snapshot copies them, as they are, into an immutable snapshot."
        ),
        metadata={"landing_folder": dg.MetadataValue.path(str(landing_root))},
    )


class SnapshotConfig(dg.Config):
    landing_dir: str | None = None
    """Folder of landing Parquet files; defaults to the family's landing folder (the landing
    root for ``digits-…`` partitions, ``<landing root>/text-lm`` for ``text-…``)."""


def _check_result(
    name: str, outcome: Any, severity: dg.AssetCheckSeverity, **extra: Any
) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=name,
        passed=outcome.passed,
        severity=severity,
        description=outcome.summary,
        metadata={
            "summary": dg.MetadataValue.text(outcome.summary),
            "failures": dg.MetadataValue.json([f.to_dict() for f in outcome.failures]),
            **extra,
        },
    )


def files_table(files: Sequence[Mapping[str, Any]]) -> dg.TableMetadataValue:
    """One row per file of a snapshot's manifest: its name, size, rows and digest."""
    columns = [
        dg.TableColumn("name", "string", "file name inside the snapshot's data folder"),
        dg.TableColumn("bytes", "int"),
        dg.TableColumn("rows", "int"),
        dg.TableColumn("sha256", "string", "SHA-256 of the file's bytes"),
    ]
    rows = [{c.name: f[c.name] for c in columns} for f in files]
    return table("files", columns, rows)


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=[LANDING_FILES],
    group_name=ASSET_GROUP,
    kinds={"parquet"},
    description=(
        "An immutable, content-addressed copy of the landing files with manifest.json. The "
        "partition's prefix names the model family: digits-… (landing root), text-… "
        "(landing root/text-lm); each family runs its own checks under the same names."
    ),
    check_specs=[
        dg.AssetCheckSpec(
            SCHEMA_CONTRACT,
            asset="data_snapshot",
            blocking=True,
            description=(
                "pandera contract. digits: exact columns, dtypes, label 0..9, pixels 0..16; "
                "text: doc_id unique, text non-empty valid UTF-8 of 1..8192 characters, no "
                "document in both splits."
            ),
        ),
        dg.AssetCheckSpec(
            DATA_QUALITY,
            asset="data_snapshot",
            blocking=True,
            description=(
                "great-expectations suite. digits: ranges, nulls, label set and balance; "
                "text: columns, nulls, unique ids, split set and eval share, lengths."
            ),
        ),
        dg.AssetCheckSpec(
            DRIFT_VS_PREVIOUS,
            asset="data_snapshot",
            description=(
                "Against the previous passing snapshot of the same family (warns). digits: "
                "label distribution and pixel means; text: byte Jensen-Shannon distance."
            ),
        ),
    ],
)
def data_snapshot(
    context: dg.AssetExecutionContext,
    config: SnapshotConfig,
    storage: StorageResource,
    ledger: LedgerResource,
) -> Iterator[dg.MaterializeResult | dg.AssetCheckResult]:
    from pipeline.data.families import landing_dir_for
    from pipeline.data.gate import (
        CheckVerdict,
        blocking_outcomes,
        content_sha256,
        drift_baseline,
        drift_outcome,
        read_check_frame,
        record_verdict,
    )
    from pipeline.data.snapshot import create_snapshot, family_of_snapshot

    # The partition key names the family (its prefix): nothing else in run config does.
    family = family_of_snapshot(context.partition_key)
    if config.landing_dir:
        landing = Path(config.landing_dir)
    else:
        landing = landing_dir_for(storage.landing(), family)
    snapshot = create_snapshot(
        landing,
        storage.snapshots(),
        family=family,
        expected_id=context.partition_key,
        source=str(landing),
    )
    frame = read_check_frame(snapshot)
    manifest = snapshot.manifest
    yield dg.MaterializeResult(
        metadata={
            "snapshot_id": snapshot.snapshot_id,
            "family": snapshot.family,
            "path": dg.MetadataValue.path(str(snapshot.path)),
            "manifest_sha256": snapshot.manifest_sha256,
            "content_sha256": content_sha256(snapshot),
            "dagster/row_count": snapshot.row_count,
            "files": files_table(manifest["files"]),
            "dagster/column_schema": dg.TableSchema(
                columns=[dg.TableColumn(c["name"], c["dtype"]) for c in manifest["columns"]]
            ),
        },
        data_version=dg.DataVersion(snapshot.manifest_sha256),
    )
    book = ledger.ledger()
    contract, quality = blocking_outcomes(snapshot, frame)
    baseline = drift_baseline(snapshot, snapshot_root=storage.snapshots(), ledger=book)
    # Drift only warns: an unreadable baseline must not fail this one, so no verification.
    drift = drift_outcome(
        snapshot, frame, read_check_frame(baseline, verify=False) if baseline else None
    )
    # The verdict is recorded for this exact manifest before the results are yielded: every
    # path that trains (this run's, a later one's, the trainer CLI's) requires it.
    record_verdict(
        snapshot,
        [
            CheckVerdict.of(contract, blocking=True),
            CheckVerdict.of(quality, blocking=True),
            CheckVerdict.of(drift, blocking=False),
        ],
        snapshot_root=storage.snapshots(),
        ledger=book,
        dagster_run_id=context.run_id,
    )
    yield _check_result(SCHEMA_CONTRACT, contract, dg.AssetCheckSeverity.ERROR)
    yield _check_result(DATA_QUALITY, quality, dg.AssetCheckSeverity.ERROR)
    # Named, so a person reading the warning knows what it was compared with.
    yield _check_result(
        DRIFT_VS_PREVIOUS,
        drift,
        dg.AssetCheckSeverity.WARN,
        baseline_snapshot_id=baseline.snapshot_id if baseline else "none (first passing snapshot)",
        baseline_manifest_sha256=baseline.manifest_sha256 if baseline else "none",
    )
