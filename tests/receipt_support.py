"""Shared set-up for the receipt tests: a real snapshot, a seeded ledger run, and
``training_attempt`` materialized on its own in-process, as the UI or a sensor launches it."""

from __future__ import annotations

from typing import Any

import dagster as dg

from definitions import build_definitions
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import Snapshot, create_snapshot
from pipeline.ledger import AttemptRecord, AttemptStart, Ledger
from pipeline.retry import RetryPolicy, decide, policy_for_run, record_decision
from pipeline.settings import TracksSettings
from pipeline.states import RunStatus, TerminationReason

# A run config that trains for a few seconds: the trainer is real, the model tiny.
SMALL = {
    "train": {"max_steps": 5, "checkpoint_every_steps": 5, "model": {"channels": 8, "hidden": 32}}
}


def make_snapshot(settings: TracksSettings) -> Snapshot:
    """A digits snapshot in the deployment's snapshot store."""
    settings.ensure_dirs()
    write_digits_landing(settings.landing_root)
    return create_snapshot(settings.landing_root, settings.snapshot_root)


def train_config_of(snapshot: Snapshot) -> dict[str, Any]:
    """The config an attempt of a small run records (what a continuation reuses): the
    asset's own for :data:`SMALL`, resolved as prepare_attempt records it."""
    from pipeline.trainer.config import TrainConfig

    raw = {**SMALL["train"], "snapshot_dir": str(snapshot.path)}
    return TrainConfig.from_dict(raw, source="test").to_dict()


def seed_ended_run(
    ledger: Ledger,
    snapshot: Snapshot,
    run_id: str,
    reason: TerminationReason,
    *,
    dagster_run_id: str | None,
    placement: dict[str, Any] | None = None,
    launched_by: dict[str, Any] | None = None,
) -> AttemptRecord:
    """A run whose one attempt ran in ``dagster_run_id`` and ended ``reason``, decided."""
    ledger.create_run(
        run_id=run_id, model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="a" * 64, snapshot_id=snapshot.snapshot_id,
        retry_policy=RetryPolicy().to_json(),
    )  # fmt: skip
    ledger.begin_attempt(
        run_id,
        AttemptStart(
            config_snapshot=train_config_of(snapshot), config_sha256="a" * 64,
            data_manifest_sha256=snapshot.manifest_sha256, container_digest="env:sha256:test",
            placement=placement or {"host": "test", "world_size": 1},
            dagster_run_id=dagster_run_id, launched_by=launched_by,
        ),
    )  # fmt: skip
    ended = ledger.end_attempt(
        run_id, 1, termination_reason=reason, termination_detail=f"the test ended it {reason}"
    )
    decision = decide(policy_for_run(ledger.get_run(run_id)), ledger.attempts(run_id), ended)
    record_decision(ledger, ended, decision)
    if not decision.continues:
        ledger.set_run_status(run_id, RunStatus.FAILED)
    return ledger.get_attempt(run_id, 1)


def train_alone(
    settings: TracksSettings,
    instance: dg.DagsterInstance,
    snapshot_id: str,
    training: dict[str, Any],
    tags: dict[str, str] | None = None,
) -> dg.ExecuteInProcessResult:
    """Materialize ``training_attempt`` alone for the partition, with these run config and
    tags (what the Launchpad, a sensor's request or a re-execution sends)."""
    if not instance.has_dynamic_partition("snapshots", snapshot_id):
        instance.add_dynamic_partitions("snapshots", [snapshot_id])
    return (
        build_definitions(settings)
        .resolve_implicit_global_asset_job_def()
        .execute_in_process(
            instance=instance,
            partition_key=snapshot_id,
            asset_selection=[dg.AssetKey("training_attempt")],
            run_config={"ops": {"training_attempt": {"config": training}}},
            tags=tags,
            raise_on_error=False,
        )
    )


def step_failure_message(result: dg.ExecuteInProcessResult) -> str:
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    return failure.event_specific_data.error.message


def ledger_of(settings: TracksSettings) -> Ledger:
    return Ledger.open(settings.ledger_url)
