"""The logbook: ``notes``, short human notes on a run or one attempt, append-only.

Curves do not say why a learning rate changed or why a run was restarted; a note does. Notes are
only ever added: besides the ledger offering no way to edit one, triggers refuse UPDATE, DELETE
(and on PostgreSQL TRUNCATE) on the table, so a note read later is the note as written. A batch
migration of ``notes`` on SQLite recreates the table and must create the triggers again.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

UTCDateTime = sa.DateTime(timezone=True)

_PG_FUNCTION = """
CREATE FUNCTION tracks_notes_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'notes are append-only: % refused', TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "notes",
        sa.Column("note_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(128), sa.ForeignKey("training_runs.run_id"), nullable=False),
        sa.Column("attempt_no", sa.Integer),
        sa.Column("author", sa.String(128), nullable=False),
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("note_uid", sa.String(36), unique=True),
    )
    op.create_index("ix_notes_run", "notes", ["run_id", "created_at"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION)
        op.execute(
            "CREATE TRIGGER notes_append_only BEFORE UPDATE OR DELETE ON notes "
            "FOR EACH ROW EXECUTE FUNCTION tracks_notes_append_only()"
        )
        op.execute(
            "CREATE TRIGGER notes_no_truncate BEFORE TRUNCATE ON notes "
            "FOR EACH STATEMENT EXECUTE FUNCTION tracks_notes_append_only()"
        )
    else:
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER notes_no_{verb.lower()} BEFORE {verb} ON notes "
                f"BEGIN SELECT RAISE(ABORT, 'notes are append-only: {verb} refused'); END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS notes_no_truncate ON notes")
        op.execute("DROP TRIGGER IF EXISTS notes_append_only ON notes")
        op.execute("DROP FUNCTION IF EXISTS tracks_notes_append_only()")
    else:
        op.execute("DROP TRIGGER IF EXISTS notes_no_update")
        op.execute("DROP TRIGGER IF EXISTS notes_no_delete")
    op.drop_index("ix_notes_run", "notes")
    op.drop_table("notes")
