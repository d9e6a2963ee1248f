"""``nightly_retrain``: a new run per model family, each on the newest snapshot of that family
whose blocking checks passed."""

from collections.abc import Iterator

import dagster as dg

from assets.partitions import snapshot_partitions
from pipeline.settings import AutomationSettings
from sensors.canary import canary_job
from sensors.jobs import train_evaluate_promote

AUTOMATION = AutomationSettings.from_env()
BLOCKING_CHECKS = ("schema_contract", "data_quality")


def newest_checked_snapshots(instance: dg.DagsterInstance) -> dict[str, str]:
    """Per model family, the most recently registered snapshot whose blocking checks last
    passed (families with none are left out), in the order of ``FAMILIES``."""
    from pipeline.data.families import FAMILIES
    from pipeline.data.snapshot import family_of_snapshot
    from pipeline.ids import InvalidIdError

    found: dict[str, str] = {}
    for snapshot_id in _checked_newest_first(instance):
        try:
            family = family_of_snapshot(snapshot_id)
        except InvalidIdError:
            continue  # a partition key no trainer accepts: nothing to retrain on
        found.setdefault(family, snapshot_id)
    return {family: found[family] for family in FAMILIES if family in found}


def _checked_newest_first(instance: dg.DagsterInstance) -> Iterator[str]:
    """Snapshots whose blocking checks last passed, the most recently registered first."""
    from dagster._core.storage.asset_check_execution_record import (
        AssetCheckExecutionRecordStatus as Status,
    )

    latest: dict[str, dict[str, Status]] = {}
    partition_of_run: dict[str, str | None] = {}
    for name in BLOCKING_CHECKS:
        key = dg.AssetCheckKey(dg.AssetKey("data_snapshot"), name)
        for record in instance.event_log_storage.get_asset_check_execution_history(key, limit=500):
            if record.status == Status.PLANNED:
                continue
            # Checks declared with check_specs carry no partition on their record: the run's
            # partition tag says which snapshot was checked.
            if record.run_id not in partition_of_run:
                run = instance.get_run_by_id(record.run_id)
                # Canary snapshots exist to test the pipeline, never to retrain on.
                usable = run is not None and run.job_name != canary_job.name
                partition_of_run[record.run_id] = (
                    (record.partition or run.tags.get("dagster/partition")) if usable else None
                )
            partition = partition_of_run[record.run_id]
            if partition is not None:
                # History is newest first: the first record per partition is its latest.
                latest.setdefault(partition, {}).setdefault(name, record.status)
    for snapshot_id in reversed(instance.get_dynamic_partitions(snapshot_partitions.name)):
        statuses = latest.get(snapshot_id, {})
        if all(statuses.get(name) == Status.SUCCEEDED for name in BLOCKING_CHECKS):
            yield snapshot_id


@dg.schedule(
    name="nightly_retrain",
    job=train_evaluate_promote,
    cron_schedule=AUTOMATION.nightly_cron,
    # Stopped unless TRACKS_AUTOMATION=on, like new_snapshot: a nightly run costs every night.
    default_status=(
        dg.DefaultScheduleStatus.RUNNING
        if AUTOMATION.automation_on
        else dg.DefaultScheduleStatus.STOPPED
    ),
    description=(
        "Retrains each model family on its newest snapshot that passed its checks "
        "(purpose: scheduled)."
    ),
)
def nightly_retrain(
    context: dg.ScheduleEvaluationContext,
) -> list[dg.RunRequest] | dg.SkipReason:
    # One run per family: each family has its own champion to keep fresh, and the newest
    # snapshot of one family says nothing about the other's data.
    newest = newest_checked_snapshots(context.instance)
    if not newest:
        return dg.SkipReason("no snapshot has passed its blocking checks yet")
    scheduled_for = context.scheduled_execution_time
    stamp = scheduled_for.strftime("%Y-%m-%dT%H:%M") if scheduled_for else "now"
    return [
        dg.RunRequest(
            run_key=f"nightly:{stamp}:{family}",
            partition_key=snapshot_id,
            run_config={"ops": {"training_attempt": {"config": {"purpose": "scheduled"}}}},
            tags={"tracks/trigger": "nightly_retrain"},
        )
        for family, snapshot_id in newest.items()
    ]
