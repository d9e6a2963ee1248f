"""Promotion: gate a committed checkpoint, register it in MLflow and move the ``champion`` alias.

Before the gate, a candidate whose model weights are byte-identical to the champion's (the
digest of ``model.safetensors`` in the two committed manifests: the same snapshot, config and
code train bit-identical weights on CPU) is recorded ``unchanged``, "identical to the champion
(version N, run R)": no new model version, the alias stays where it is. Retraining on data that
did not change so leaves the registry as it was, and the ledger says why.

Before the gate, too, a champion with no evaluation the headline comparison can pair with the
candidate's (same task set, same evaluator version, digested raw outputs) is evaluated on the
promotion's snapshot (see ``baseline``).

Order of writes on a pass: the served model, logged as an MLflow model (signature, input
example) into the candidate's TRAINING run (``runs:/<training run>/model``), then the model
version registered from it (tagged back to run, attempt, checkpoint, snapshot and
evaluations), then the alias (only if the champion is still the version the gate compared
against), then the ledger row. A crash between the alias and the ledger is repaired by the next
call: the alias already points at this checkpoint, so the version is reused instead of
registered twice; a crash before the alias leaves a logged model the next call reuses.
"""

from __future__ import annotations

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
    from collections.abc import Sequence

    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from pipeline.ledger import EvaluationRecord, Ledger
    from pipeline.serving.champion import StagedServedFiles
    from pipeline.serving.loading import CommittedCheckpoint
    from pipeline.settings import TracksSettings

log = logging.getLogger(__name__)

# The model family a registered model (and each of its versions) holds.
FAMILY_TAG = "tracks.model_family"

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
    model_name: str | None = None,
    gate: QualityGate | None = None,
    dagster_run_id: str | None = None,
    required: Sequence[str] | None = None,
) -> PromotionRecord:
    """Gate the checkpoint and, on a pass, make it the champion; record the decision either way.

    A refusal is recorded and returned, not raised: its ``reason`` names what failed.
    The run's model family (the ledger's) decides the defaults: ``model_name`` its registered
    model, ``gate`` its gate and ``required`` its required evaluators
    (``pipeline.promotion.families``). A champion of ``model_name`` of another family refuses.
    """
    from pipeline import ids
    from pipeline.evaluation.evaluators import required_evaluators
    from pipeline.mlflow_setup import mlflow_client
    from pipeline.promotion.families import gate_for_family, registered_model_name
    from pipeline.serving.loading import open_committed_checkpoint

    # Serving refuses a name ids.model_name refuses: promoting under one would crown a
    # champion nobody can load ("a/b" would fail in the registry after the model is logged).
    if model_name is not None:
        ids.model_name(model_name)
    ids.run_id(run_id)
    ids.snapshot_id(snapshot_id)
    family = ledger.get_run(run_id).model_family
    model_name = model_name if model_name is not None else registered_model_name(family)
    checkpoint = open_committed_checkpoint(checkpoint_dir)
    _require_ledger_committed(ledger, checkpoint, run_id)
    required = list(required) if required is not None else required_evaluators(family)
    client = mlflow_client(settings)

    champion = registered_champion(client, model_name)
    # The SQL registry hands versions back as ints; the ledger and tags hold strings.
    previous = str(champion.version) if champion else None
    champion_sha = _champion_manifest_sha(ledger, model_name, champion)
    gate = gate or gate_for_family(family)
    candidate_evaluations = ledger.evaluations_for_checkpoint(checkpoint.manifest_sha256)
    champion_row = promotion_for_version(ledger, model_name, previous) if previous else None
    other_family = _other_family(ledger, client, model_name, champion_row, family)
    reevaluation = None
    if other_family is not None:
        # Refused below; nothing of another family's champion is compared or re-evaluated.
        champion, champion_sha, champion_row, previous = None, None, None, None
    if champion_row is not None and champion_sha != checkpoint.manifest_sha256:
        # Weights identical to the champion's: nothing to gate, nothing to register.
        unchanged = _identical_to_champion(
            checkpoint,
            champion_row,
            candidate_evaluations,
            run_id=run_id,
            attempt_no=attempt_no,
            snapshot_id=snapshot_id,
            dagster_run_id=dagster_run_id,
        )
        if unchanged is not None:
            _tag_training_run(client, run_id, unchanged.reason)
            return ledger.record_promotion(unchanged)
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
    if other_family is not None:
        reasons = [
            f"{model_name} holds {other_family} models and run {run_id} trained a {family} "
            f"model; each family is promoted to its own registered model "
            f"({registered_model_name(family)} for {family})"
        ]
        decision = dataclasses.replace(
            decision,
            passed=False,
            reasons=reasons,
            details={**decision.details, "model_family": family, "reasons": reasons},
        )
    elif champion is not None and champion_sha is None:
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
        _tag_training_run(client, run_id, record.reason)
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
            previous = _version_tag(champion, "previous_champion_version")
        else:
            evaluations = dict(decision.details["evaluations"])
            version = _register(
                client,
                settings,
                model_name,
                checkpoint,
                record,
                evaluations,
                decision,
                staged,
                family,
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

    _tag_training_run(client, run_id, f"promoted: {model_name} version {version}")
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


def _other_family(
    ledger: Ledger,
    client: MlflowClient,
    model_name: str,
    champion_row: PromotionRecord | None,
    family: str,
) -> str | None:
    """The family ``model_name`` holds when it is not ``family`` (its champion's run's, or
    the registered model's ``tracks.model_family`` tag), else None."""
    from mlflow.exceptions import MlflowException

    from pipeline.ledger import UnknownRunError

    if champion_row is not None:
        try:
            held = ledger.get_run(champion_row.run_id).model_family
        except UnknownRunError:
            held = None
        if held is not None:
            return held if held != family else None
    try:
        tags = client.get_registered_model(model_name).tags
    except MlflowException:
        return None  # not registered yet: this promotion registers it for its family
    held = tags.get(FAMILY_TAG)
    return held if held not in (None, family) else None


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


def _identical_to_champion(
    checkpoint: CommittedCheckpoint,
    champion: PromotionRecord,
    candidate_evaluations: Sequence[EvaluationRecord],
    *,
    run_id: str,
    attempt_no: int,
    snapshot_id: str,
    dagster_run_id: str | None,
) -> PromotionRecord | None:
    """The ``unchanged`` record when the candidate's weights are the champion's, else None.

    Compares the digest of the model tensors file the candidate's committed manifest records
    with the one the champion's promotion vouched for (its serving manifest, taken from the
    champion's committed manifest). Equal tensors (names, shapes, dtypes, values) are the same
    model: the digits models differ otherwise only in dropout, which eval mode does not apply.
    A sharded checkpoint, an exported champion or digests in two algorithms are not compared
    (None): the gate and a new version follow as before.
    """
    from pipeline.promotion.gate import newest_complete
    from pipeline.serving.champion import committed_weights_digest

    served = (champion.serving_manifest or {}).get("files", {}).get("weights") or {}
    if not served or served.get("exported_from"):
        return None
    candidate = committed_weights_digest(checkpoint.path, checkpoint.manifest_sha256)
    if candidate is None or (candidate["algorithm"], candidate["digest"]) != (
        served.get("algorithm"),
        served.get("digest"),
    ):
        return None
    version = str(champion.model_version)
    reason = (
        f"Identical to the champion (version {version}, run {champion.run_id}): "
        f"{candidate['name']} has the same {candidate['algorithm']} {candidate['digest'][:16]} "
        f"as the weights promoted from {champion.run_id}#{champion.attempt_no}; no new version "
        f"of {champion.model_name} was registered and the {CHAMPION_ALIAS} alias stays on "
        f"version {version}."
    )
    evaluations = newest_complete(candidate_evaluations, checkpoint.manifest_sha256)
    return PromotionRecord(
        promotion_id=f"promo-{uuid.uuid4().hex[:12]}",
        run_id=run_id,
        attempt_no=attempt_no,
        checkpoint_path=checkpoint.path,
        checkpoint_manifest_sha256=checkpoint.manifest_sha256,
        snapshot_id=snapshot_id,
        decision=str(PromotionDecision.UNCHANGED),
        reason=reason,
        evaluation_ids=[e.evaluation_id for e in evaluations.values()],
        gate={
            "identical_to_champion": {
                "model_version": version,
                "run_id": champion.run_id,
                "attempt_no": champion.attempt_no,
                "promotion_id": champion.promotion_id,
                "checkpoint_manifest_sha256": champion.checkpoint_manifest_sha256,
                "weights": candidate,
            },
            "reasons": [],
        },
        model_name=champion.model_name,
        decided_at=utcnow(),
        # The version that serves these weights; the alias did not move.
        model_version=version,
        previous_champion_version=version,
        dagster_run_id=dagster_run_id,
    )


def _tag_training_run(client: MlflowClient, run_id: str, sentence: str) -> None:
    """The decision on the candidate's MLflow training run, for whoever reads it there."""
    from pipeline.tracking import PROMOTION_TAG, training_run_of

    try:
        if training := training_run_of(client, run_id):
            client.set_tag(training, PROMOTION_TAG, sentence[:5000])
    except Exception as exc:  # the ledger row is the record; this tag is a courtesy
        log.warning("MLflow training run of %s not tagged with its promotion: %s", run_id, exc)


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
    return _version_tag(champion, "checkpoint_manifest_sha256")


def _version_tag(version: ModelVersion, key: str) -> str | None:
    """Tag ``tracks.<key>`` of a model version; versions Tracks registered before its tags took
    the ``tracks.`` prefix carry it as plain ``<key>``."""
    return version.tags.get(f"tracks.{key}") or version.tags.get(key)


def _register(
    client: MlflowClient,
    settings: TracksSettings,
    model_name: str,
    checkpoint: CommittedCheckpoint,
    record: PromotionRecord,
    evaluations: dict[str, str],
    decision: GateDecision,
    staged: StagedServedFiles,
    family: str,
) -> str:
    """Log the served model into the candidate's training run and register a tagged version
    of that logged model (run id: the training run's).

    The version's source is the logged model (``models:/<model id>``), as MLflow 3 registers
    the models it logs itself. Its ``runs:/<training run>/model`` name is no source for a
    version: MLflow 3.17's registry resolves such a source by downloading the run's own
    ``model/`` folder first, and hands back the folder above the model when the run has none.
    """
    from pipeline.mlflow_setup import dagster_run_url
    from pipeline.tracking import TRAINING_EXPERIMENT, TRAINING_RUN_TAG, ensure_training_run

    tags: dict[str, str] = {
        "tracks.promotion_id": record.promotion_id,
        "tracks.run_id": record.run_id,
        "tracks.attempt_no": str(record.attempt_no),
        "tracks.checkpoint_path": checkpoint.path,
        "tracks.checkpoint_step": str(checkpoint.step),
        "tracks.checkpoint_manifest_sha256": checkpoint.manifest_sha256,
        "tracks.snapshot_id": record.snapshot_id,
        FAMILY_TAG: family,
        "tracks.evaluation_ids": ",".join(evaluations.values()),
        **{f"tracks.evaluation.{name}": evaluation for name, evaluation in evaluations.items()},
    }
    if record.previous_champion_version:
        tags["tracks.previous_champion_version"] = record.previous_champion_version
    if record.dagster_run_id:
        tags["tracks.dagster_run_id"] = record.dagster_run_id
        tags["tracks.dagster_run_url"] = dagster_run_url(record.dagster_run_id)
    location = (settings.mlflow_artifact_root / TRAINING_EXPERIMENT).resolve().as_uri()
    training = ensure_training_run(client, record.run_id, location)
    tags[TRAINING_RUN_TAG] = training
    # The gate's details in the training run, one folder per promotion.
    client.log_dict(training, decision.details, f"promotions/{record.promotion_id}/gate.json")
    model_id = _log_served_model(client, settings, training, checkpoint, record, staged, family)
    _ensure_registered_model(client, model_name, family)
    version = client.create_model_version(
        name=model_name,
        source=f"models:/{model_id}",
        run_id=training,
        tags=tags,
        description=decision.summary(),
        model_id=model_id,
    )
    return str(version.version)


def _log_served_model(
    client: MlflowClient,
    settings: TracksSettings,
    training: str,
    checkpoint: CommittedCheckpoint,
    record: PromotionRecord,
    staged: StagedServedFiles,
    family: str,
) -> str:
    """The served model as an MLflow model of the training run (``runs:/<run>/model``); its id.

    A models-from-code pyfunc (no pickle) with the staged, verified weights and trainer state,
    the signature and a real input example. A model this run already logged for this very
    checkpoint (an earlier promotion that stopped before the alias) is reused, so
    ``runs:/<run>/model`` names one model; another checkpoint of the same run is logged as
    ``model-step-<step>``.
    """
    import mlflow.pyfunc
    from mlflow.entities import LoggedModelStatus
    from mlflow.models import Model

    from pipeline.serving import model_code_path
    from pipeline.serving.signature import input_example, model_signature

    experiment_id = client.get_run(training).info.experiment_id
    mine = [
        m
        for m in client.search_logged_models([experiment_id], filter_string="name LIKE 'model%'")
        if m.source_run_id == training
    ]
    for logged in mine:
        same = logged.tags.get("tracks.checkpoint_manifest_sha256") == checkpoint.manifest_sha256
        if same and logged.status == LoggedModelStatus.READY:
            return logged.model_id
    name = "model" if not any(m.name == "model" for m in mine) else f"model-step-{checkpoint.step}"
    created = client.create_logged_model(
        experiment_id=experiment_id,
        name=name,
        source_run_id=training,
        params=client.get_run(training).data.params,  # the resolved training config
        tags={
            "tracks.run_id": record.run_id,
            "tracks.attempt_no": str(record.attempt_no),
            "tracks.checkpoint_path": checkpoint.path,
            "tracks.checkpoint_step": str(checkpoint.step),
            "tracks.checkpoint_manifest_sha256": checkpoint.manifest_sha256,
            "tracks.snapshot_id": record.snapshot_id,
        },
        model_type=family,
    )
    # Model.log with the model made above: it logs into the training run without making it the
    # process's active run (mlflow.start_run would end it FINISHED on the way out).
    Model.log(
        None,
        name=name,
        flavor=mlflow.pyfunc,
        flavor_name="pyfunc.ModelFromCode",
        model_id=created.model_id,
        run_id=training,
        python_model=str(model_code_path(family)),
        artifacts={"weights": str(staged.weights), "trainer_state": str(staged.trainer_state)},
        signature=model_signature(family),
        input_example=input_example(settings.snapshot_root, record.snapshot_id, family),
        pip_requirements=_pip_requirements(),
    )
    client.finalize_logged_model(created.model_id, LoggedModelStatus.READY)
    return created.model_id


def _ensure_registered_model(client: MlflowClient, model_name: str, family: str) -> None:
    from mlflow.exceptions import MlflowException

    what = {"text-lm": "Byte-level text model (prompt -> continuation)"}.get(
        family, "Digits classifier"
    )
    try:
        client.create_registered_model(
            model_name,
            tags={FAMILY_TAG: family},
            description=f"{what} promoted by Tracks; see tag run_id.",
        )
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise


def _pip_requirements() -> list[str]:
    # Pinned to what this process runs; the Tracks package itself comes with the image.
    return [f"{name}=={metadata.version(name)}" for name in _SERVING_REQUIREMENTS]
