"""Training health: the loss-spike history on attempts and on evaluations.

``training_attempts.health``: the loss-spike detector's settings and the history of the lineage
the attempt trained on (what its checkpoint carried, then every spike it saw: the action, the
batches dealt past, the checkpoint it rolled back to), with the totals. ``evaluations.
training_health``: the same history as the evaluated checkpoint's verified trainer state carries
it, so the promotion gate and a reader see that a model trained through a rollback. Rows written
before this revision have none: nothing was recorded then.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("training_attempts") as batch:
        batch.add_column(sa.Column("health", JSON))
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("training_health", JSON))


def downgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_column("training_health")
    with op.batch_alter_table("training_attempts") as batch:
        batch.drop_column("health")
