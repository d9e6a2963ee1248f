"""One evaluation: one evaluator on one committed checkpoint, recorded with full provenance.

The evaluation leaves three receipts that point at each other: a ledger row (the gate reads it),
an MLflow run in ``tracks-evaluation`` (params = provenance, metrics, artifacts) and the
artifacts themselves (raw outputs, sampled failures, metrics, confusion matrix).
"""

from __future__ import annotations

import copy
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import envvars, redact
from pipeline.data.families import DIGITS, TEXT
from pipeline.evaluation.artifacts import FAILURES, RAW_OUTPUTS, SAMPLES_TABLE, write_artifacts
from pipeline.evaluation.errors import (
    CheckpointAttemptMismatchError,
    EvaluatorCrashError,
    FamilyMismatchError,
)
from pipeline.evaluation.eval_set import EvalSet, text_eval_set
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
    from pipeline.textlm.evaluators import TextEvaluator


def new_evaluation_id(evaluator_name: str) -> str:
    return f"eval-{evaluator_name}-{uuid.uuid4().hex[:12]}"


def run_evaluation(
    *,
    checkpoint_dir: str | Path,
    snapshot: Any,
    ledger: Ledger,
    settings: TracksSettings,
    evaluator: Evaluator | TextEvaluator | str,
    run_id: str,
    attempt_no: int,
    dagster_run_id: str | None = None,
) -> EvaluationRecord:
    """Evaluate a committed checkpoint on a snapshot's eval split and record it everywhere.

    ``snapshot`` is an opened ``pipeline.data.snapshot.Snapshot`` (or an :class:`EvalSet`
    or ``TextEvalSet`` already built from one); its family must be the checkpoint's (the
    trainer state's ``config.model_family``), else :class:`FamilyMismatchError`. A text-lm
    evaluation's training side is the run's snapshot (the ledger's), and the row carries the
    evaluator's ``provenance``. Returns the ``complete`` ledger row. If the evaluator raises, a
    ``failed`` row with termination reason ``evaluator_crash`` is recorded and
    :class:`EvaluatorCrashError` is raised. A checkpoint that fails verification
    (``CorruptCheckpointError``) or was committed by another attempt than ``run_id#attempt_no``
    raises before anything is recorded: that is not the evaluator's failure.
    """
    from pipeline.environment import container_digest
    from pipeline.mlflow_setup import EVALUATION_EXPERIMENT, get_or_create_experiment, mlflow_client
    from pipeline.serving.loading import load_committed_checkpoint

    started_at = utcnow()
    checkpoint, model = load_committed_checkpoint(checkpoint_dir)
    _check_attempt(checkpoint, run_id, attempt_no)
    family = checkpoint.family or DIGITS
    if isinstance(evaluator, str):
        evaluator = get_evaluator(evaluator, family)
    elif _family_of(evaluator) != family:
        raise FamilyMismatchError(
            f"evaluator {evaluator.name}",
            _family_of(evaluator),
            f"checkpoint {checkpoint.path}",
            family,
        )
    # The spike history the checkpoint carries is part of what was evaluated.
    training_health = checkpoint_health(checkpoint.path, checkpoint.manifest_sha256)
    eval_set = _eval_set(snapshot, family, checkpoint, ledger, settings, run_id)
    if family == TEXT:
        evaluator = _bound(evaluator, eval_set)

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
            if family == TEXT:
                result = evaluator.evaluate(model, eval_set)
            else:
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
            provenance=_evaluator_provenance(result),
        )
    )


def _evaluator_provenance(result: EvaluatorResult) -> dict[str, Any] | None:
    """What a text-lm evaluator recorded as the inputs of its figures (None for digits, whose
    provenance is the row's own columns)."""
    provenance = getattr(result, "provenance", None)
    return dict(provenance) if provenance else None


def _eval_set(
    snapshot: Any,
    family: str,
    checkpoint: CommittedCheckpoint,
    ledger: Ledger,
    settings: TracksSettings,
    run_id: str,
) -> Any:
    """The family's evaluation inputs: ``snapshot`` as given (an ``EvalSet`` or ``TextEvalSet``
    built already) or built from the opened snapshot, whose family must be the checkpoint's.

    A text-lm evaluation set's training side (the contamination check's reference) is the
    snapshot the run trained on, as the ledger records it: the evaluated snapshot when the
    run trained on it, another when an evaluation set was landed on its own.
    """
    from pipeline.data.snapshot import open_snapshot
    from pipeline.textlm.eval_set import TextEvalSet

    built = TextEvalSet if family == TEXT else EvalSet
    if isinstance(snapshot, EvalSet | TextEvalSet):
        if not isinstance(snapshot, built):
            other = DIGITS if isinstance(snapshot, EvalSet) else TEXT
            raise FamilyMismatchError(
                f"checkpoint {checkpoint.path}",
                family,
                f"the evaluation set {snapshot.snapshot_id}",
                other,
            )
        return snapshot
    if snapshot.family != family:
        raise FamilyMismatchError(
            f"checkpoint {checkpoint.path}",
            family,
            f"snapshot {snapshot.snapshot_id}",
            snapshot.family,
        )
    if family != TEXT:
        return EvalSet.from_snapshot(snapshot)
    trained_on = ledger.get_run(run_id).snapshot_id
    training = (
        snapshot
        if trained_on == snapshot.snapshot_id
        else open_snapshot(settings.snapshot_root, trained_on)
    )
    return text_eval_set(snapshot, training)


def _family_of(evaluator: Any) -> str:
    """The family an evaluator evaluates: text-lm's read a TextEvalSet, the others tensors."""
    from pipeline.textlm.evaluators import TextEvaluator

    return TEXT if isinstance(evaluator, TextEvaluator) else DIGITS


def _bound(evaluator: Any, eval_set: Any) -> Any:
    """The generation evaluator judging with the judge fitted on ``eval_set`` (its recorded
    ``judge_model`` is then that judge's version and digest); any other evaluator as it is."""
    from pipeline.textlm.evaluators import GenerationJudged

    if isinstance(evaluator, GenerationJudged) and evaluator.judge is None:
        bound = copy.copy(evaluator)
        bound.judge = eval_set.judge
        return bound
    return evaluator


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
            flat.update(_flat(value, "decoding."))  # text-lm's greedy/sampled nest one deeper
        elif value is not None:
            flat[key] = value
    params = [Param(k, str(v)) for k, v in sorted(flat.items())]
    for start in range(0, len(params), 100):  # log_batch takes at most 100 params a call
        client.log_batch(mlflow_run_id, params=params[start : start + 100])


def _flat(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# The text-lm provenance leaves worth a column in MLflow's run table; all of it is in the
# evaluation's metrics.json and the ledger row's provenance.
_PROVENANCE_PARAMS = (
    "model_digest",
    "tokenizer.digest",
    "prompt_set.digest",
    "template.name",
    "template.digest",
    "judge.digest",
    "judge.version",
    "training_snapshot_id",
    "threshold",
    "overlap_fraction",
    "contaminated",
    "torch_version",
    "torch_threads",
)


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
    recorded = dict(provenance)
    if evaluator_provenance := _evaluator_provenance(result):
        recorded["evaluator_provenance"] = evaluator_provenance
        _log_evaluator_provenance(client, mlflow_run_id, evaluator_provenance)
    with tempfile.TemporaryDirectory(prefix="tracks-eval-") as tmp:
        for path in write_artifacts(result, Path(tmp), title=title, provenance=recorded):
            client.log_artifact(mlflow_run_id, str(path))
        raw_outputs_sha256 = sha256_file(Path(tmp) / RAW_OUTPUTS)
    if _is_generation(result):
        # Every sample, readable in MLflow's evaluation view beside the run's metrics.
        client.log_table(mlflow_run_id, data=_samples_table(result), artifact_file=SAMPLES_TABLE)
    client.set_tag(mlflow_run_id, "tracks.raw_outputs_sha256", raw_outputs_sha256)
    return raw_outputs_sha256


def _log_evaluator_provenance(
    client: MlflowClient, mlflow_run_id: str, provenance: dict[str, Any]
) -> None:
    from mlflow.entities import Param

    flat = _flat(provenance, "")
    params = [
        Param(f"provenance.{key}", str(flat[key])) for key in _PROVENANCE_PARAMS if key in flat
    ]
    params += [
        Param(f"not_applicable.{key}", reason[:500])
        for key, reason in sorted((provenance.get("not_applicable") or {}).items())
    ]
    if params:
        client.log_batch(mlflow_run_id, params=params)


def _is_generation(result: EvaluatorResult) -> bool:
    return {"sample_index", "mode", "output_sha256"} <= set(result.raw_outputs.columns)


def _samples_table(result: EvaluatorResult) -> Any:
    """The generation samples as MLflow shows them: every column, missing seeds empty."""
    import pandas as pd

    frame = result.raw_outputs.copy()
    frame["seed"] = [None if pd.isna(s) else int(s) for s in frame["seed"].astype(object)]
    return frame


def _first_line(exc: BaseException) -> str:
    # Redacted before the cut: the line lands in an MLflow tag and the ledger, and a URL cut
    # short of its '@' no longer looks like one.
    text = redact.text(str(exc)).strip().splitlines()
    line = text[0] if text else "(no message)"
    return line if len(line) <= 300 else line[:297] + "..."
