"""``resume_after_preemption``: continue a run from its last committed checkpoint, by itself.

Reads the ledger each tick (docs/architecture.md, "Platform facts": run-failure sensors miss
events).
The retry decision on the ended attempt says whether to continue; the run key makes each
continuation happen once; Dagster's own run retries stay off, so this sensor is the one owner.
A continuation the Dagster run that ran the ended attempt may still open itself (continuing in
place, assets/training.py) is left to that run while it is not finished; so is the ending of a
silent attempt, which that run's step sees directly. Both claims are bounded.
"""

import copy
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import dagster as dg

from assets.launch import CONTINUATION_TAG, TRAINER_CONFIG_FROM_TAG
from assets.partitions import snapshot_partitions
from pipeline import redact
from pipeline.launch_facts import RESUME_SENSOR_NAME
from pipeline.settings import AutomationSettings, TracksSettings
from resources import LedgerResource, StorageResource

if TYPE_CHECKING:
    from pipeline.continuation import Continuation, HostingRun
    from pipeline.ledger import AttemptRecord, Ledger

AUTOMATION = AutomationSettings.from_env()

CONTINUATION_ASSETS = [
    dg.AssetKey("training_attempt"),
    dg.AssetKey("committed_checkpoint"),
    dg.AssetKey("evaluation"),
    dg.AssetKey("promoted_model"),
]


MAX_RELAUNCHES = 3
SENSOR_NAME = RESUME_SENSOR_NAME


class ContinuationRefusedError(Exception):
    """A continuation that would not run the way the attempt it continues ran."""


def _run_key(instance: dg.DagsterInstance, key: str) -> str | None:
    """The run key for this continuation, or None when relaunching has been given up.

    A Dagster run that dies before it opens the attempt (its process failed to start, the code
    location failed to load) leaves the ledger unchanged: the same continuation is still due,
    under a fresh key, a bounded number of times (one a person terminated stops the run
    instead: :func:`_stopped_by_termination`). Only the runs this sensor launched count
    (Dagster's daemon tags them with its name): a run a person tagged with the continuation's
    key does not use up its relaunches.
    """
    tags = {CONTINUATION_TAG: key, "dagster/sensor_name": SENSOR_NAME}
    runs = instance.get_runs(filters=dg.RunsFilter(tags=tags))
    if not runs or any(not r.is_finished for r in runs):
        return key
    if len(runs) >= MAX_RELAUNCHES:
        return None
    return f"{key}#relaunch-{len(runs)}"


@dg.sensor(
    name=SENSOR_NAME,
    minimum_interval_seconds=AUTOMATION.resume_interval_seconds,
    # On for everyone, TRACKS_AUTOMATION or not: it starts no work of its own, only finishes
    # what a person or a sensor already launched. A preempted run that nobody resumes holds
    # a half-trained model and a checkpoint that ages; the retry budget bounds what this sensor
    # may spend, and Dagster's run retries are off so that it is the one owner of a failure.
    # Stopped in the UI, it catches up when started again: the ledger remembers what is due.
    default_status=dg.DefaultSensorStatus.RUNNING,
    asset_selection=CONTINUATION_ASSETS,
    description=(
        "Resumes runs whose last attempt was preempted, timed out, hung or hit a transient fault, "
        "within their retry budget; closes attempts whose heartbeat went silent."
    ),
)
def resume_after_preemption(
    context: dg.SensorEvaluationContext, ledger: LedgerResource, storage: StorageResource
) -> dg.SensorResult | dg.SkipReason:
    from pipeline.continuation import expire_silent_attempts, pending_continuations

    book = ledger.ledger()
    for attempt in expire_silent_attempts(
        book,
        AUTOMATION.heartbeat_timeout_seconds,
        checkpoint_root=storage.checkpoints(),
        # The deployment's MLflow (the sensor has no MLflow resource): the MLflow run of an
        # attempt closed here must not stay RUNNING.
        tracking_uri=TracksSettings.from_env().mlflow_tracking_uri,
        on_warning=context.log.warning,
        hosting_run=lambda attempt: _hosting_run_of_silent(context, attempt, datetime.now(UTC)),
    ):
        context.log.warning(
            f"attempt {attempt.key} went silent: {attempt.termination_detail} "
            f"Decision: {(attempt.retry_decision or {}).get('reason')}"
        )
    now = datetime.now(UTC)  # after the closes above: a continuation due now is not "later"
    requests: list[dg.RunRequest] = []
    new_partitions: list[str] = []

    def not_launched(run_key: str, why: str) -> None:
        context.log.error(f"{run_key}: not launched: {redact.text(why)}")

    for c in pending_continuations(book, on_skip=not_launched):
        # Each continuation on its own: one that cannot be launched is logged with its reason
        # and the others still go out on this tick.
        try:
            hosting = _hosting_run(context.instance, c.ended)  # read once, for every rule below
            if _stopped_by_termination(context, book, c, hosting):
                continue
            request = _request_for(context, storage, c, hosting, now, new_partitions)
        except ContinuationRefusedError as exc:
            not_launched(c.run_key, str(exc))
            continue
        except Exception as exc:
            said = redact.text(f"{type(exc).__name__}: {exc}")
            context.log.error(f"{c.run_key}: not launched this tick: {said}")
            continue
        if request is not None:
            requests.append(request)
    if not requests:
        return dg.SkipReason("no run is waiting to be resumed")
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=(
            [snapshot_partitions.build_add_request(new_partitions)] if new_partitions else []
        ),
    )


def _stopped_by_termination(
    context: dg.SensorEvaluationContext,
    book: "Ledger",
    c: "Continuation",
    hosting: dg.DagsterRun | None,
) -> bool:
    """Whether a person terminated the run's continuation: then the run stops, as a step that
    saw the termination would have stopped it, and nothing is launched.

    Two Dagster runs can be terminated with the continuing decision still standing. The run
    that ran the ended attempt, when the termination landed in its step after the attempt ended
    (while it decides whether to continue in place, or between two lines it did not guard). And
    a continuation this sensor launched, terminated before it opened the next attempt (while
    queued or starting): a relaunch would undo that person's decision, which is not a run that
    died on its own. Either is finished, so no later tick would hold the continuation back.
    """
    from pipeline.attempts import stop_after_termination

    if hosting is not None and hosting.status is dg.DagsterRunStatus.CANCELED:
        terminated = hosting.run_id
        when = (
            f"after attempt {c.ended.key} ended and before the run was continued (the resume "
            f"sensor found that Dagster run {hosting.status.value})"
        )
    else:
        launched = context.instance.get_runs(
            filters=dg.RunsFilter(
                tags={CONTINUATION_TAG: c.run_key, "dagster/sensor_name": SENSOR_NAME},
                statuses=[dg.DagsterRunStatus.CANCELED],
            ),
            limit=1,
        )
        if not launched:
            return False
        terminated = launched[0].run_id
        when = (
            f"(the resume sensor's continuation of attempt {c.ended.key}) before it opened "
            f"attempt {c.next_attempt_no}"
        )
    stopped = stop_after_termination(book, c.run.run_id, c.ended.attempt_no, terminated, when=when)
    context.log.warning(
        f"{c.run_key}: not launched: {(stopped.retry_decision or {}).get('reason')}"
    )
    return True


def _request_for(
    context: dg.SensorEvaluationContext,
    storage: StorageResource,
    c: "Continuation",
    hosting: dg.DagsterRun | None,
    now: datetime,
    new_partitions: list[str],
) -> dg.RunRequest | None:
    from pipeline import ids

    if _left_to_hosting_run(context, c, hosting, now):
        return None
    if c.not_before > now:
        context.log.info(f"{c.run_key}: backing off until {c.not_before:%H:%M:%S}")
        return None
    snapshot_id = ids.snapshot_id(c.run.snapshot_id)
    if not context.instance.has_dynamic_partition(snapshot_partitions.name, snapshot_id):
        # A run started from the trainer CLI: its snapshot is in the store but was never a
        # Dagster partition. Add it, rather than fail the tick for every other continuation.
        if not (storage.snapshots() / snapshot_id / "manifest.json").is_file():
            raise LookupError(
                f"snapshot {snapshot_id} of run {c.run.run_id} is neither a data_snapshot "
                f"partition nor in the snapshot store {storage.snapshots()}"
            )
        if snapshot_id not in new_partitions:
            new_partitions.append(snapshot_id)
    run_key = _run_key(context.instance, c.run_key)
    if run_key is None:
        context.log.error(
            f"{c.run_key}: {MAX_RELAUNCHES} Dagster runs ended before opening the attempt; "
            "not launching another (see their event logs)"
        )
        return None
    run_config, trainer_from = _continuation_plan(c, hosting)
    return dg.RunRequest(
        run_key=run_key,
        partition_key=c.run.snapshot_id,
        asset_selection=CONTINUATION_ASSETS,
        run_config=run_config,
        tags={
            TRAINER_CONFIG_FROM_TAG: trainer_from,
            CONTINUATION_TAG: c.run_key,
            "tracks/run_id": c.run.run_id,
            "tracks/continues_attempt": str(c.ended.attempt_no),
            "tracks/decision": str(c.decision.action),
            "tracks/rule": c.decision.rule,
            "tracks/launched_by": f"sensor:{SENSOR_NAME}",
        },
    )


# The statuses of a Dagster run whose steps may still be executing (a run that opened an
# attempt has started; queued or not started, it cannot have).
_STEP_MAY_RUN = (
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
)


def _hosting_run(instance: dg.DagsterInstance, attempt: "AttemptRecord") -> dg.DagsterRun | None:
    """The Dagster run that launched ``attempt``, where this instance holds it."""
    hosting = attempt.dagster_run_id
    return instance.get_run_by_id(hosting) if hosting else None


def _left_to_hosting_run(
    context: dg.SensorEvaluationContext,
    c: "Continuation",
    hosting: dg.DagsterRun | None,
    now: datetime,
) -> bool:
    """Whether the Dagster run that ran the ended attempt still owns its continuation.

    While that run is not finished (starting, started or being terminated), its
    ``training_attempt`` step may be opening the next attempt itself (continuing in place): a
    run launched here too would be a second attempt, which fencing would make lose but which
    should not exist. Once the run ends (the step
    failed, or it did not continue in place) the next tick takes over; a run still unfinished
    :data:`~pipeline.continuation.IN_RUN_CLAIM_SECONDS` after the attempt went quiet (its run
    worker died and nothing marked the run failed) no longer holds the continuation back.
    """
    from pipeline.continuation import IN_RUN_CLAIM_SECONDS, in_run_claim_open

    if hosting is None or hosting.status not in _STEP_MAY_RUN:
        return False
    status = hosting.status
    if in_run_claim_open(c.ended, now, AUTOMATION.heartbeat_timeout_seconds):
        context.log.info(
            f"{c.run_key}: not launched: Dagster run {hosting.run_id}, which ran attempt "
            f"{c.ended.key}, is still {status.value}; the continuation is its own "
            "(it continues in place, or ends and a later tick launches it)"
        )
        return True
    context.log.warning(
        f"{c.run_key}: Dagster run {hosting.run_id}, which ran attempt {c.ended.key}, is still "
        f"{status.value} {IN_RUN_CLAIM_SECONDS:.0f}s after the attempt went quiet without "
        "opening the next one; launching the continuation here"
    )
    return False


def _hosting_run_of_silent(
    context: dg.SensorEvaluationContext, attempt: "AttemptRecord", now: datetime
) -> "HostingRun":
    """What the Dagster run that launched a silent attempt says about it.

    At work (starting, started or being terminated), it keeps the attempt open this tick: its
    step waits on the trainer and sees how it ended (the exit code or signal, the pod's status),
    direct evidence where the sensor could only infer a lost node from silence; a trainer cut
    off from the ledger trains on and then exits with its own reason. The claim is bounded as
    the continuation's is: :data:`~pipeline.continuation.IN_RUN_CLAIM_SECONDS` after the
    heartbeat timed out (its run worker died with the node) the sensor closes the attempt. A run
    a person terminated that ended (or is still ending past the claim) without closing the
    attempt makes it ``cancelled``: resuming it would undo that person's decision.
    """
    from pipeline.continuation import IN_RUN_CLAIM_SECONDS, HostingRun, in_run_claim_open

    hosting = attempt.dagster_run_id
    try:
        run = _hosting_run(context.instance, attempt)
    except Exception as exc:  # one unreadable run must not hold up every silent attempt
        said = redact.text(f"{type(exc).__name__}: {exc}")
        context.log.warning(f"attempt {attempt.key}: Dagster run {hosting} unreadable: {said}")
        return HostingRun.GONE
    if run is None:
        return HostingRun.GONE
    status = run.status
    silent = (now - (attempt.heartbeat_at or attempt.started_at)).total_seconds()
    if status in _STEP_MAY_RUN and in_run_claim_open(
        attempt, now, AUTOMATION.heartbeat_timeout_seconds
    ):
        context.log.info(
            f"attempt {attempt.key}: no heartbeat for {silent:.0f}s; left open for Dagster run "
            f"{hosting}, which launched it and is still {status.value}: it ends the attempt "
            "from what it sees of the trainer"
        )
        return HostingRun.AT_WORK
    if status in (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED):
        context.log.warning(
            f"attempt {attempt.key}: no heartbeat for {silent:.0f}s, and Dagster run {hosting}, "
            f"which launched it, was terminated ({status.value}) without ending it; closing "
            "it as cancelled"
        )
        return HostingRun.TERMINATED
    if status in _STEP_MAY_RUN:
        context.log.warning(
            f"attempt {attempt.key}: no heartbeat for {silent:.0f}s, and Dagster run {hosting}, "
            f"which launched it, is still {status.value} {IN_RUN_CLAIM_SECONDS:.0f}s after the "
            "heartbeat timed out without ending it; closing it here"
        )
    return HostingRun.GONE


def _continuation_config(c: "Continuation", instance: dg.DagsterInstance) -> dict[str, Any]:
    """The run config of the continuation (see :func:`_continuation_plan`)."""
    return _continuation_plan(c, _hosting_run(instance, c.ended))[0]


def _continuation_plan(
    c: "Continuation", original: dg.DagsterRun | None
) -> tuple[dict[str, Any], str]:
    """Continue the run as it ran: on the trainer of the Dagster run that ran the last attempt.

    Its ``resources.trainer`` run config is carried over unchanged (a Kubernetes backend, its
    nodes and image with it). Without one, an attempt that ran N ranks on one machine gets N
    ranks under torchrun. An attempt that ran on Kubernetes or on several nodes, whose Dagster
    run is not on this instance to say how, is refused: guessing would run it on this machine.

    Returns the run config and where its trainer config came from (the value of the
    ``tracks/trainer_config_from`` tag, which the attempt's receipt keeps):
    ``dagster_run:<id>``, ``placement:<ranks>`` (the continued attempt's) or ``deployment``.
    ``original`` is that Dagster run, None where this instance does not hold it.
    """
    config: dict[str, Any] = {"ops": {"training_attempt": {"config": {"run_id": c.run.run_id}}}}
    placement = c.ended.placement or {}
    nodes = int(placement.get("nodes") or 1)
    on_kubernetes = placement.get("launcher") == "kubernetes"
    dagster_run_id = c.ended.dagster_run_id
    if original is not None:
        # Whether the step may continue in place is the launch's choice: carried over as set.
        ops = original.run_config.get("ops") or {}
        op_config = (ops.get("training_attempt") or {}).get("config") or {}
        if "continue_in_run" in op_config:
            config["ops"]["training_attempt"]["config"]["continue_in_run"] = op_config[
                "continue_in_run"
            ]
        trainer = (original.run_config.get("resources") or {}).get("trainer")
        if trainer:
            trainer = copy.deepcopy(trainer)
            if isinstance(trainer.get("config"), dict):
                # No longer run config (TRACKS_TRAINER_PYTHON): Dagster would refuse the key.
                trainer["config"].pop("python_executable", None)
            config["resources"] = {"trainer": trainer}
            return config, f"dagster_run:{dagster_run_id}"
        if on_kubernetes or nodes > 1:
            # It ran on this deployment's own trainer resource; so does its continuation.
            return config, "deployment"
    elif on_kubernetes or nodes > 1:
        where = "on Kubernetes" if on_kubernetes else f"on {nodes} nodes"
        found = (
            f"its Dagster run {dagster_run_id} is not on this instance"
            if dagster_run_id
            else "it records no Dagster run"
        )
        raise ContinuationRefusedError(
            f"attempt {c.ended.key} ran {where} and {found} to say how it was launched; "
            "continuing it would run it on this machine instead. Launch attempt "
            f"{c.next_attempt_no} with its resources.trainer run config by hand"
        )
    ranks_per_node = int(placement.get("ranks_per_node") or 1)
    if nodes == 1 and ranks_per_node > 1:
        trainer = {"backend": "torchrun", "nproc_per_node": ranks_per_node}
        config["resources"] = {"trainer": {"config": trainer}}
        return config, f"placement:{ranks_per_node}"
    return config, "deployment"
