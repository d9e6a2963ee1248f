"""Evaluations record the sha256 of their raw outputs file.

Promotion compares a candidate with the champion example by example, from each evaluation's
raw outputs; it loads them only if they still hash to what the evaluation recorded. Rows written
before this revision have none, and promotion re-evaluates the champion instead of trusting them.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("raw_outputs_sha256", sa.String(64)))


def downgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_column("raw_outputs_sha256")
