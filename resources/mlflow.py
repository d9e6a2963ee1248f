"""MLflow tracking and registry locations."""

from __future__ import annotations

import dagster as dg


class MlflowResource(dg.ConfigurableResource):
    """Tracking/registry URI (SQLite by default, PostgreSQL in production) and artifact root."""

    tracking_uri: str
    artifact_root: str
