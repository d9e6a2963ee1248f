"""Evaluation provenance: every input that decided an evaluation's figures, per evaluator.

``evaluations.provenance``: what a text-lm evaluator recorded beside its figures (the weights'
digest, tokenizer digest, prompt set digest, template text and digest, decoding parameters and
seed, judge version and digest, contamination figure and threshold, the fields that do not
apply with their reasons). ``tracks reproduce`` re-runs an evaluation from it and the promotion
gate refuses an evaluation whose provenance lacks a field. Rows written before this revision,
and digits evaluations (whose provenance is the row's own columns), have none.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("provenance", JSON))


def downgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_column("provenance")
