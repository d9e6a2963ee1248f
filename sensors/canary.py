"""The ``canary`` job and :func:`run_canary`: real data and real config under strict limits.

CI runs it (``tracks canary``). The verdict fails unless the loss falls, a checkpoint is
committed and restores in a new process, evaluation produces complete provenance, and the whole
run stays within its minutes. It is read from the asset checks that run with every training
run, so the canary proves the checks as well as the pipeline. It never promotes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from assets.checks import LOSS_FALLS, PROVENANCE_COMPLETE, RESTORES_IN_NEW_PROCESS
from assets.partitions import snapshot_partitions
from pipeline import redact

CANARY_ASSETS = ("data_snapshot", "training_attempt", "committed_checkpoint", "evaluation")
CANARY_LANDING_FILE = "canary-digits.parquet"
DEFAULT_MAX_STEPS = 120
DEFAULT_MAX_MINUTES = 5.0
# The trainer gets this share of the minutes; the rest is for snapshot, checks and evaluation.
TRAINING_SHARE_OF_MINUTES = 0.6
MAX_RUNTIME_TAG = "dagster/max_runtime"

# A canary is never continued: whatever ends its attempt, the verdict is the answer.
CANARY_RETRY_POLICY = """\
retry_policy:
  preempted: {max_attempts: 0}
  infra_transient: {max_attempts: 0}
  oom: {max_attempts: 0}
  diverged: {max_attempts: 0}
  timeout: {max_attempts: 0}
"""

# Named canary_job so that ``sensors.canary`` stays this module, not the job.
canary_job = dg.define_asset_job(
    "canary",
    # Selecting the assets selects their checks too: the snapshot's contract and quality
    # checks, loss_falls, restores_in_new_process and provenance_complete.
    selection=dg.AssetSelection.assets(*CANARY_ASSETS),
    tags={
        MAX_RUNTIME_TAG: str(int(DEFAULT_MAX_MINUTES * 60)),
        "tracks/purpose": "canary",
        "tracks/launched_by": "canary",
    },
    description=(
        "Snapshot → checks → train (few steps) → committed checkpoint → restore in a new "
        "process → evaluate → provenance. No promotion."
    ),
)


@dataclass(frozen=True)
class CanaryCondition:
    """One thing the canary must prove, with the figures that decided it."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class CanaryVerdict:
    """The canary's answer: every condition, and where to look (Dagster run, ledger run)."""

    conditions: tuple[CanaryCondition, ...]
    dagster_run_id: str
    snapshot_id: str
    run_id: str | None
    seconds: float
    max_seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.conditions)

    @property
    def failed(self) -> list[CanaryCondition]:
        return [c for c in self.conditions if not c.passed]

    def summary(self) -> str:
        if self.passed:
            return f"canary passed: {len(self.conditions)} conditions in {self.seconds:.1f} s"
        return "canary failed: " + "; ".join(f"{c.name}: {c.detail}" for c in self.failed)

    def lines(self) -> list[str]:
        """The verdict as a person reads it in a CI log: one line per condition."""
        head = (
            f"canary {'PASSED' if self.passed else 'FAILED'} in {self.seconds:.1f} s "
            f"(limit {self.max_seconds:.0f} s): Dagster run {self.dagster_run_id}, "
            f"snapshot {self.snapshot_id}, run {self.run_id or '(none)'}"
        )
        width = max(len(c.name) for c in self.conditions)
        return [head] + [
            f"  {'pass' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.detail}"
            for c in self.conditions
        ]


def canary_landing_dir(home: Path) -> Path:
    return home / "canary" / "landing"


def canary_run_config(
    *,
    landing_dir: Path,
    max_steps: int,
    max_minutes: float,
    training: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run config of the canary job: the real training config, with canary limits
    (``training``: more ``train`` keys, TrainConfig's)."""
    training_config: dict[str, Any] = {
        "purpose": "canary",
        "retry_policy": CANARY_RETRY_POLICY,
        "train": {
            "max_steps": max_steps,
            "checkpoint_every_steps": max(1, max_steps // 4),
            "max_wall_seconds": max_minutes * 60 * TRAINING_SHARE_OF_MINUTES,
            **(training or {}),
        },
    }
    return {
        "ops": {
            "data_snapshot": {"config": {"landing_dir": str(landing_dir)}},
            "training_attempt": {"config": training_config},
        }
    }


def run_canary(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    *,
    max_steps: int = DEFAULT_MAX_STEPS,
    max_minutes: float = DEFAULT_MAX_MINUTES,
    landing_dir: Path | None = None,
    training: Mapping[str, Any] | None = None,
) -> CanaryVerdict:
    """Land real data if needed, run the ``canary`` job in-process, and judge it.

    The data lands as its own file (``canary-digits.parquet``) under ``$TRACKS_HOME/canary``, so
    the canary has its own snapshot partition and never becomes the newest checkpoint of a
    production snapshot. ``training`` sets more ``train`` keys (drills, tests).
    """
    from pipeline.data.landing import landing_files, write_digits_landing
    from pipeline.data.snapshot import snapshot_id_for
    from pipeline.settings import TracksSettings

    if max_steps < 1 or max_minutes <= 0:
        raise ValueError(
            f"max_steps must be >= 1 and max_minutes > 0, got {max_steps}, {max_minutes}"
        )
    started = time.monotonic()
    landing = landing_dir or canary_landing_dir(TracksSettings.from_env().home)
    if not landing_files(landing):
        write_digits_landing(landing, file_name=CANARY_LANDING_FILE)
    snapshot_id = snapshot_id_for(landing)
    if not instance.has_dynamic_partition(snapshot_partitions.name, snapshot_id):
        instance.add_dynamic_partitions(snapshot_partitions.name, [snapshot_id])

    max_seconds = max_minutes * 60
    result = defs.resolve_job_def(canary_job.name).execute_in_process(
        instance=instance,
        partition_key=snapshot_id,
        run_config=canary_run_config(
            landing_dir=landing, max_steps=max_steps, max_minutes=max_minutes, training=training
        ),
        # Enforced by the daemon's run monitoring when launched from the UI or a sensor; in
        # process, the trainer's max_wall_seconds and the elapsed-time condition bound it.
        tags={
            MAX_RUNTIME_TAG: str(int(max_seconds)),
            "tracks/purpose": "canary",
            "tracks/launched_by": "canary",
        },
        raise_on_error=False,
    )
    seconds = time.monotonic() - started
    return judge(result, defs, snapshot_id=snapshot_id, seconds=seconds, max_seconds=max_seconds)


def judge(
    result: dg.ExecuteInProcessResult,
    defs: dg.Definitions,
    *,
    snapshot_id: str,
    seconds: float,
    max_seconds: float,
) -> CanaryVerdict:
    """The canary's conditions, read from the run's check evaluations and materializations."""
    failures = _step_failures(result)
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}

    def why_not_run(*steps: str) -> str:
        for step in steps:
            if step in failures:
                return f"not evaluated: step {step} failed: {failures[step]}"
        return "not evaluated in this run: is the check in the canary job?"

    def from_check(name: str, asset: str) -> CanaryCondition:
        evaluation = checks.get(name)
        if evaluation is None:
            return CanaryCondition(name, False, why_not_run("data_snapshot", asset))
        return CanaryCondition(name, evaluation.passed, evaluation.description or "")

    conditions = [
        CanaryCondition(
            "run_succeeded",
            result.success,
            f"every step of Dagster run {result.run_id} succeeded"
            if result.success
            else "; ".join(f"step {step} failed: {message}" for step, message in failures.items())
            or f"Dagster run {result.run_id} did not succeed",
        ),
        from_check(LOSS_FALLS, "training_attempt"),
        _checkpoint_committed(result, why_not_run),
        from_check(RESTORES_IN_NEW_PROCESS, "committed_checkpoint"),
        from_check(PROVENANCE_COMPLETE, "evaluation"),
        CanaryCondition(
            "within_minutes",
            seconds <= max_seconds,
            f"{seconds:.1f} s of {max_seconds:.0f} s",
        ),
    ]
    return CanaryVerdict(
        conditions=tuple(conditions),
        dagster_run_id=result.run_id,
        snapshot_id=snapshot_id,
        run_id=_ledger_run_id(defs, result.run_id),
        seconds=round(seconds, 3),
        max_seconds=max_seconds,
    )


def _checkpoint_committed(result: dg.ExecuteInProcessResult, why_not_run: Any) -> CanaryCondition:
    name = "checkpoint_committed"
    materialized = result.asset_materializations_for_node("committed_checkpoint")
    if not materialized:
        return CanaryCondition(name, False, why_not_run("training_attempt", "committed_checkpoint"))
    meta = {k: v.value for k, v in materialized[-1].metadata.items()}
    return CanaryCondition(
        name,
        True,
        f"step {meta.get('step')} of run {meta.get('run_id')} at {meta.get('path')} "
        f"(manifest {str(meta.get('manifest_sha256'))[:12]})",
    )


def _step_failures(result: dg.ExecuteInProcessResult) -> dict[str, str]:
    failures: dict[str, str] = {}
    for event in result.all_events:
        if event.is_step_failure and event.step_key and event.step_failure_data:
            error = event.step_failure_data.error
            user = event.step_failure_data.user_failure_data
            message = (user.description if user and user.description else None) or (
                error.message.strip() if error else "no message"
            )
            failures[event.step_key] = redact.one_line(message)[:600]
    return failures


def _ledger_run_id(defs: dg.Definitions, dagster_run_id: str) -> str | None:
    ledger = (defs.resources or {}).get("ledger")
    if ledger is None:
        return None
    attempts = ledger.ledger().attempts_for_dagster_run(dagster_run_id)
    return attempts[0].run_id if attempts else None
