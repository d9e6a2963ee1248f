"""Who or what launched a Dagster run, read from the evidence Dagster leaves in its tags."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Set by Tracks' own launchers (`tracks demo`, `tracks canary`, the resume sensor) to name
# themselves; Dagster sets the others.
LAUNCHED_BY_TAG = "tracks/launched_by"


def launched_by(tags: Mapping[str, str]) -> dict[str, Any]:
    """``{"via": ..., ...}`` for the attempt's receipt.

    ``via`` is ``sensor:<name>``, ``schedule:<name>``, ``backfill:<id>``, whatever a Tracks
    launcher named itself, or ``ui`` for a run launched by hand (the Dagster UI or its GraphQL
    API, which leave none of those tags). The user is kept where Dagster records one.
    """
    if tags.get(LAUNCHED_BY_TAG):
        via = tags[LAUNCHED_BY_TAG]
    elif tags.get("dagster/sensor_name"):
        via = f"sensor:{tags['dagster/sensor_name']}"
    elif tags.get("dagster/schedule_name"):
        via = f"schedule:{tags['dagster/schedule_name']}"
    elif tags.get("dagster/backfill"):
        via = f"backfill:{tags['dagster/backfill']}"
    else:
        via = "ui"
    found: dict[str, Any] = {"via": via}
    for key in ("user", "dagster/user", "tracks/continues_attempt", "tracks/rule"):
        if tags.get(key):
            found[key.removeprefix("dagster/").removeprefix("tracks/")] = tags[key]
    return found
