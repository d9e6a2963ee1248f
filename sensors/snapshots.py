"""``new_snapshot``: new landing data becomes a snapshot partition and a training run."""

import json
from pathlib import Path

import dagster as dg

from assets.partitions import snapshot_partitions
from pipeline.settings import AutomationSettings
from resources import StorageResource
from sensors.jobs import train_evaluate_promote

AUTOMATION = AutomationSettings.from_env()


def _fingerprint(files: list[Path]) -> str:
    # Names, sizes and mtimes: cheap to compare each tick; content is hashed only on change.
    return json.dumps([[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files])


@dg.sensor(
    name="new_snapshot",
    job=train_evaluate_promote,
    minimum_interval_seconds=AUTOMATION.new_snapshot_interval_seconds,
    # Stopped unless TRACKS_AUTOMATION=on: it starts training runs (CPU or GPU hours) on
    # every new landing file, which a deployment chooses and a new user should not discover.
    default_status=(
        dg.DefaultSensorStatus.RUNNING
        if AUTOMATION.automation_on
        else dg.DefaultSensorStatus.STOPPED
    ),
    description=(
        "Registers a data_snapshot partition when the landing files change and runs the graph on "
        "it; the blocking checks stop the run before training when the data is bad."
    ),
)
def new_snapshot(
    context: dg.SensorEvaluationContext, storage: StorageResource
) -> dg.SensorResult | dg.SkipReason:
    import time

    from pipeline.data.landing import landing_files
    from pipeline.data.snapshot import snapshot_id_for

    landing = storage.landing()
    files = landing_files(landing) if landing.exists() else []
    if not files:
        return dg.SkipReason(f"no landing files in {landing}")
    newest = max(f.stat().st_mtime for f in files)
    if time.time() - newest < AUTOMATION.landing_settle_seconds:
        return dg.SkipReason(
            f"landing files in {landing} changed just now; waiting for them to settle"
        )
    fingerprint = _fingerprint(files)
    if fingerprint == context.cursor:
        return dg.SkipReason("landing files unchanged")
    snapshot_id = snapshot_id_for(landing)
    if context.instance.has_dynamic_partition(snapshot_partitions.name, snapshot_id):
        return dg.SensorResult(
            skip_reason=dg.SkipReason(f"snapshot {snapshot_id} is already registered"),
            cursor=fingerprint,
        )
    context.log.info(f"new snapshot {snapshot_id} from {len(files)} landing file(s)")
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(
                run_key=snapshot_id,
                partition_key=snapshot_id,
                tags={"tracks/trigger": "new_snapshot"},
            )
        ],
        dynamic_partitions_requests=[snapshot_partitions.build_add_request([snapshot_id])],
        cursor=fingerprint,
    )
