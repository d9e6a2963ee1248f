"""Indexes for listing attempts newest first and for finding silent (alive-but-quiet) attempts.

``tracks attempts`` without a family walked every attempt to sort by start time, and the resume
sensor's heartbeat scan walked every attempt on each tick; on a million attempts both took
hundreds of milliseconds. The cost index of 0001 already covers ``tracks cost``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

RUNNING = sa.text("status = 'running'")


def upgrade() -> None:
    op.create_index("ix_training_attempts_started", "training_attempts", ["started_at"])
    # Partial: only running attempts are ever searched by heartbeat, and they are few.
    op.create_index(
        "ix_training_attempts_running_heartbeat",
        "training_attempts",
        ["heartbeat_at"],
        sqlite_where=RUNNING,
        postgresql_where=RUNNING,
    )


def downgrade() -> None:
    op.drop_index("ix_training_attempts_running_heartbeat", "training_attempts")
    op.drop_index("ix_training_attempts_started", "training_attempts")
