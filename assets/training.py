"""``training_attempt`` runs the trainer through Pipes; ``committed_checkpoint`` verifies it."""

import dataclasses
import math
import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError

from assets.failures import step_failure
from assets.launch import (
    CONTINUATION_TAG,
    continued_in_run,
    launched_by,
    trainer_config_source,
)
from assets.lineage import upstream_metadata
from assets.links import mlflow_training_link
from assets.partitions import ASSET_GROUP, snapshot_partitions
from assets.tables import (
    checkpoint_lineage_table,
    commits_table,
    config_table,
    fields_table,
    loss_table,
)
from assets.training_config import (
    SOURCE,
    TRAINING_ATTEMPT_CONFIG,
    TrainingRunConfig,
    train_config_for_attempt,
)
from pipeline import ids
from resources import (
    LedgerResource,
    MlflowResource,
    StorageResource,
    TrainerExit,
    TrainerLauncherResource,
)
from resources.launcher import TrainerBackend


def _default_device(trainer: TrainerLauncherResource, backend: TrainerBackend) -> str | None:
    """``cuda`` when the trainer resource places the run on GPUs: Kubernetes pods given
    ``gpus``, or a CUDA device visible to this machine for the local and torchrun backends."""
    if backend is TrainerBackend.KUBERNETES:
        return "cuda" if trainer.gpus > 0 else None
    import torch

    return "cuda" if torch.cuda.is_available() else None


# How far up a chain of re-executions the ledger run is looked for (each re-execution that
# opened no attempt, refused say, adds a link).
_MAX_REEXECUTION_DEPTH = 50


def _reexecuted_run(book: Any, instance: dg.DagsterInstance, tags: Mapping[str, str]) -> Any:
    """For a re-execution ("Re-execute from failure" and the like): the newest attempt of the
    nearest ancestor Dagster run that opened one, or None.

    A re-execution copies its parent's run config, which for a new run names no run id: that
    attempt's ledger run is the one to continue, under its retry policy, never a new run.
    """
    parent = tags.get("dagster/parent_run_id")
    for _ in range(_MAX_REEXECUTION_DEPTH):
        if not parent:
            return None
        opened = book.attempts_for_dagster_run(parent)
        if opened:
            return opened[-1]
        run = instance.get_run_by_id(parent)
        parent = run.tags.get("dagster/parent_run_id") if run is not None else None
    return None


def _how_to_continue(run_id: str, partition: str, last_config: Mapping[str, Any]) -> str:
    """The launch that continues ``run_id`` once what the retry policy named is changed."""
    batch = last_config.get("batch_size")
    change = f"batch_size: {max(int(batch) // 2, 1)}" if isinstance(batch, int) else "KEY: VALUE"
    return (
        f"To continue run {run_id}, change what the decision names and launch training_attempt "
        f"for partition {partition} from the Launchpad with run config `ops: {{training_attempt: "
        f"{{config: {{run_id: {run_id}, train: {{{change}}}}}}}}}`; leave run_id out to "
        "start a new run instead."
    )


def _tell_dagster(
    context: dg.AssetExecutionContext, run_id: str, attempt_no: int, contradicted: str | None
) -> None:
    """Set the run tags Tracks owns to the ledger's facts, so the Dagster UI never shows this
    run as part of another one whose tags were copied onto its launch."""
    from pipeline.launch_facts import continuation_key

    tags = {"tracks/run_id": run_id, "tracks/attempt": f"{run_id}#{attempt_no}"}
    if contradicted:
        claimed = context.run.tags
        tags["tracks/tags_contradicted"] = contradicted[:1000]
        if claimed.get(CONTINUATION_TAG):
            tags[CONTINUATION_TAG] = (
                continuation_key(run_id, attempt_no)
                if attempt_no > 1
                else f"none (new run {run_id})"
            )
        if claimed.get("tracks/continues_attempt"):
            tags["tracks/continues_attempt"] = str(attempt_no - 1) if attempt_no > 1 else "none"
    try:
        context.instance.add_run_tags(context.run_id, tags)
    except Exception as exc:  # the ledger holds the truth; a tag is a convenience
        context.log.warning(f"run tags not set: {type(exc).__name__}: {exc}")


def _messages(outcome: TrainerExit, event: str) -> list[dict[str, Any]]:
    return [m for m in outcome.custom_messages if isinstance(m, dict) and m.get("event") == event]


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=["data_snapshot"],
    group_name=ASSET_GROUP,
    kinds={"pytorch"},
    description="One attempt of a training run: the trainer process, launched through Pipes "
    "(and the next attempts, where it dies and the retry policy continues the run at once).",
    config_schema=TRAINING_ATTEMPT_CONFIG,
)
def training_attempt(
    context: dg.AssetExecutionContext,
    ledger: LedgerResource,
    storage: StorageResource,
    trainer: TrainerLauncherResource,
    mlflow: MlflowResource,
) -> dg.MaterializeResult:
    from pipeline.attempts import (
        AttemptRefusedError,
        PreparedAttempt,
        cancel_unlaunched,
        prepare_attempt,
        stop_after_termination,
    )
    from pipeline.data.errors import DataError
    from pipeline.data.gate import ensure_checks_passed
    from pipeline.data.snapshot import open_snapshot
    from pipeline.explain import explain
    from pipeline.ledger import LedgerError
    from pipeline.plots import loss_curve_markdown, loss_sparkline
    from pipeline.retry import RetryPolicyError, load_retry_policy
    from pipeline.trainer.config import ConfigError

    config = TrainingRunConfig(**context.op_execution_context.op_config)
    book = ledger.ledger()
    snapshot = open_snapshot(storage.snapshots() / ids.snapshot_id(context.partition_key))
    try:
        # The gate holds even when this asset is materialized on its own: the blocking checks'
        # verdict for this exact manifest is required (and produced now if nobody checked it).
        ensure_checks_passed(
            snapshot, snapshot_root=storage.snapshots(), ledger=book, dagster_run_id=context.run_id
        )
    except DataError as exc:
        raise step_failure(str(exc), exc) from None
    try:
        # A bad backend, rank count or Kubernetes field (an inline credential included) is
        # refused before an attempt is opened.
        backend, ranks = trainer.world(PreparedAttempt.trainer_env(book.url, mlflow.tracking_uri))
    except ValueError as exc:
        raise step_failure(str(exc), exc) from None
    tags = context.run.tags
    launch = launched_by(tags)
    launch["trainer_config"] = trainer_config_source(
        tags, context.run.run_config, context.run_id, launch["via"]
    )
    run_id = config.run_id
    reexecuted = None if run_id else _reexecuted_run(book, context.instance, tags)
    if reexecuted is not None:
        run_id = reexecuted.run_id
        context.log.info(
            f"re-execution of Dagster run {tags['dagster/parent_run_id']}: continuing run "
            f"{run_id} (its attempt {reexecuted.attempt_no} ran in Dagster run "
            f"{reexecuted.dagster_run_id}) under its retry policy, not starting a new run"
        )

    def placement_device() -> str | None:
        device = _default_device(trainer, backend)
        if device:
            context.log.info(f"train.device is unset: {device}, where the trainer places the run")
        return device

    def open_attempt(
        run_config: TrainingRunConfig, run_id: str | None, launched: dict[str, Any]
    ) -> PreparedAttempt:
        try:
            train_config = train_config_for_attempt(
                book, run_config, snapshot, run_id, default_device=placement_device
            )
            if Path(train_config.snapshot_dir) != snapshot.path.resolve():
                # The gate above passed this partition's snapshot, and the receipt names it.
                raise ConfigError(
                    SOURCE,
                    "snapshot_dir",
                    f"{train_config.snapshot_dir} is not this partition's snapshot {snapshot.path}",
                )
            policy = load_retry_policy(run_config.retry_policy)
            return prepare_attempt(
                book,
                snapshot=snapshot,
                train_config=train_config,
                work_root=storage.work_dir(),
                run_id=run_id,
                owner=run_config.owner,
                purpose=run_config.purpose,
                retry_policy=policy,
                dagster_run_id=context.run_id,
                launched_by=launched,
                note=run_config.note,  # the launch-time note, on this attempt, by who launched it
            )
        except ids.InvalidIdError as exc:  # model_family or run_id
            raise step_failure(f"{SOURCE}: {exc}", exc) from None
        except AttemptRefusedError as exc:
            said = str(exc)
            if reexecuted is not None:
                said = (
                    f"Re-executing Dagster run {tags['dagster/parent_run_id']} continues run "
                    f"{exc.run_id} (its attempt {reexecuted.attempt_no} ran in Dagster run "
                    f"{reexecuted.dagster_run_id}), and the retry policy refuses it: {said}"
                )
            last = book.latest_attempt(exc.run_id)
            how = _how_to_continue(exc.run_id, context.partition_key, last.config_snapshot or {})
            raise step_failure(f"{said}. {how}", exc) from None
        except (ConfigError, RetryPolicyError, LedgerError) as exc:
            raise step_failure(str(exc), exc) from None

    hosted: list[int] = []  # the attempts this step ran, in order
    try:
        prepared = open_attempt(config, run_id, launch)
    except DagsterExecutionInterruptedError:
        # Terminated while the attempt was being opened: if its row was written, it ends
        # cancelled now, not preempted when its heartbeat times out.
        cancel_unlaunched(book, context.run_id)
        raise
    while True:
        finished, outcome, contradicted = _run_attempt(
            context, book, storage, trainer, mlflow, prepared, backend, ranks, launch
        )
        run, attempt = prepared.run, prepared.attempt
        hosted.append(attempt.attempt_no)
        if finished.succeeded:
            break
        if not _may_continue_in_place(context, book, config, finished):
            finished = _as_recorded(book, finished)  # a termination may have decided again
            break
        # Continue in place: the next attempt of the same ledger run, opened and launched by
        # this step exactly as the resume sensor's Dagster run would open it (its last
        # attempt's config, resuming where prepare_attempt plans), on the same trainer.
        decision = finished.decision
        try:
            if decision.backoff_seconds > 0:
                context.log.info(f"waiting {decision.backoff_seconds:.1f}s: {decision.reason}")
                time.sleep(decision.backoff_seconds)
            launch = continued_in_run(
                launch,
                context.run_id,
                attempt.key,
                attempt.attempt_no,
                str(finished.termination.reason),
                decision.rule,
            )
            continued = TrainingRunConfig(
                owner=config.owner,
                purpose=config.purpose,
                run_id=run.run_id,
                retry_policy=config.retry_policy,
                continue_in_run=config.continue_in_run,
            )  # no train keys: the last attempt's config, as the sensor's continuation has
            prepared = open_attempt(continued, run.run_id, launch)
            ending = finished.attempt.signal or f"exit code {finished.attempt.exit_code}"
            planned = prepared.planned_resume_from
            context.log.info(
                f"attempt {attempt.key} ended {finished.termination.reason} ({ending}); "
                f"continuing in this run as attempt {prepared.attempt.key} from "
                + (Path(planned.path).name if planned else "a fresh start")
                + f" (rule {decision.rule}: {decision.reason})"
            )
        except DagsterExecutionInterruptedError:
            # Terminated between two attempts: the receipt says a person stopped the run, and
            # the resume sensor does not carry it on (pipeline.attempts.stop_after_termination).
            stop_after_termination(book, run.run_id, attempt.attempt_no, context.run_id)
            raise

    # The run's page as it stands when this attempt ends: evaluation and promotion come later,
    # and the assets that record them (evaluation, promoted_model) attach the page again then.
    story = dg.MetadataValue.md(
        f"*The run as it stood when attempt {attempt.attempt_no} ended; `evaluation` and "
        "`promoted_model` attach this page again once they are recorded.*\n\n"
        + explain(book, attempt.key)
    )
    # Numbers only where a plot over materializations means something (losses, throughput):
    # an attempt number or a step is an identifier, so it is text.
    metadata: dict[str, Any] = {
        "run_id": run.run_id,
        "attempt_no": dg.MetadataValue.text(str(attempt.attempt_no)),
        "termination_reason": str(finished.termination.reason),
        "termination_detail": finished.termination.detail,
        "explain": story,
        **mlflow_training_link(mlflow, run.run_id),
    }
    if contradicted:
        metadata["tags_contradicted"] = dg.MetadataValue.text(contradicted)
    if len(hosted) > 1:
        metadata["attempts_in_this_dagster_run"] = dg.MetadataValue.text(
            ", ".join(str(n) for n in hosted)
            + f" (attempts after the first continued in place by Dagster run {context.run_id})"
        )
    decision_table = fields_table(
        "retry_decision", finished.decision.to_json(), "as the retry policy recorded it"
    )
    if not finished.succeeded:
        decision = finished.decision
        description = (
            f"attempt {attempt.key} ended {finished.termination.reason}: "
            f"{finished.termination.detail} Next: {decision.action} ({decision.reason})"
        )
        metadata["retry_decision"] = decision_table
        # One owner per failure: the resume sensor continues the run (resume, retry after its
        # backoff, rollback) as the decision says, where this step did not continue it in
        # place (a longer backoff, continue_in_run off; a terminated Dagster run decided
        # stop); Dagster itself never retries this step.
        raise dg.Failure(description=description, metadata=metadata, allow_retries=False)

    steps = _messages(outcome, "step") if outcome else []
    # The receipt, not the plan: where the trainer reported it resumed from.
    resumed_from = finished.attempt.resumed_from_checkpoint
    restored = finished.attempt.restored_step
    commits = _messages(outcome, "checkpoint_committed") if outcome else []
    checkpoints = book.checkpoints(run.run_id)
    if steps:
        metadata |= {
            "loss_curve": dg.MetadataValue.md(
                loss_curve_markdown(
                    steps,
                    [int(c["step"]) for c in commits if "step" in c],
                    title=f"loss, attempt {attempt.attempt_no}",
                )
            ),
            "loss": dg.MetadataValue.text(loss_sparkline(steps)),
            "first_loss": float(steps[0]["loss"]),
            "final_loss": float(steps[-1]["loss"]),
            "examples_per_second": float(steps[-1].get("examples_per_second", 0.0)),
            "loss_by_step": loss_table(steps),
        }
    previous, compared_with = _previous_config(book, run, attempt.attempt_no)
    metadata |= {
        "checkpoints_committed": commits_table(commits, checkpoints),
        "checkpoint_lineage": checkpoint_lineage_table(checkpoints),
        "config": config_table(prepared.train_config.to_dict(), previous),
        "config_compared_with": dg.MetadataValue.text(compared_with),
        "retry_decision": decision_table,
        "config_sha256": prepared.train_config.sha256(),
        "snapshot_id": snapshot.snapshot_id,
        "data_manifest_sha256": snapshot.manifest_sha256,
        "resumed_from_checkpoint": resumed_from or "none",
        "restored_step": dg.MetadataValue.text(
            str(restored) if restored is not None else "unknown"
        ),
    }
    return dg.MaterializeResult(metadata=metadata)


def _run_attempt(
    context: dg.AssetExecutionContext,
    book: Any,
    storage: StorageResource,
    trainer: TrainerLauncherResource,
    mlflow: MlflowResource,
    prepared: Any,
    backend: TrainerBackend,
    ranks: int,
    launch: Mapping[str, Any],
) -> tuple[Any, TrainerExit | None, str | None]:
    """Launch the prepared attempt's trainer and close its receipt, however it ends.

    Returns the finished attempt, the trainer's exit (None when it never ran) and the sentence
    naming contradicted tags (or None). A terminated Dagster run or a launcher that failed
    re-raises, after the receipt is closed and mirrored.
    """
    from pipeline.attempts import finish_attempt
    from pipeline.launch_facts import contradicted_tags
    from pipeline.reasons import launcher_failed
    from pipeline.tracking import mirror_attempt

    run, attempt = prepared.run, prepared.attempt
    outcome: TrainerExit | None = None
    contradicted: str | None = None
    interrupted = False
    launch_error: Exception | None = None
    cpu_before = _children_cpu_seconds()
    # From here the attempt is open in the ledger: whatever ends this step (a termination
    # included, which can land on any line) closes its receipt in the finally below.
    try:
        # How it was launched, before the trainer starts (and merges what only it knows).
        book.merge_placement(
            run.run_id, attempt.attempt_no, {"backend": backend.value, "launched_ranks": ranks}
        )
        contradicted = contradicted_tags(launch, run.run_id, attempt.attempt_no)
        if contradicted:
            context.log.warning(contradicted)
        _tell_dagster(context, run.run_id, attempt.attempt_no, contradicted)
        context.log.info(
            f"attempt {attempt.key} starts"
            + (
                f", planning to resume from {prepared.planned_resume_from.path}"
                if prepared.planned_resume_from
                else ", planning a fresh start"
            )
        )
        try:
            _, outcome = trainer.launch(
                context,
                prepared.trainer_args(storage.checkpoints()),
                # DAGSTER_RUN_ID: the trainer tags its MLflow attempt with the Dagster run.
                env={
                    **prepared.trainer_env(book.url, mlflow.tracking_uri, mlflow.artifact_root),
                    "DAGSTER_RUN_ID": context.run_id,
                },
                extras={"run_id": run.run_id, "attempt_no": attempt.attempt_no},
                # torchrun: each rank's outcome, and the output of ranks other than 0, kept here.
                log_dir=str(storage.work_dir("ranks", run.run_id, f"attempt-{attempt.attempt_no}")),
            )
        except DagsterExecutionInterruptedError:
            raise
        except Exception as exc:
            launch_error = exc  # the launcher itself failed (a missing executable, say)
            raise
    except DagsterExecutionInterruptedError:
        interrupted = True  # a person terminated the Dagster run
        raise
    finally:
        # Runs when the Dagster run is terminated too: the receipt is always closed.
        observed = outcome.observed if outcome else None
        if outcome is None and launch_error is not None:
            observed = launcher_failed(launch_error)
        finished = finish_attempt(
            book,
            prepared,
            store=storage.checkpoints(),
            returncode=outcome.returncode if outcome else None,
            signal_name=outcome.signal_name if outcome else None,
            cancelled=interrupted,
            cpu_seconds=_children_cpu_seconds() - cpu_before,
            # Kubernetes: what the cluster saw (eviction, OOMKilled) and where rank 0 ran.
            observed=observed,
            placement=outcome.placement if outcome else None,
        )
        # MLflow says what the ledger now says: the reason, the Dagster run, no RUNNING left.
        unmirrored = mirror_attempt(
            book, run.run_id, attempt.attempt_no, tracking_uri=mlflow.tracking_uri
        )
        if unmirrored:
            context.log.warning(unmirrored)
    return finished, outcome, contradicted


# A terminated Dagster run is a person's cancellation: never continued in place.
_ENDING_STATUSES = (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED)


def _may_continue_in_place(
    context: dg.AssetExecutionContext, book: Any, config: TrainingRunConfig, finished: Any
) -> bool:
    """Whether this step opens the next attempt itself: this step ended the attempt (the resume
    sensor did not, first), the launch allows it (``continue_in_run``), the decision continues
    the run at once (:func:`pipeline.continuation.continues_in_run`), nobody is terminating
    this Dagster run (which stops the run: :func:`pipeline.attempts.stop_after_termination`),
    and the ended attempt is still the run's newest (no other launch carried the run on)."""
    from pipeline.continuation import IN_RUN_MAX_BACKOFF_SECONDS, continues_in_run
    from pipeline.states import RunStatus

    decision, ended = finished.decision, finished.attempt
    if not finished.ended_here:
        context.log.info(
            f"attempt {ended.key} was ended by another process first ({ended.termination_reason}"
            "): its decision stands, and that process carries the run on"
        )
        return False
    if not config.continue_in_run or not continues_in_run(decision):
        if config.continue_in_run and decision.backoff_seconds > IN_RUN_MAX_BACKOFF_SECONDS:
            context.log.info(
                f"attempt {ended.key}: the decision waits {decision.backoff_seconds:.0f}s, "
                f"more than {IN_RUN_MAX_BACKOFF_SECONDS:.0f}s: the resume sensor continues it"
            )
        return False
    hosting = context.instance.get_run_by_id(context.run_id)
    if hosting is not None and hosting.status in _ENDING_STATUSES:
        # Terminated between two attempts: a person stopped the run (so the sensor must not
        # carry it on either), and the ended attempt's receipt says so.
        from pipeline.attempts import stop_after_termination

        stop_after_termination(book, ended.run_id, ended.attempt_no, context.run_id)
        context.log.info(
            f"attempt {ended.key}: this Dagster run is being terminated: the run stops here"
        )
        return False
    newest = book.latest_attempt(ended.run_id)
    if newest is None or newest.attempt_no != ended.attempt_no:
        context.log.warning(
            f"attempt {ended.key} ended, but attempt {newest.key if newest else '?'} is the "
            "run's newest: another launch carries the run on; not continuing in place"
        )
        return False
    # A run the ended attempt's decision did not stop (failed, say, by a person) stays ended.
    return str(book.get_run(ended.run_id).status) == str(RunStatus.RUNNING)


def _as_recorded(book: Any, finished: Any) -> Any:
    """``finished`` with its attempt and retry decision as the ledger holds them now."""
    from pipeline.retry import RetryDecision

    attempt = book.get_attempt(finished.attempt.run_id, finished.attempt.attempt_no)
    decided = attempt.retry_decision
    decision = RetryDecision.from_json(decided) if decided else finished.decision
    return dataclasses.replace(finished, attempt=attempt, decision=decision)


def _previous_config(book: Any, run: Any, attempt_no: int) -> tuple[dict[str, Any] | None, str]:
    """The config this attempt is best compared with, and which one it is, in words: the
    previous attempt of the run, else the newest attempt of the family's previous run."""
    if attempt_no > 1:
        before = book.get_attempt(run.run_id, attempt_no - 1)
        return dict(before.config_snapshot or {}), f"attempt {attempt_no - 1} of this run"
    earlier = [
        r
        for r in book.find_runs(model_family=run.model_family, limit=20)
        if r.run_id != run.run_id and r.created_at <= run.created_at
    ]
    for other in earlier:  # newest first
        last = book.latest_attempt(other.run_id)
        if last is not None and last.config_snapshot:
            return dict(last.config_snapshot), (
                f"run {other.run_id} (attempt {last.attempt_no}), the family's previous run"
            )
    return None, f"nothing: the first run of family {run.model_family}"


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=["training_attempt"],
    group_name=ASSET_GROUP,
    kinds={"safetensors"},
    description="The final committed checkpoint of the newest training run, verified on read.",
)
def committed_checkpoint(
    context: dg.AssetExecutionContext, ledger: LedgerResource, storage: StorageResource
) -> dg.MaterializeResult:
    from pipeline import safepath
    from pipeline.checkpoint import CheckpointError, verify_checkpoint

    attempt_meta = upstream_metadata(context, "training_attempt", context.partition_key)
    run_id = ids.run_id(attempt_meta["run_id"])
    book = ledger.ledger()
    # The run's result: the newest succeeded attempt's final commit, not the highest step (a
    # failed attempt may have committed past the max_steps its relaunch lowered).
    checkpoint = book.latest_committed_checkpoint(run_id, final=True)
    if checkpoint is None:
        raise dg.Failure(
            f"run {run_id} has no committed checkpoint from a succeeded attempt",
            allow_retries=False,
        )
    # What is stated below is what was verified on disk, under the checkpoint store, and it
    # must be what the ledger committed: a folder rewritten since would verify on its own.
    try:
        path = safepath.no_symlinks(storage.checkpoints(), Path(checkpoint.path))
        info = verify_checkpoint(path)
    except (safepath.UnsafePathError, CheckpointError) as exc:
        raise step_failure(f"run {run_id}'s committed checkpoint: {exc}", exc) from None
    if info.manifest_sha256 != checkpoint.manifest_sha256:
        raise dg.Failure(
            f"checkpoint {path} verifies with manifest {info.manifest_sha256[:16]}, but the "
            f"ledger committed {str(checkpoint.manifest_sha256)[:16]}: not the checkpoint "
            "the run committed",
            allow_retries=False,
        )
    # The attempt and the step identify the checkpoint (text); its size and its metrics are
    # what a plot over snapshots may compare (numbers).
    metrics = {
        f"metrics/{name}": float(value)
        for name, value in sorted((checkpoint.metrics or {}).items())
        if isinstance(value, int | float) and math.isfinite(value)
    }
    return dg.MaterializeResult(
        metadata={
            "run_id": run_id,
            "attempt_no": dg.MetadataValue.text(str(info.attempt_no)),
            "step": dg.MetadataValue.text(str(info.step)),
            "path": dg.MetadataValue.path(str(path)),
            "manifest_sha256": info.manifest_sha256,
            "bytes": checkpoint.bytes or 0,
            "parent_checkpoint": checkpoint.parent_path or "none",
            **metrics,
            "lineage": checkpoint_lineage_table(book.checkpoints(run_id)),
        },
        data_version=dg.DataVersion(info.manifest_sha256),
    )
