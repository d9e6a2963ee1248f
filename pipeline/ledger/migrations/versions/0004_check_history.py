"""Every data-check evaluation kept: ``snapshot_check_history``, one row per check run.

``snapshot_checks`` holds the newest verdict of each check per manifest (what the gate reads);
a check run again replaced its row there, so a snapshot that failed and later passed (or the
reverse) kept no trace of the first verdict. The history table is append-only. Existing
verdicts are copied into it, so a ledger upgraded from 0003 starts with what it knew.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
UTCDateTime = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "snapshot_check_history",
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
    )
    op.create_index(
        "ix_snapshot_check_history_snapshot",
        "snapshot_check_history",
        ["snapshot_id", "checked_at"],
    )
    op.execute(
        "INSERT INTO snapshot_check_history (snapshot_id, manifest_sha256, check_name, "
        "blocking, passed, detail, checked_at, dagster_run_id) "
        "SELECT snapshot_id, manifest_sha256, check_name, blocking, passed, detail, "
        "checked_at, dagster_run_id FROM snapshot_checks"
    )


def downgrade() -> None:
    op.drop_index("ix_snapshot_check_history_snapshot", "snapshot_check_history")
    op.drop_table("snapshot_check_history")
