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


def _cursors(cursor: str | None) -> dict[str, str]:
    """Each family's last fingerprint. A cursor written before text existed is the digits'
    fingerprint itself (a JSON list), so upgrading never re-registers the digits' landing."""
    from pipeline.data.families import DIGITS

    if not cursor:
        return {}
    try:
        parsed = json.loads(cursor)
    except ValueError:
        return {}
    if isinstance(parsed, dict):
        return {str(k): str(v) for k, v in parsed.items()}
    return {DIGITS: cursor}


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
        "Registers a data_snapshot partition when a family's landing files change (the digits' "
        "landing root, text's landing/text-lm) and runs the graph on it; the blocking checks "
        "stop the run before training when the data is bad."
    ),
)
def new_snapshot(
    context: dg.SensorEvaluationContext, storage: StorageResource
) -> dg.SensorResult | dg.SkipReason:
    import time

    from pipeline.data.families import FAMILIES, landing_dir_for
    from pipeline.data.landing import landing_files
    from pipeline.data.snapshot import snapshot_id_for

    cursors = _cursors(context.cursor)
    requests: list[dg.RunRequest] = []
    added: list[str] = []
    skipped: list[str] = []
    for family in FAMILIES:
        landing = landing_dir_for(storage.landing(), family)
        files = landing_files(landing) if landing.exists() else []
        if not files:
            skipped.append(f"no landing files in {landing}")
            continue
        newest = max(f.stat().st_mtime for f in files)
        if time.time() - newest < AUTOMATION.landing_settle_seconds:
            skipped.append(
                f"landing files in {landing} changed just now; waiting for them to settle"
            )
            continue
        fingerprint = _fingerprint(files)
        if fingerprint == cursors.get(family):
            skipped.append(f"landing files in {landing} unchanged")
            continue
        cursors[family] = fingerprint
        snapshot_id = snapshot_id_for(landing, family=family)
        if context.instance.has_dynamic_partition(snapshot_partitions.name, snapshot_id):
            skipped.append(f"snapshot {snapshot_id} is already registered")
            continue
        context.log.info(f"new snapshot {snapshot_id} from {len(files)} landing file(s)")
        added.append(snapshot_id)
        requests.append(
            dg.RunRequest(
                run_key=snapshot_id,
                partition_key=snapshot_id,
                run_config={},
                tags={"tracks/trigger": "new_snapshot"},
            )
        )
    cursor = json.dumps(cursors, sort_keys=True)
    skip_message = "; ".join(skipped)
    if not requests:
        if cursor == (context.cursor or json.dumps({})):
            return dg.SkipReason(skip_message)
        return dg.SensorResult(skip_reason=dg.SkipReason(skip_message), cursor=cursor)
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[snapshot_partitions.build_add_request(added)],
        cursor=cursor,
    )
