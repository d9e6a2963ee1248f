"""Jobs over the asset graph, and launching them for one snapshot from a shell."""

from __future__ import annotations

from typing import Any

import dagster as dg

from assets.partitions import ASSET_GROUP, snapshot_partitions

train_evaluate_promote = dg.define_asset_job(
    "train_evaluate_promote",
    # Partitioned by snapshot through its assets (Dagster infers it; naming it is deprecated).
    selection=dg.AssetSelection.groups(ASSET_GROUP),
    description="Snapshot → checks → train → committed checkpoint → evaluate → promote.",
)


def materialize_snapshot(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    snapshot_id: str,
    *,
    run_config: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
) -> dg.ExecuteInProcessResult:
    """Register ``snapshot_id`` as a partition and run the whole graph for it in ``instance``.

    This is what ``tracks demo`` does; the Dagster UI and the sensors do the same through the
    daemon. The run is a normal Dagster run: it shows up in the UI with its event log.
    """
    if not instance.has_dynamic_partition(snapshot_partitions.name, snapshot_id):
        instance.add_dynamic_partitions(snapshot_partitions.name, [snapshot_id])
    job = defs.resolve_job_def(train_evaluate_promote.name)
    return job.execute_in_process(
        instance=instance,
        partition_key=snapshot_id,
        run_config=run_config or {},
        tags=tags,
        raise_on_error=False,
    )
