"""The attempt receipt: runs, attempts, checkpoints, evaluations, promotions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "training_runs",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("model_family", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("config_sha256", sa.String(64), nullable=False),
        sa.Column("snapshot_id", sa.String(128), nullable=False),
        sa.Column("code_commit", sa.String(64)),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("fencing_token", sa.Integer, nullable=False, server_default="0"),
        sa.Column("retry_policy", JSON),
    )
    op.create_index(
        "ix_training_runs_snapshot", "training_runs", ["snapshot_id", "model_family", "created_at"]
    )
    op.create_table(
        "training_attempts",
        sa.Column(
            "run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), primary_key=True
        ),
        sa.Column("attempt_no", sa.Integer, primary_key=True),
        sa.Column("model_family", sa.String(64), nullable=False),
        sa.Column("dagster_run_id", sa.String(64)),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS),
        sa.Column("ended_at", TS),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("termination_reason", sa.String(32)),
        sa.Column("termination_detail", sa.Text),
        sa.Column("exit_code", sa.Integer),
        sa.Column("signal", sa.String(16)),
        sa.Column("config_snapshot", JSON, nullable=False),
        sa.Column("config_sha256", sa.String(64), nullable=False),
        sa.Column("data_manifest_sha256", sa.String(64), nullable=False),
        sa.Column("container_digest", sa.String(80), nullable=False),
        sa.Column("placement", JSON, nullable=False),
        sa.Column("code_commit", sa.String(64)),
        sa.Column("gpu_seconds", sa.Float, nullable=False, server_default="0"),
        sa.Column("cpu_seconds", sa.Float, nullable=False, server_default="0"),
        sa.Column("last_step", sa.Integer),
        sa.Column("resumed_from_checkpoint", sa.String(512)),
        sa.Column("fencing_token", sa.Integer, nullable=False),
        sa.Column("retry_decision", JSON),
    )
    op.create_index(
        "ix_training_attempts_family_started",
        "training_attempts",
        ["model_family", "started_at", "termination_reason", "gpu_seconds"],
    )
    op.create_table(
        "checkpoints",
        sa.Column("path", sa.String(512), primary_key=True),
        sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
        sa.Column("attempt_no", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("manifest_sha256", sa.String(64)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("state_detail", sa.Text),
        sa.Column("bytes", sa.BigInteger),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("committed_at", TS),
        sa.Column("metrics", JSON),
        sa.Column("parent_path", sa.String(512)),
        sa.Column("fencing_token", sa.Integer, nullable=False),
    )
    op.create_index("ix_checkpoints_run_step", "checkpoints", ["run_id", "step"])
    op.create_table(
        "evaluations",
        sa.Column("evaluation_id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
        sa.Column("attempt_no", sa.Integer, nullable=False),
        sa.Column("checkpoint_path", sa.String(512), nullable=False),
        sa.Column("checkpoint_manifest_sha256", sa.String(64), nullable=False),
        sa.Column("evaluator_name", sa.String(64), nullable=False),
        sa.Column("evaluator_version", sa.String(80), nullable=False),
        sa.Column("evaluator_env_digest", sa.String(80), nullable=False),
        sa.Column("task_set_version", sa.String(80), nullable=False),
        sa.Column("decoding_params", JSON, nullable=False),
        sa.Column("judge_model", sa.String(128), nullable=False),
        sa.Column("rubric_version", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("termination_reason", sa.String(32)),
        sa.Column("detail", sa.Text),
        sa.Column("metrics", JSON),
        sa.Column("slice_metrics", JSON),
        sa.Column("raw_outputs_uri", sa.String(1024)),
        sa.Column("failures_uri", sa.String(1024)),
        sa.Column("mlflow_run_id", sa.String(64)),
        sa.Column("dagster_run_id", sa.String(64)),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("ended_at", TS),
    )
    op.create_index(
        "ix_evaluations_checkpoint",
        "evaluations",
        ["checkpoint_manifest_sha256", "evaluator_name"],
    )
    op.create_table(
        "promotions",
        sa.Column("promotion_id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
        sa.Column("attempt_no", sa.Integer, nullable=False),
        sa.Column("checkpoint_path", sa.String(512), nullable=False),
        sa.Column("checkpoint_manifest_sha256", sa.String(64), nullable=False),
        sa.Column("snapshot_id", sa.String(128), nullable=False),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("evaluation_ids", JSON, nullable=False),
        sa.Column("gate", JSON, nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("model_version", sa.String(32)),
        sa.Column("previous_champion_version", sa.String(32)),
        sa.Column("dagster_run_id", sa.String(64)),
        sa.Column("decided_at", TS, nullable=False),
    )
    op.create_index("ix_promotions_model", "promotions", ["model_name", "decided_at"])


def downgrade() -> None:
    for table in ("promotions", "evaluations", "checkpoints", "training_attempts", "training_runs"):
        op.drop_table(table)
