"""Alembic environment for the ledger. Run programmatically by ``Ledger.upgrade``."""

from __future__ import annotations

from alembic import context

from pipeline.ledger.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run ledger migrations through pipeline.ledger.Ledger.upgrade()")

# Our own version table: the ledger may share a database with MLflow or Dagster, which both
# keep theirs in `alembic_version`.
context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=True,
    version_table="tracks_ledger_version",
)
with context.begin_transaction():
    context.run_migrations()
