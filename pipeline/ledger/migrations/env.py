"""Alembic environment for the ledger. Run programmatically by ``Ledger.upgrade``."""

from __future__ import annotations

from alembic import context

from pipeline.ledger.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run ledger migrations through pipeline.ledger.Ledger.upgrade()")

context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
