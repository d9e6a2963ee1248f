"""Receipts that tell the whole story, and snapshots the ledger knows about.

Attempts gain an idempotency uid, who launched them and which rule admitted them, the step they
restored (``last_step`` stays the step reached) and what each clock measured. Promotions keep the
serving manifest a loader verifies. ``snapshots`` and ``snapshot_checks`` record each blocking
check's verdict for one exact manifest digest, so every path that trains can require it and a
batch stopped by its checks still leaves a row.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
UTCDateTime = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("training_attempts") as batch:
        batch.add_column(sa.Column("attempt_uid", sa.String(36)))
        batch.add_column(sa.Column("launched_by", JSONType))
        batch.add_column(sa.Column("admission", JSONType))
        batch.add_column(sa.Column("restored_step", sa.Integer))
        batch.add_column(sa.Column("timings", JSONType))
        batch.create_unique_constraint("uq_training_attempts_attempt_uid", ["attempt_uid"])
    # The cost question reports CPU-hours beside GPU-hours: the covering index covers both.
    op.drop_index("ix_training_attempts_family_started", "training_attempts")
    op.create_index(
        "ix_training_attempts_family_started",
        "training_attempts",
        ["model_family", "started_at", "termination_reason", "gpu_seconds", "cpu_seconds"],
    )
    with op.batch_alter_table("promotions") as batch:
        batch.add_column(sa.Column("serving_manifest", JSONType))
    op.create_table(
        "snapshots",
        sa.Column("snapshot_id", sa.String(128), primary_key=True),
        sa.Column("manifest_sha256", sa.String(64), nullable=False),
        sa.Column("content_sha256", sa.String(64)),
        sa.Column("rows", sa.Integer),
        sa.Column("source", sa.Text),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("verdict", sa.String(16), nullable=False, server_default="unchecked"),
        sa.Column("verdict_at", UTCDateTime),
        sa.Column("dagster_run_id", sa.String(64)),
    )
    op.create_table(
        "snapshot_checks",
        sa.Column(
            "snapshot_id",
            sa.String(128),
            sa.ForeignKey("snapshots.snapshot_id"),
            primary_key=True,
        ),
        sa.Column("manifest_sha256", sa.String(64), primary_key=True),
        sa.Column("check_name", sa.String(64), primary_key=True),
        sa.Column("blocking", sa.Boolean, nullable=False),
        sa.Column("passed", sa.Boolean, nullable=False),
        sa.Column("detail", JSONType),
        sa.Column("checked_at", UTCDateTime, nullable=False),
        sa.Column("dagster_run_id", sa.String(64)),
    )


def downgrade() -> None:
    op.drop_table("snapshot_checks")
    op.drop_table("snapshots")
    with op.batch_alter_table("promotions") as batch:
        batch.drop_column("serving_manifest")
    with op.batch_alter_table("training_attempts") as batch:
        batch.drop_constraint("uq_training_attempts_attempt_uid", type_="unique")
        for column in ("timings", "restored_step", "admission", "launched_by", "attempt_uid"):
            batch.drop_column(column)
    op.drop_index("ix_training_attempts_family_started", "training_attempts")
    op.create_index(
        "ix_training_attempts_family_started",
        "training_attempts",
        ["model_family", "started_at", "termination_reason", "gpu_seconds"],
    )
