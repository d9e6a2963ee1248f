"""One evaluation: one evaluator on one committed checkpoint, recorded with full provenance.

The evaluation leaves three receipts that point at each other: a ledger row (the gate reads it),
an MLflow run in ``tracks-evaluation`` (params = provenance, metrics, artifacts) and the
artifacts themselves (raw outputs, sampled failures, metrics, confusion matrix).
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import envvars, redact
from pipeline.evaluation.artifacts import FAILURES, RAW_OUTPUTS, write_artifacts
from pipeline.evaluation.errors import CheckpointAttemptMismatchError, EvaluatorCrashError
from pipeline.evaluation.eval_set import EvalSet
from pipeline.evaluation.evaluators import get_evaluator
from pipeline.evaluation.health import checkpoint_health, health_tags
from pipeline.ledger.ledger import utcnow
from pipeline.ledger.records import EvaluationRecord
from pipeline.states import EvaluationStatus, TerminationReason
from pipeline.tracking import TERMINATION_DETAIL_TAG, TERMINATION_REASON_TAG

# Drill hook: ``<evaluator>`` or ``<evaluator>:<n>`` makes that evaluator crash inside its
# evaluation, the first ``n`` times for a checkpoint (counted from the ledger's failed rows, so it
# holds across processes and retries); ``n`` defaults to every time.
FAULT_EVALUATOR_CRASH = envvars.TRACKS_FAULT_EVALUATOR_CRASH.name

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from pipeline.evaluation.base import Evaluator, EvaluatorResult
    from pipeline.ledger import Ledger
    from pipeline.serving.loading import CommittedCheckpoint
    from pipeline.settings import TracksSettings


def new_evaluation_id(evaluator_name: str) -> str:
    return f"eval-{evaluator_name}-{uuid.uuid4().hex[:12]}"


def run_evaluation(
    *,
    checkpoint_dir: str | Path,
    snapshot: Any,
    ledger: Ledger,
    settings: TracksSettings,
    evaluator: Evaluator | str,
    run_id: str,
    attempt_no: int,
    dagster_run_id: str | None = None,
) -> EvaluationRecord:
    """Evaluate a committed checkpoint on a snapshot's eval split and record it everywhere.

    ``snapshot`` is an opened ``pipeline.data.snapshot.Snapshot`` (or an :class:`EvalSet`
    already built from one). Returns the ``complete`` ledger row. If the evaluator raises, a
    ``failed`` row with termination reason ``evaluator_crash`` is recorded and
    :class:`EvaluatorCrashError` is raised. A checkpoint that fails verification
    (``CorruptCheckpointError``) or was committed by another attempt than ``run_id#attempt_no``
    raises before anything is recorded: that is not the evaluator's failure.
    """
    from pipeline.environment import container_digest
    from pipeline.mlflow_setup import EVALUATION_EXPERIMENT, get_or_create_experiment, mlflow_client
    from pipeline.serving.loading import load_committed_checkpoint

    if isinstance(evaluator, str):
        evaluator = get_evaluator(evaluator)
    started_at = utcnow()
    checkpoint, model = load_committed_checkpoint(checkpoint_dir)
    _check_attempt(checkpoint, run_id, attempt_no)
    # The spike history the checkpoint carries is part of what was evaluated.
    training_health = checkpoint_health(checkpoint.path, checkpoint.manifest_sha256)
    eval_set = snapshot if isinstance(snapshot, EvalSet) else EvalSet.from_snapshot(snapshot)

    evaluation_id = new_evaluation_id(evaluator.name)
    provenance: dict[str, Any] = {
        "evaluation_id": evaluation_id,
        "run_id": run_id,
        "attempt_no": attempt_no,
        "checkpoint_path": checkpoint.path,
        "checkpoint_step": checkpoint.step,
        "checkpoint_manifest_sha256": checkpoint.manifest_sha256,
        "snapshot_id": eval_set.snapshot_id,
        "evaluator_name": evaluator.name,
        "evaluator_version": evaluator.version,
        "evaluator_env_digest": container_digest(),
        "task_set_version": eval_set.task_set_version,
        "decoding_params": dict(evaluator.decoding_params),
        "judge_model": evaluator.judge_model,
        "rubric_version": evaluator.rubric_version,
        "dagster_run_id": dagster_run_id,
    }
    record_fields = {
        key: provenance[key]
        for key in (
            "evaluation_id",
            "run_id",
            "attempt_no",
            "checkpoint_path",
            "checkpoint_manifest_sha256",
            "evaluator_name",
            "evaluator_version",
            "evaluator_env_digest",
            "task_set_version",
            "decoding_params",
            "judge_model",
            "rubric_version",
            "dagster_run_id",
        )
    }
    record_fields["started_at"] = started_at
    record_fields["training_health"] = training_health

    client = mlflow_client(settings)
    experiment_id = get_or_create_experiment(client, settings, EVALUATION_EXPERIMENT)
    tags = _run_tags(client, provenance)
    tags.update(health_tags(training_health))  # a model that trained through a spike says so
    mlflow_run = client.create_run(
        experiment_id,
        run_name=f"{evaluator.name} {run_id}#{attempt_no} step {checkpoint.step}",
        tags=tags,
    )
    mlflow_run_id = mlflow_run.info.run_id
    finished = False
    try:
        _log_params(client, mlflow_run_id, provenance)
        try:
            _fault_evaluator_crash(ledger, evaluator.name, checkpoint.manifest_sha256)
            result = evaluator.evaluate(
                model, eval_set.images, eval_set.labels, list(eval_set.sample_ids)
            )
        except Exception as exc:
            detail = redact.text(
                f"evaluator {evaluator.name} raised {type(exc).__name__} on checkpoint "
                f"{checkpoint.path}: {_first_line(exc)}"
            )
            client.set_tag(mlflow_run_id, TERMINATION_REASON_TAG, TerminationReason.EVALUATOR_CRASH)
            client.set_tag(mlflow_run_id, TERMINATION_DETAIL_TAG, detail[:5000])
            ledger.record_evaluation(
                EvaluationRecord(
                    **record_fields,
                    status=str(EvaluationStatus.FAILED),
                    termination_reason=str(TerminationReason.EVALUATOR_CRASH),
                    detail=detail,
                    mlflow_run_id=mlflow_run_id,
                    ended_at=utcnow(),
                )
            )
            raise EvaluatorCrashError(
                evaluator_name=evaluator.name,
                evaluator_version=evaluator.version,
                checkpoint_path=checkpoint.path,
                evaluation_id=evaluation_id,
                cause=exc,
            ) from exc
        raw_outputs_sha256 = _log_result(client, mlflow_run_id, result, evaluator, provenance)
        finished = True
    finally:
        client.set_terminated(mlflow_run_id, "FINISHED" if finished else "FAILED")

    artifact_uri = mlflow_run.info.artifact_uri.rstrip("/")
    return ledger.record_evaluation(
        EvaluationRecord(
            **record_fields,
            status=str(EvaluationStatus.COMPLETE),
            metrics=dict(result.metrics),
            slice_metrics={k: dict(v) for k, v in result.slice_metrics.items()},
            raw_outputs_uri=f"{artifact_uri}/{RAW_OUTPUTS}",
            raw_outputs_sha256=raw_outputs_sha256,
            failures_uri=f"{artifact_uri}/{FAILURES}",
            mlflow_run_id=mlflow_run_id,
            ended_at=utcnow(),
        )
    )


class InjectedEvaluatorCrash(RuntimeError):
    """Raised by the ``TRACKS_FAULT_EVALUATOR_CRASH`` drill hook, never in normal operation."""


def _fault_evaluator_crash(ledger: Ledger, evaluator_name: str, manifest_sha256: str) -> None:
    spec = envvars.TRACKS_FAULT_EVALUATOR_CRASH.get()
    if not spec:
        return
    name, _, times = spec.partition(":")
    if name != evaluator_name:
        return
    if times:
        crashed = [
            e
            for e in ledger.evaluations_for_checkpoint(manifest_sha256)
            if e.evaluator_name == evaluator_name
            and e.termination_reason == TerminationReason.EVALUATOR_CRASH
        ]
        if len(crashed) >= int(times):
            return
    raise InjectedEvaluatorCrash(f"injected by {FAULT_EVALUATOR_CRASH}={spec}")


def _check_attempt(checkpoint: CommittedCheckpoint, run_id: str, attempt_no: int) -> None:
    if (checkpoint.run_id, checkpoint.attempt_no) != (run_id, attempt_no):
        raise CheckpointAttemptMismatchError(
            checkpoint.path,
            f"{run_id}#{attempt_no}",
            f"{checkpoint.run_id}#{checkpoint.attempt_no}",
        )


def _run_tags(client: MlflowClient, provenance: dict[str, Any]) -> dict[str, str]:
    """The evaluation run's tags: its provenance under the ``tracks.`` names the training run
    and the model version use too (``tracks.run_id`` finds a run's training and evaluation runs
    alike), the training run's MLflow id, and the Dagster run that evaluated, with its URL."""
    from pipeline.mlflow_setup import dagster_run_url
    from pipeline.tracking import DAGSTER_URL_TAG, TRAINING_RUN_TAG, training_run_of

    keys = (
        "evaluation_id",
        "run_id",
        "attempt_no",
        "checkpoint_path",
        "checkpoint_step",
        "checkpoint_manifest_sha256",
        "snapshot_id",
        "evaluator_name",
        "evaluator_version",
        "task_set_version",
        "dagster_run_id",
    )
    tags = {
        f"tracks.{key}": str(provenance[key]) for key in keys if provenance.get(key) is not None
    }
    if provenance.get("dagster_run_id"):
        tags[DAGSTER_URL_TAG] = dagster_run_url(provenance["dagster_run_id"])
    if training := training_run_of(client, provenance["run_id"]):
        tags[TRAINING_RUN_TAG] = training  # MLflow's UI links the evaluation to its training
    return tags


def _log_params(client: MlflowClient, mlflow_run_id: str, provenance: dict[str, Any]) -> None:
    from mlflow.entities import Param

    flat: dict[str, Any] = {}
    for key, value in provenance.items():
        if key == "decoding_params":
            flat.update({f"decoding.{k}": v for k, v in value.items()})
        elif value is not None:
            flat[key] = value
    client.log_batch(mlflow_run_id, params=[Param(k, str(v)) for k, v in sorted(flat.items())])


def _log_result(
    client: MlflowClient,
    mlflow_run_id: str,
    result: EvaluatorResult,
    evaluator: Evaluator,
    provenance: dict[str, Any],
) -> str:
    """Log metrics and artifacts; the sha256 of the raw outputs file as it was logged."""
    from mlflow.entities import Metric

    from pipeline.digests import sha256_file
    from pipeline.mlflow_setup import mlflow_key

    now = int(time.time() * 1000)
    metrics = [Metric(mlflow_key(k), float(v), now, 0) for k, v in result.metrics.items()]
    for slice_name, values in result.slice_metrics.items():
        metrics.extend(
            Metric(f"slice/{mlflow_key(slice_name)}/{mlflow_key(k)}", float(v), now, 0)
            for k, v in values.items()
        )
    # log_batch takes at most 1000 metrics a call.
    for start in range(0, len(metrics), 1000):
        client.log_batch(mlflow_run_id, metrics=metrics[start : start + 1000])

    title = (
        f"{evaluator.name} · {provenance['run_id']}#{provenance['attempt_no']} "
        f"step {provenance['checkpoint_step']} · {provenance['checkpoint_manifest_sha256'][:12]}"
    )
    with tempfile.TemporaryDirectory(prefix="tracks-eval-") as tmp:
        for path in write_artifacts(result, Path(tmp), title=title, provenance=provenance):
            client.log_artifact(mlflow_run_id, str(path))
        raw_outputs_sha256 = sha256_file(Path(tmp) / RAW_OUTPUTS)
    client.set_tag(mlflow_run_id, "tracks.raw_outputs_sha256", raw_outputs_sha256)
    return raw_outputs_sha256


def _first_line(exc: BaseException) -> str:
    # Redacted before the cut: the line lands in an MLflow tag and the ledger, and a URL cut
    # short of its '@' no longer looks like one.
    text = redact.text(str(exc)).strip().splitlines()
    line = text[0] if text else "(no message)"
    return line if len(line) <= 300 else line[:297] + "..."
