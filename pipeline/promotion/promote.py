"""Promotion: gate a committed checkpoint, register it in MLflow and move the ``champion`` alias.

Before the gate, a champion with no evaluation the headline comparison can pair with the
candidate's (same task set, same evaluator version, digested raw outputs) is evaluated on the
promotion's snapshot (see ``baseline``).

Order of writes on a pass: MLflow model version (tagged back to run, attempt, checkpoint,
snapshot and evaluations), then the alias (only if the champion is still the version
the gate compared against), then the ledger row. A crash between the alias and
the ledger is repaired by the next call: the alias already points at this checkpoint, so the
version is reused instead of registered twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import tempfile
import uuid
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.ledger.ledger import utcnow
from pipeline.ledger.records import PromotionRecord
from pipeline.mlflow_setup import CHAMPION_ALIAS, DEFAULT_MODEL_NAME
from pipeline.promotion.comparison import load_outcomes
from pipeline.promotion.gate import GateDecision, QualityGate
from pipeline.serving.registry import promotion_for_version, registered_champion
from pipeline.states import PromotionDecision

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from pipeline.ledger import Ledger
    from pipeline.serving.champion import StagedServedFiles
    from pipeline.serving.loading import CommittedCheckpoint
    from pipeline.settings import TracksSettings

_SERVING_REQUIREMENTS = ("mlflow", "torch", "safetensors", "numpy", "pandas")


def champion_version(
    settings: TracksSettings, model_name: str = DEFAULT_MODEL_NAME
) -> ModelVersion | None:
    """The model version the ``champion`` alias points at, or None if there is none yet."""
    from pipeline.mlflow_setup import mlflow_client

    return registered_champion(mlflow_client(settings), model_name)


def promote(
    *,
    ledger: Ledger,
    settings: TracksSettings,
    run_id: str,
    attempt_no: int,
    checkpoint_dir: str | Path,
    snapshot_id: str,
    model_name: str = DEFAULT_MODEL_NAME,
    gate: QualityGate | None = None,
    dagster_run_id: str | None = None,
    required: Sequence[str] | None = None,
) -> PromotionRecord:
    """Gate the checkpoint and, on a pass, make it the champion; record the decision either way.

    A refusal is recorded and returned, not raised: its ``reason`` names what failed.
    ``gate`` defaults to ``QualityGate()``; ``required`` to the registry's required evaluators.
    """
    from pipeline import ids
    from pipeline.evaluation.evaluators import required_evaluators
    from pipeline.mlflow_setup import mlflow_client
    from pipeline.serving.loading import open_committed_checkpoint

    # Serving refuses a name ids.model_name refuses: promoting under one would crown a
    # champion nobody can load ("a/b" would fail in the registry after the model is logged).
    ids.model_name(model_name)
    ids.run_id(run_id)
    ids.snapshot_id(snapshot_id)
    checkpoint = open_committed_checkpoint(checkpoint_dir)
    _require_ledger_committed(ledger, checkpoint, run_id)
    required = list(required) if required is not None else required_evaluators()
    client = mlflow_client(settings)

    champion = registered_champion(client, model_name)
    # The SQL registry hands versions back as ints; the ledger and tags hold strings.
    previous = str(champion.version) if champion else None
    champion_sha = _champion_manifest_sha(ledger, model_name, champion)
    gate = gate or QualityGate()
    candidate_evaluations = ledger.evaluations_for_checkpoint(checkpoint.manifest_sha256)
    champion_row = promotion_for_version(ledger, model_name, previous) if previous else None
    reevaluation = None
    if champion_row is not None and champion_sha != checkpoint.manifest_sha256:
        from pipeline.promotion.baseline import reevaluate_champion_if_needed

        reevaluation = reevaluate_champion_if_needed(
            ledger=ledger,
            settings=settings,
            champion=champion_row,
            candidate_evaluations=candidate_evaluations,
            candidate_manifest_sha256=checkpoint.manifest_sha256,
            snapshot_id=snapshot_id,
            headline=gate.headline,
            dagster_run_id=dagster_run_id,
        )
    champion_evaluations = ledger.evaluations_for_checkpoint(champion_sha) if champion_sha else []
    decision = gate.decide(
        checkpoint.manifest_sha256,
        candidate_evaluations,
        champion_evaluations,
        required,
        champion_version=previous,
        outcomes=functools.partial(load_outcomes, settings=settings),
    )
    decision = _with_reevaluation(decision, reevaluation, previous)
    if champion is not None and champion_sha is None:
        # Without the champion's evaluations "no slice regression" cannot be shown.
        reasons = [
            *decision.reasons,
            f"champion version {previous} of {model_name} has no Tracks promotion "
            f"or checkpoint tag, so its slices cannot be compared",
        ]
        decision = dataclasses.replace(
            decision,
            passed=False,
            reasons=reasons,
            details={**decision.details, "reasons": reasons},
        )

    record = PromotionRecord(
        promotion_id=f"promo-{uuid.uuid4().hex[:12]}",
        run_id=run_id,
        attempt_no=attempt_no,
        checkpoint_path=checkpoint.path,
        checkpoint_manifest_sha256=checkpoint.manifest_sha256,
        snapshot_id=snapshot_id,
        decision=str(PromotionDecision.REFUSED),
        reason=decision.summary(),
        evaluation_ids=decision.evaluation_ids,
        gate=decision.details,
        model_name=model_name,
        decided_at=utcnow(),
        previous_champion_version=previous,
        dagster_run_id=dagster_run_id,
    )
    if not decision.passed:
        return ledger.record_promotion(record)

    from pipeline.serving.champion import serving_manifest, stage_served_files

    # The store stays writable while MLflow uploads: log and vouch for private, verified copies
    # only, never for files re-read from the store after verification.
    with tempfile.TemporaryDirectory(prefix="tracks-promote-") as private:
        staged = stage_served_files(checkpoint.path, checkpoint.manifest_sha256, Path(private))
        if champion is not None and champion_sha == checkpoint.manifest_sha256:
            existing = promotion_for_version(ledger, model_name, str(champion.version))
            if existing is not None:
                return existing  # already the champion, and already recorded
            version = str(champion.version)
            previous = champion.tags.get("previous_champion_version")
        else:
            evaluations = dict(decision.details["evaluations"])
            version = _register(
                client, settings, model_name, checkpoint, record, evaluations, decision, staged
            )
            now = registered_champion(client, model_name)
            if (str(now.version) if now else None) != previous:
                # Another promotion crowned a version after this one was compared against
                # `previous`: moving the alias now would skip the comparison with it.
                return ledger.record_promotion(
                    _champion_changed(record, model_name, previous, now, version)
                )
            client.set_registered_model_alias(model_name, CHAMPION_ALIAS, version)
        # What serving verifies before it loads a byte of this version.
        vouched = serving_manifest(staged)

    return ledger.record_promotion(
        dataclasses.replace(
            record,
            decision=str(PromotionDecision.PROMOTED),
            model_version=str(version),
            previous_champion_version=previous,
            decided_at=utcnow(),
            serving_manifest=vouched,
        )
    )


def _with_reevaluation(
    decision: GateDecision, reevaluation: dict[str, Any] | None, previous: str | None
) -> GateDecision:
    """The decision with what was done to give the champion a baseline, and why it failed."""
    reasons = list(decision.reasons)
    if reevaluation is not None and not reevaluation["evaluated"]:
        reasons.append(
            f"champion version {previous} could not be evaluated on the candidate's task set: "
            f"{reevaluation['reason']}"
        )
    details = {**decision.details, "champion_reevaluation": reevaluation, "reasons": reasons}
    return dataclasses.replace(decision, passed=not reasons, reasons=reasons, details=details)


def _champion_changed(
    record: PromotionRecord,
    model_name: str,
    compared: str | None,
    now: ModelVersion | None,
    version: str,
) -> PromotionRecord:
    current = f"version {now.version}" if now is not None else "no version"
    against = f"version {compared}" if compared else "no champion"
    reason = (
        f"Refused: the champion of {model_name} changed during the promotion (compared against "
        f"{against}, now {current}); registered version {version} was not made champion. "
        f"Re-run the promotion to compare against the current champion."
    )
    gate = {**record.gate, "reasons": [*record.gate.get("reasons", []), reason]}
    return dataclasses.replace(record, reason=reason, gate=gate, decided_at=utcnow())


class UnvouchedCheckpointError(Exception):
    """A checkpoint the ledger does not record as committed with the bytes on disk."""


def _require_ledger_committed(ledger: Ledger, checkpoint: CommittedCheckpoint, run_id: str) -> None:
    # A directory that verifies against its own MANIFEST.json proves only self-consistency:
    # promotion needs the ledger's word that training committed exactly these bytes.
    try:
        row = ledger.get_checkpoint(checkpoint.path)
    except LookupError:
        row = None
    if row is None or row.run_id != run_id:
        raise UnvouchedCheckpointError(
            f"checkpoint {checkpoint.path} is not a checkpoint of run {run_id} in the ledger"
        )
    if row.state != "committed" or row.manifest_sha256 != checkpoint.manifest_sha256:
        raise UnvouchedCheckpointError(
            f"checkpoint {checkpoint.path}: the ledger records it {row.state} with manifest "
            f"{(row.manifest_sha256 or '—')[:16]}, the directory holds "
            f"{checkpoint.manifest_sha256[:16]}; only what training committed is promoted"
        )


def _champion_manifest_sha(
    ledger: Ledger, model_name: str, champion: ModelVersion | None
) -> str | None:
    if champion is None:
        return None
    row = promotion_for_version(ledger, model_name, str(champion.version))
    if row is not None:
        return row.checkpoint_manifest_sha256
    return champion.tags.get("checkpoint_manifest_sha256")


def _register(
    client: MlflowClient,
    settings: TracksSettings,
    model_name: str,
    checkpoint: CommittedCheckpoint,
    record: PromotionRecord,
    evaluations: dict[str, str],
    decision: GateDecision,
    staged: StagedServedFiles,
) -> str:
    """Log the checkpoint as a models-from-code pyfunc and register a tagged model version."""
    import mlflow

    from pipeline.mlflow_setup import PROMOTION_EXPERIMENT, get_or_create_experiment
    from pipeline.serving import MODEL_CODE_PATH

    tags: dict[str, str] = {
        "promotion_id": record.promotion_id,
        "run_id": record.run_id,
        "attempt_no": str(record.attempt_no),
        "checkpoint_path": checkpoint.path,
        "checkpoint_step": str(checkpoint.step),
        "checkpoint_manifest_sha256": checkpoint.manifest_sha256,
        "snapshot_id": record.snapshot_id,
        "evaluation_ids": ",".join(evaluations.values()),
        **{f"evaluation.{name}": evaluation_id for name, evaluation_id in evaluations.items()},
    }
    if record.previous_champion_version:
        tags["previous_champion_version"] = record.previous_champion_version
    if record.dagster_run_id:
        tags["dagster_run_id"] = record.dagster_run_id
    from pipeline.tracking import TRAINING_RUN_TAG, training_run_of

    if training := training_run_of(client, record.run_id):
        tags[TRAINING_RUN_TAG] = training

    experiment_id = get_or_create_experiment(client, settings, PROMOTION_EXPERIMENT)
    with mlflow.start_run(
        experiment_id=experiment_id,
        run_name=f"promote {model_name} {record.run_id}#{record.attempt_no}",
        tags=tags,
    ) as run:
        mlflow.log_dict(decision.details, "gate.json")
        with _quiet("mlflow.pyfunc"):
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=str(MODEL_CODE_PATH),
                artifacts={
                    "weights": str(staged.weights),
                    "trainer_state": str(staged.trainer_state),
                },
                pip_requirements=_pip_requirements(),
                # No signature: with one, MLflow would refuse the ndarray input predict() takes.
            )
    _ensure_registered_model(client, model_name)
    version = client.create_model_version(
        name=model_name,
        source=info.model_uri,
        run_id=run.info.run_id,
        tags=tags,
        description=decision.summary(),
        model_id=info.model_id,
    )
    return str(version.version)


def _ensure_registered_model(client: MlflowClient, model_name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(
            model_name, description="Digits classifier promoted by Tracks; see tag run_id."
        )
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    # log_model warns on every call that it cannot infer a signature; we log none on purpose.
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _pip_requirements() -> list[str]:
    # Pinned to what this process runs; the Tracks package itself comes with the image.
    return [f"{name}=={metadata.version(name)}" for name in _SERVING_REQUIREMENTS]
