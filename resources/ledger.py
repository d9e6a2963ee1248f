"""The ledger as a Dagster resource."""

from __future__ import annotations

import functools

import dagster as dg

from pipeline.ledger import Ledger


@functools.cache
def _open(url: str) -> Ledger:
    # One engine (and one migration check) per process and URL, not one per asset call.
    return Ledger.open(url)


class LedgerResource(dg.ConfigurableResource):
    """Attempt receipts: SQLite by default, PostgreSQL by URL."""

    url: str

    def ledger(self) -> Ledger:
        return _open(self.url)
