"""``training_attempt`` runs the trainer through Pipes; ``committed_checkpoint`` verifies it."""

import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg

from assets.lineage import upstream_metadata
from assets.partitions import snapshot_partitions
from resources import LedgerResource, StorageResource, TrainerExit, TrainerLauncherResource


class TrainingConfig(dg.Config):
    """What to train. Defaults give a model that passes the quality gate in about a minute."""

    model_family: str = "digits-cnn"
    owner: str = "tracks"
    purpose: str = "baseline"
    run_id: str | None = None
    """Continue this existing run (a resume) instead of starting a new one."""
    seed: int = 0
    max_steps: int = 600
    batch_size: int = 64
    learning_rate: float = 0.003
    weight_decay: float = 0.0
    optimizer: str = "adam"
    checkpoint_every_steps: int = 100
    keep_last_k: int = 3
    channels: int = 16
    hidden: int = 64
    dropout: float = 0.0

    def train_config(self, snapshot_dir: Path) -> dict[str, Any]:
        """The resolved trainer config (the immutable ``config_snapshot`` of the attempt)."""
        return {
            "model_family": self.model_family,
            "seed": self.seed,
            "max_steps": self.max_steps,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
            "optimizer": self.optimizer,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "keep_last_k": self.keep_last_k,
            "model": {"channels": self.channels, "hidden": self.hidden, "dropout": self.dropout},
            "snapshot_dir": str(snapshot_dir),
        }


def new_run_id(model_family: str, snapshot_id: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{model_family}-{snapshot_id.split('-')[-1][:8]}-{stamp}-{secrets.token_hex(2)}"


def _step_messages(outcome: TrainerExit, kind: str) -> list[dict[str, Any]]:
    return [m for m in outcome.custom_messages if isinstance(m, dict) and m.get("event") == kind]


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=["data_snapshot"],
    group_name="training",
    kinds={"pytorch"},
    description="One attempt of a training run: the trainer process, launched through Pipes.",
)
def training_attempt(
    context: dg.AssetExecutionContext,
    config: TrainingConfig,
    ledger: LedgerResource,
    storage: StorageResource,
    trainer: TrainerLauncherResource,
) -> dg.MaterializeResult:
    import yaml

    from pipeline.data.snapshot import open_snapshot
    from pipeline.environment import code_commit, container_digest, placement
    from pipeline.ledger import AttemptStart
    from pipeline.reasons import classify_exit, read_last_words
    from pipeline.states import RunStatus, TerminationReason
    from pipeline.trainer.config import ConfigError, TrainConfig

    book = ledger.ledger()
    snapshot = open_snapshot(storage.snapshots() / context.partition_key)
    try:
        train_config = TrainConfig.from_dict(
            config.train_config(snapshot.path), source="run config of training_attempt"
        )
    except ConfigError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    # The trainer's own resolution (defaults filled in) is the config snapshot: the attempt row
    # and every checkpoint carry the same digest.
    resolved = train_config.to_dict()
    config_sha = train_config.sha256()

    if config.run_id:
        run = book.get_run(config.run_id)
    else:
        run = book.create_run(
            run_id=new_run_id(config.model_family, snapshot.snapshot_id),
            model_family=config.model_family,
            owner=config.owner,
            purpose=config.purpose,
            config_sha256=config_sha,
            snapshot_id=snapshot.snapshot_id,
            code_commit=code_commit(),
        )
    run_dir = storage.work_dir(run.run_id)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(resolved, sort_keys=True))

    resume_from = book.latest_committed_checkpoint(run.run_id)
    attempt = book.begin_attempt(
        run.run_id,
        AttemptStart(
            config_snapshot=resolved,
            config_sha256=config_sha,
            data_manifest_sha256=snapshot.manifest_sha256,
            container_digest=container_digest(),
            placement=placement(),
            dagster_run_id=context.run_id,
            code_commit=run.code_commit,
            resumed_from_checkpoint=resume_from.path if resume_from else None,
        ),
    )
    context.log.info(
        f"attempt {attempt.key} starts"
        + (f", resuming from {resume_from.path}" if resume_from else " from scratch")
    )
    args = [
        "--config", str(config_path),
        "--run-id", run.run_id,
        "--store", str(storage.checkpoints()),
        "--ledger-url", book.url,
        "--attempt-no", str(attempt.attempt_no),
        "--fencing-token", str(attempt.fencing_token),
    ]  # fmt: skip
    outcome: TrainerExit | None = None
    try:
        _, outcome = trainer.launch(context, args, extras={"run_id": run.run_id})
    finally:
        latest = book.latest_committed_checkpoint(run.run_id)
        if outcome is None:
            # The step itself was interrupted (run terminated from the UI): the launcher
            # already asked the trainer to save and stop.
            termination = classify_exit(
                returncode=-1, signal_name=None, last_words=None, cancelled=True,
                last_committed_step=latest.step if latest else None,
            )  # fmt: skip
            exit_code, signal_name = None, None
        else:
            last_words = read_last_words(
                storage.checkpoints() / run.run_id / f"attempt-{attempt.attempt_no}.last_words.json"
            )
            termination = classify_exit(
                returncode=outcome.returncode,
                signal_name=outcome.signal_name,
                last_words=last_words,
                last_committed_step=latest.step if latest else None,
            )
            exit_code, signal_name = outcome.returncode, outcome.signal_name
        ended = book.end_attempt(
            run.run_id,
            attempt.attempt_no,
            termination_reason=termination.reason,
            termination_detail=termination.detail,
            exit_code=exit_code,
            signal=signal_name,
            last_step=latest.step if latest else None,
            gpu_seconds=0.0,
            cpu_seconds=(datetime.now(UTC) - attempt.started_at).total_seconds(),
        )
        book.set_run_status(
            run.run_id,
            RunStatus.SUCCEEDED
            if termination.reason == TerminationReason.SUCCEEDED
            else RunStatus.RUNNING,
        )

    if termination.reason != TerminationReason.SUCCEEDED:
        raise dg.Failure(
            description=f"attempt {ended.key} ended {termination.reason}: {termination.detail}",
            metadata={
                "run_id": run.run_id,
                "attempt_no": attempt.attempt_no,
                "termination_reason": str(termination.reason),
                "exit_code": exit_code if exit_code is not None else -1,
            },
            allow_retries=False,
        )

    steps = _step_messages(outcome, "step") if outcome else []
    commits = _step_messages(outcome, "checkpoint_committed") if outcome else []
    metadata: dict[str, Any] = {
        "run_id": run.run_id,
        "attempt_no": attempt.attempt_no,
        "termination_reason": str(termination.reason),
        "config_sha256": config_sha,
        "snapshot_id": snapshot.snapshot_id,
        "data_manifest_sha256": snapshot.manifest_sha256,
        "resumed_from_checkpoint": resume_from.path if resume_from else "none",
        "checkpoints_committed": dg.MetadataValue.json(
            [{"step": c.get("step"), "path": c.get("path")} for c in commits]
        ),
        "config": dg.MetadataValue.json(resolved),
    }
    if steps:
        metadata["final_loss"] = float(steps[-1].get("loss", float("nan")))
        metadata["first_loss"] = float(steps[0].get("loss", float("nan")))
        metadata["examples_per_second"] = float(steps[-1].get("examples_per_second", 0.0))
        metadata["loss_curve"] = dg.MetadataValue.json(
            [{"step": s.get("step"), "loss": s.get("loss")} for s in steps]
        )
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=["training_attempt"],
    group_name="training",
    kinds={"safetensors"},
    description="The final committed checkpoint of the newest training run, verified on read.",
)
def committed_checkpoint(
    context: dg.AssetExecutionContext, ledger: LedgerResource
) -> dg.MaterializeResult:
    from pipeline.checkpoint import verify_checkpoint

    attempt_meta = upstream_metadata(context, "training_attempt", context.partition_key)
    run_id = attempt_meta["run_id"]
    book = ledger.ledger()
    checkpoint = book.latest_committed_checkpoint(run_id)
    if checkpoint is None:
        raise dg.Failure(f"run {run_id} has no committed checkpoint", allow_retries=False)
    verify_checkpoint(Path(checkpoint.path))
    lineage = [c.path for c in book.checkpoints(run_id)]
    return dg.MaterializeResult(
        metadata={
            "run_id": run_id,
            "attempt_no": checkpoint.attempt_no,
            "step": checkpoint.step,
            "path": dg.MetadataValue.path(checkpoint.path),
            "manifest_sha256": checkpoint.manifest_sha256 or "",
            "bytes": checkpoint.bytes or 0,
            "parent_checkpoint": checkpoint.parent_path or "none",
            "metrics": dg.MetadataValue.json(checkpoint.metrics or {}),
            "lineage": dg.MetadataValue.json(lineage),
        },
        data_version=dg.DataVersion(checkpoint.manifest_sha256 or checkpoint.path),
    )
