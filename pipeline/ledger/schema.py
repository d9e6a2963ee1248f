"""Ledger tables. Alembic migrations under ``migrations/versions`` create and evolve them.

Every change here needs a new migration; ``tests/test_ledger.py`` fails when the two disagree.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

metadata = sa.MetaData()

# JSONB on PostgreSQL so receipts can be queried; plain JSON text on SQLite.
JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
UTCDateTime = sa.DateTime(timezone=True)

training_runs = sa.Table(
    "training_runs",
    metadata,
    sa.Column("run_id", sa.String(128), primary_key=True),
    sa.Column("model_family", sa.String(64), nullable=False),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("config_sha256", sa.String(64), nullable=False),
    sa.Column("snapshot_id", sa.String(128), nullable=False),
    sa.Column("code_commit", sa.String(64)),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    # Bumped by every new attempt; a checkpoint commit must carry the current value.
    sa.Column("fencing_token", sa.Integer, nullable=False, server_default="0"),
    sa.Column("retry_policy", JSONType),
    sa.Index("ix_training_runs_snapshot", "snapshot_id", "model_family", "created_at"),
)

training_attempts = sa.Table(
    "training_attempts",
    metadata,
    sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), primary_key=True),
    sa.Column("attempt_no", sa.Integer, primary_key=True),
    # Denormalised from the run so the seed question runs on this table alone.
    sa.Column("model_family", sa.String(64), nullable=False),
    sa.Column("dagster_run_id", sa.String(64)),
    sa.Column("started_at", UTCDateTime, nullable=False),
    sa.Column("heartbeat_at", UTCDateTime),
    sa.Column("ended_at", UTCDateTime),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("termination_reason", sa.String(32)),
    sa.Column("termination_detail", sa.Text),
    sa.Column("exit_code", sa.Integer),
    sa.Column("signal", sa.String(16)),
    sa.Column("config_snapshot", JSONType, nullable=False),
    sa.Column("config_sha256", sa.String(64), nullable=False),
    sa.Column("data_manifest_sha256", sa.String(64), nullable=False),
    sa.Column("container_digest", sa.String(80), nullable=False),
    sa.Column("placement", JSONType, nullable=False),
    sa.Column("code_commit", sa.String(64)),
    sa.Column("gpu_seconds", sa.Float, nullable=False, server_default="0"),
    sa.Column("cpu_seconds", sa.Float, nullable=False, server_default="0"),
    sa.Column("last_step", sa.Integer),
    sa.Column("resumed_from_checkpoint", sa.String(512)),
    sa.Column("fencing_token", sa.Integer, nullable=False),
    sa.Column("retry_decision", JSONType),
    # One uid per begin_attempt call: a retried transaction that already committed is found by
    # it instead of opening a second attempt.
    sa.Column("attempt_uid", sa.String(36), unique=True),
    # Evidence of who launched the attempt (sensor, schedule, UI, CLI, canary, with the Dagster
    # run id and tags) and which rule allowed it (retry policy decision or a person's relaunch).
    sa.Column("launched_by", JSONType),
    sa.Column("admission", JSONType),
    # The step the checkpoint restored at start; ``last_step`` is the step reached (never lowered).
    sa.Column("restored_step", sa.Integer),
    # What each clock measured: receipt (start to end), trainer process, setup, training loop.
    sa.Column("timings", JSONType),
    # The loss-spike detector's settings and the lineage's spike history (migration 0007).
    sa.Column("health", JSONType),
    # The cost question filters on family and time and sums by reason: an index that covers it.
    sa.Index(
        "ix_training_attempts_family_started",
        "model_family",
        "started_at",
        "termination_reason",
        "gpu_seconds",
        "cpu_seconds",
    ),
    # `tracks attempts` lists newest first; the resume sensor looks for silent running attempts.
    sa.Index("ix_training_attempts_started", "started_at"),
    sa.Index(
        "ix_training_attempts_running_heartbeat",
        "heartbeat_at",
        sqlite_where=sa.text("status = 'running'"),
        postgresql_where=sa.text("status = 'running'"),
    ),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("path", sa.String(512), primary_key=True),
    sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
    sa.Column("attempt_no", sa.Integer, nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("manifest_sha256", sa.String(64)),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("state_detail", sa.Text),
    sa.Column("bytes", sa.BigInteger),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("committed_at", UTCDateTime),
    sa.Column("metrics", JSONType),
    sa.Column("parent_path", sa.String(512)),
    sa.Column("fencing_token", sa.Integer, nullable=False),
    sa.Index("ix_checkpoints_run_step", "run_id", "step"),
)

evaluations = sa.Table(
    "evaluations",
    metadata,
    sa.Column("evaluation_id", sa.String(64), primary_key=True),
    sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
    sa.Column("attempt_no", sa.Integer, nullable=False),
    sa.Column("checkpoint_path", sa.String(512), nullable=False),
    sa.Column("checkpoint_manifest_sha256", sa.String(64), nullable=False),
    sa.Column("evaluator_name", sa.String(64), nullable=False),
    sa.Column("evaluator_version", sa.String(80), nullable=False),
    sa.Column("evaluator_env_digest", sa.String(80), nullable=False),
    sa.Column("task_set_version", sa.String(80), nullable=False),
    sa.Column("decoding_params", JSONType, nullable=False),
    sa.Column("judge_model", sa.String(128), nullable=False),
    sa.Column("rubric_version", sa.String(128), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("termination_reason", sa.String(32)),
    sa.Column("detail", sa.Text),
    sa.Column("metrics", JSONType),
    sa.Column("slice_metrics", JSONType),
    sa.Column("raw_outputs_uri", sa.String(1024)),
    sa.Column("raw_outputs_sha256", sa.String(64)),
    sa.Column("failures_uri", sa.String(1024)),
    sa.Column("mlflow_run_id", sa.String(64)),
    sa.Column("dagster_run_id", sa.String(64)),
    sa.Column("started_at", UTCDateTime, nullable=False),
    sa.Column("ended_at", UTCDateTime),
    # The spike history the evaluated checkpoint carries (migration 0007).
    sa.Column("training_health", JSONType),
    # Every input that decided a text-lm evaluation's figures (migration 0008).
    sa.Column("provenance", JSONType),
    sa.Index("ix_evaluations_checkpoint", "checkpoint_manifest_sha256", "evaluator_name"),
)

promotions = sa.Table(
    "promotions",
    metadata,
    sa.Column("promotion_id", sa.String(64), primary_key=True),
    sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
    sa.Column("attempt_no", sa.Integer, nullable=False),
    sa.Column("checkpoint_path", sa.String(512), nullable=False),
    sa.Column("checkpoint_manifest_sha256", sa.String(64), nullable=False),
    sa.Column("snapshot_id", sa.String(128), nullable=False),
    sa.Column("decision", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("evaluation_ids", JSONType, nullable=False),
    sa.Column("gate", JSONType, nullable=False),
    sa.Column("model_name", sa.String(128), nullable=False),
    sa.Column("model_version", sa.String(32)),
    sa.Column("previous_champion_version", sa.String(32)),
    # What serving must verify before it loads the version: file names, sizes and digests.
    sa.Column("serving_manifest", JSONType),
    sa.Column("dagster_run_id", sa.String(64)),
    sa.Column("decided_at", UTCDateTime, nullable=False),
    sa.Index("ix_promotions_model", "model_name", "decided_at"),
)

# A data snapshot as the ledger knows it: registered when it is created, so a batch stopped by
# its blocking checks still leaves a row that `tracks explain`, `attempts` and `cost` can show.
snapshots = sa.Table(
    "snapshots",
    metadata,
    sa.Column("snapshot_id", sa.String(128), primary_key=True),
    sa.Column("manifest_sha256", sa.String(64), nullable=False),
    sa.Column("content_sha256", sa.String(64)),
    sa.Column("rows", sa.Integer),
    sa.Column("source", sa.Text),
    sa.Column("created_at", UTCDateTime, nullable=False),
    # passed | blocked | unchecked: derived from snapshot_checks for this manifest digest.
    sa.Column("verdict", sa.String(16), nullable=False, server_default="unchecked"),
    sa.Column("verdict_at", UTCDateTime),
    sa.Column("dagster_run_id", sa.String(64)),
)

# One row per check run on one exact manifest: a verdict for another manifest never counts.
snapshot_checks = sa.Table(
    "snapshot_checks",
    metadata,
    sa.Column(
        "snapshot_id", sa.String(128), sa.ForeignKey("snapshots.snapshot_id"), primary_key=True
    ),
    sa.Column("manifest_sha256", sa.String(64), primary_key=True),
    sa.Column("check_name", sa.String(64), primary_key=True),
    sa.Column("blocking", sa.Boolean, nullable=False),
    sa.Column("passed", sa.Boolean, nullable=False),
    sa.Column("detail", JSONType),
    sa.Column("checked_at", UTCDateTime, nullable=False),
    sa.Column("dagster_run_id", sa.String(64)),
)

# Every check evaluation, append-only: ``snapshot_checks`` keeps only the newest per check.
snapshot_check_history = sa.Table(
    "snapshot_check_history",
    metadata,
    sa.Column("check_run_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column(
        "snapshot_id", sa.String(128), sa.ForeignKey("snapshots.snapshot_id"), nullable=False
    ),
    sa.Column("manifest_sha256", sa.String(64), nullable=False),
    sa.Column("check_name", sa.String(64), nullable=False),
    sa.Column("blocking", sa.Boolean, nullable=False),
    sa.Column("passed", sa.Boolean, nullable=False),
    sa.Column("detail", JSONType),
    sa.Column("checked_at", UTCDateTime, nullable=False),
    sa.Column("dagster_run_id", sa.String(64)),
    sa.Index("ix_snapshot_check_history_snapshot", "snapshot_id", "checked_at"),
)

# The logbook: short human notes on a run or one attempt, append-only (migration 0006 adds
# triggers that refuse UPDATE and DELETE on both databases). A run's note leaves attempt_no
# empty; an attempt's is checked by Ledger.add_note, not by a foreign key to training_attempts,
# which SQLite would enforce while a batch migration recreates that table.
notes = sa.Table(
    "notes",
    metadata,
    sa.Column("note_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
    sa.Column("attempt_no", sa.Integer),
    sa.Column("author", sa.String(128), nullable=False),
    sa.Column("source", sa.String(128), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("text", sa.Text, nullable=False),
    # One uid per add_note call: a retried transaction that already committed finds its row.
    sa.Column("note_uid", sa.String(36), unique=True),
    sa.Index("ix_notes_run", "run_id", "created_at"),
)
