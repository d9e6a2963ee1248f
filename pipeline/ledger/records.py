"""Frozen records read from and written to the ledger: the attempt receipt and its neighbours."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any, Self


def as_utc(value: Any) -> Any:
    # SQLite hands back naive datetimes; everything the ledger writes is UTC.
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


class _Record:
    @classmethod
    def from_row(cls, row: Any) -> Self:
        mapping = row._mapping
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: as_utc(v) for k, v in mapping.items() if k in names})


@dataclass(frozen=True)
class RunRecord(_Record):
    run_id: str
    model_family: str
    owner: str
    purpose: str
    config_sha256: str
    snapshot_id: str
    code_commit: str | None
    created_at: datetime
    status: str
    fencing_token: int
    retry_policy: dict[str, Any] | None = None


@dataclass(frozen=True)
class AttemptRecord(_Record):
    run_id: str
    attempt_no: int
    model_family: str
    dagster_run_id: str | None
    started_at: datetime
    heartbeat_at: datetime | None
    ended_at: datetime | None
    status: str
    termination_reason: str | None
    termination_detail: str | None
    exit_code: int | None
    signal: str | None
    config_snapshot: dict[str, Any]
    config_sha256: str
    data_manifest_sha256: str
    container_digest: str
    placement: dict[str, Any]
    code_commit: str | None
    gpu_seconds: float
    cpu_seconds: float
    last_step: int | None
    resumed_from_checkpoint: str | None
    fencing_token: int
    retry_decision: dict[str, Any] | None
    attempt_uid: str | None = None
    # Evidence of who or what launched the attempt: {"via": "sensor"|"schedule"|"ui"|"cli"|...,
    # "name": sensor/schedule/user, "dagster_run_id": ...}.
    launched_by: dict[str, Any] | None = None
    # Which rule let it start: the retry decision it continues, or a person's relaunch.
    admission: dict[str, Any] | None = None
    restored_step: int | None = None  # the step its checkpoint restored (0: fresh start)
    timings: dict[str, Any] | None = None  # what each clock measured, in seconds
    # The loss-spike detector's settings and the lineage's history (pipeline/trainer/spikes.py):
    # what the restored checkpoint carried, then every spike this attempt saw, with totals.
    health: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        return f"{self.run_id}#{self.attempt_no}"


@dataclass(frozen=True)
class CheckpointRecord(_Record):
    path: str
    run_id: str
    attempt_no: int
    step: int
    manifest_sha256: str | None
    state: str
    state_detail: str | None
    bytes: int | None
    created_at: datetime
    committed_at: datetime | None
    metrics: dict[str, Any] | None
    parent_path: str | None
    fencing_token: int


@dataclass(frozen=True)
class EvaluationRecord(_Record):
    evaluation_id: str
    run_id: str
    attempt_no: int
    checkpoint_path: str
    checkpoint_manifest_sha256: str
    evaluator_name: str
    evaluator_version: str
    evaluator_env_digest: str
    task_set_version: str
    decoding_params: dict[str, Any]
    judge_model: str
    rubric_version: str
    status: str
    started_at: datetime
    termination_reason: str | None = None
    detail: str | None = None
    metrics: dict[str, Any] | None = None
    slice_metrics: dict[str, Any] | None = None
    raw_outputs_uri: str | None = None
    # sha256 of the raw outputs file as logged: promotion verifies what it loads against it.
    raw_outputs_sha256: str | None = None
    failures_uri: str | None = None
    mlflow_run_id: str | None = None
    dagster_run_id: str | None = None
    ended_at: datetime | None = None
    # The loss-spike history the checkpoint's verified trainer state carries (settings, events,
    # totals: spikes, skipped_updates, rollbacks, stops, skipped_batches); None for a checkpoint
    # written without a detector. pipeline/evaluation/health.py.
    training_health: dict[str, Any] | None = None
    # What a text-lm evaluator recorded as the inputs of its figures (prompt set, template,
    # decoding, seed, judge, contamination, ...): pipeline/textlm/evaluators.py. None for digits.
    provenance: dict[str, Any] | None = None

    # Provenance fields that must be present and non-empty for a promotion to count this row.
    PROVENANCE_FIELDS = (
        "checkpoint_manifest_sha256",
        "evaluator_name",
        "evaluator_version",
        "evaluator_env_digest",
        "task_set_version",
        "decoding_params",
        "judge_model",
        "rubric_version",
        "raw_outputs_uri",
        "failures_uri",
        "metrics",
        "slice_metrics",
        "mlflow_run_id",
    )

    def missing_provenance(self) -> list[str]:
        """Names of provenance fields that are empty on this row."""
        return [name for name in self.PROVENANCE_FIELDS if getattr(self, name) in (None, "", {})]


@dataclass(frozen=True)
class PromotionRecord(_Record):
    promotion_id: str
    run_id: str
    attempt_no: int
    checkpoint_path: str
    checkpoint_manifest_sha256: str
    snapshot_id: str
    decision: str
    reason: str
    evaluation_ids: list[str]
    gate: dict[str, Any]
    model_name: str
    decided_at: datetime
    model_version: str | None = None
    previous_champion_version: str | None = None
    serving_manifest: dict[str, Any] | None = None
    dagster_run_id: str | None = None


@dataclass(frozen=True)
class CostRow:
    """One line of the cost question: attempts, GPU- and CPU-hours per termination reason."""

    termination_reason: str | None  # None while an attempt is still running
    attempts: int
    gpu_hours: float
    cpu_hours: float = 0.0  # process CPU time of the trainer: on a CPU run, where the time went


@dataclass(frozen=True)
class AttemptStart:
    """What the orchestrator (or a standalone trainer) knows when an attempt begins."""

    config_snapshot: dict[str, Any]
    config_sha256: str
    data_manifest_sha256: str
    container_digest: str
    placement: dict[str, Any] = field(default_factory=dict)
    dagster_run_id: str | None = None
    code_commit: str | None = None
    resumed_from_checkpoint: str | None = None
    launched_by: dict[str, Any] | None = None
    admission: dict[str, Any] | None = None


@dataclass(frozen=True)
class SnapshotRecord(_Record):
    """A data snapshot as the ledger knows it, and the verdict of its blocking checks."""

    snapshot_id: str
    manifest_sha256: str
    created_at: datetime
    verdict: str  # passed | blocked | unchecked, for this exact manifest digest
    content_sha256: str | None = None
    rows: int | None = None
    source: str | None = None
    verdict_at: datetime | None = None
    dagster_run_id: str | None = None


@dataclass(frozen=True)
class SnapshotCheckRecord(_Record):
    """One check run on one exact manifest."""

    snapshot_id: str
    manifest_sha256: str
    check_name: str
    blocking: bool
    passed: bool
    checked_at: datetime
    detail: dict[str, Any] | None = None
    dagster_run_id: str | None = None


@dataclass(frozen=True)
class NoteRecord(_Record):
    """One logbook entry: a person's note on a run (``attempt_no`` None) or on one attempt.

    Only ever added, never edited: why a learning rate changed, why a run was restarted.
    """

    note_id: int  # rises with every note in this ledger: "note 7"
    run_id: str
    author: str  # who wrote it: ``--author``, the OS user, or who launched the Dagster run
    source: str  # where it was written: "cli", "dagster launch <Dagster run id>", ...
    created_at: datetime
    text: str  # stripped, at most 2000 characters, URL passwords masked
    attempt_no: int | None = None
    note_uid: str | None = None

    @property
    def target(self) -> str:
        """``RUN`` or ``RUN#N``: what the note is on, as ``tracks note`` and ``explain`` name it."""
        return self.run_id if self.attempt_no is None else f"{self.run_id}#{self.attempt_no}"
