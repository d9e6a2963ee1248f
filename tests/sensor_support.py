"""Evaluating the resume sensor once, as Dagster's daemon would, against a real ledger; and the
ended attempt it is evaluated on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import sqlalchemy as sa

from pipeline.ledger import AttemptStart, Ledger
from pipeline.ledger.schema import training_attempts
from pipeline.retry import RetryPolicy, decide, policy_for_run, record_decision
from pipeline.states import RunStatus, TerminationReason
from resources import LedgerResource, StorageResource
from sensors.resume import resume_after_preemption

SNAPSHOT = "digits-00000000000000aa"


class LoggedLines(logging.Handler):
    """The messages a sensor logged, to check what it said about a run it did not launch."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def resume_tick(
    ledger: Ledger,
    *,
    partitions: tuple[str, ...] = (SNAPSHOT,),
    root: Path | None = None,
    dagster_runs: Sequence[dg.DagsterRun] = (),
    logged: list[str] | None = None,
) -> dg.SensorResult | dg.SkipReason:
    root = root or Path(ledger.url.removeprefix("sqlite:///")).parent / "tracks"
    storage = StorageResource(
        landing_root=str(root / "landing"), snapshot_root=str(root / "snapshots"),
        checkpoint_root=str(root / "checkpoints"), work_root=str(root / "work"),
    )  # fmt: skip
    with dg.instance_for_test() as instance:
        # Runs launched through Dagster train on a snapshot that is a partition already.
        instance.add_dynamic_partitions("snapshots", list(partitions))
        for run in dagster_runs:  # the Dagster runs that ran earlier attempts
            instance.add_run(run)
        # Entered and left inside the instance's block: a context left to the garbage collector
        # exits the instance late and puts its state storage back for whichever test runs next.
        with dg.build_sensor_context(
            instance=instance,
            resources={"ledger": LedgerResource(url=ledger.url), "storage": storage},
        ) as context:
            lines = LoggedLines()
            context.log.addHandler(lines)
            try:
                return resume_after_preemption(context)
            finally:
                context.log.removeHandler(lines)
                if logged is not None:
                    logged.extend(lines.lines)


def ended_attempt(
    ledger: Ledger,
    reason: TerminationReason,
    *,
    policy: RetryPolicy | None = None,
    run_id: str = "r1",
    placement: dict[str, Any] | None = None,
    dagster_run_id: str | None = None,
) -> None:
    """Run ``run_id`` on the digits partition, its attempt 1 ended with ``reason`` and the retry
    policy's decision recorded on it (the run failed where the decision stops it)."""
    ledger.create_run(
        run_id=run_id, model_family="digits-cnn", owner="t", purpose="baseline",
        config_sha256="c" * 64, snapshot_id=SNAPSHOT,
        retry_policy=(policy or RetryPolicy()).to_json(),
    )  # fmt: skip
    ledger.begin_attempt(
        run_id,
        AttemptStart(
            config_snapshot={"max_steps": 10}, config_sha256="c" * 64,
            data_manifest_sha256="d" * 64, container_digest="env", placement=placement or {},
            dagster_run_id=dagster_run_id,
        ),
    )  # fmt: skip
    ended = ledger.end_attempt(run_id, 1, termination_reason=reason, termination_detail="test")
    run = ledger.get_run(run_id)
    decision = decide(policy_for_run(run), ledger.attempts(run_id), ended)
    record_decision(ledger, ended, decision)
    if not decision.continues:
        ledger.set_run_status(run_id, RunStatus.FAILED)


def silent_attempt(
    ledger: Ledger,
    *,
    run_id: str = "r1",
    snapshot_id: str = SNAPSHOT,
    silent_for: timedelta = timedelta(hours=1),
    dagster_run_id: str | None = None,
) -> None:
    """Run ``run_id`` with its attempt 1 still open and its last heartbeat ``silent_for`` ago."""
    ledger.create_run(
        run_id=run_id, model_family="digits-cnn", owner="t", purpose="baseline",
        config_sha256="c" * 64, snapshot_id=snapshot_id,
    )  # fmt: skip
    ledger.begin_attempt(
        run_id,
        AttemptStart(
            config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
            container_digest="env", placement={}, dagster_run_id=dagster_run_id,
        ),
    )  # fmt: skip
    with ledger.engine.begin() as conn:
        conn.execute(
            sa.update(training_attempts)
            .where(training_attempts.c.run_id == run_id)
            .values(heartbeat_at=datetime.now(UTC) - silent_for)
        )
