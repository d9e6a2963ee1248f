"""Reading what an upstream asset partition recorded: lineage travels as metadata, not pickles."""

from __future__ import annotations

from typing import Any

import dagster as dg


class MissingUpstreamError(Exception):
    def __init__(self, asset: str, partition: str | None) -> None:
        super().__init__(
            f"asset {asset!r} has no materialization for partition {partition!r}: "
            "materialize it first"
        )


def upstream_metadata(
    context: dg.AssetExecutionContext, asset: str, partition: str | None
) -> dict[str, Any]:
    """Plain values of the newest materialization's metadata of ``asset`` for ``partition``."""
    records = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(asset),
            asset_partitions=[partition] if partition is not None else None,
        ),
        limit=1,
    ).records
    if not records:
        raise MissingUpstreamError(asset, partition)
    materialization = records[0].asset_materialization
    assert materialization is not None
    return {key: value.value for key, value in materialization.metadata.items()}
