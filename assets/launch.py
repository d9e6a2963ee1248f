"""Who or what launched a Dagster run, read from the evidence Dagster leaves in its tags."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Set by Tracks' own launchers (`tracks demo`, `tracks canary`, the resume sensor) to name
# themselves; Dagster sets the others.
LAUNCHED_BY_TAG = "tracks/launched_by"
# What Dagster's daemon launches leaves its own tags; a Tracks tag naming one of these without
# them is a claim, not evidence.
_DAEMON_LAUNCHERS = ("sensor:", "schedule:", "backfill:")


def launched_by(tags: Mapping[str, str]) -> dict[str, Any]:
    """``{"via": ..., ...}`` for the attempt's receipt.

    ``via`` is ``reexecution:<parent run id>`` for a re-execution (whose inherited tags name
    the parent's launcher, kept as ``claimed``); ``sensor:<name>``, ``schedule:<name>`` or
    ``backfill:<id>`` where Dagster's daemon left that evidence; else whatever a Tracks
    launcher (``tracks demo``, the canary) named itself in ``tracks/launched_by``; else ``ui``
    for a run launched by hand (the Dagster UI or its GraphQL API). Dagster's evidence wins
    over the Tracks tag, which anyone launching a run can set: a tag that says otherwise is
    kept as ``claimed``, not believed. The user is kept where Dagster records one. Every value
    is cut to 200 characters.
    """
    if tags.get("dagster/parent_run_id"):
        # A re-execution (from the UI, by a person: Dagster's own run retries are off) inherits
        # its parent's tags, the daemon's included: they say who launched the parent.
        via = f"reexecution:{tags['dagster/parent_run_id']}"
    elif tags.get("dagster/sensor_name"):
        via = f"sensor:{tags['dagster/sensor_name']}"
    elif tags.get("dagster/schedule_name"):
        via = f"schedule:{tags['dagster/schedule_name']}"
    elif tags.get("dagster/backfill"):
        via = f"backfill:{tags['dagster/backfill']}"
    elif tags.get(LAUNCHED_BY_TAG, "").startswith(_DAEMON_LAUNCHERS):
        via = "ui"  # a daemon's name with none of the daemon's own tags: claimed by hand
    else:
        via = tags.get(LAUNCHED_BY_TAG) or "ui"
    found: dict[str, Any] = {"via": _short(via)}
    claimed = tags.get(LAUNCHED_BY_TAG) or _daemon_launcher(tags)
    if claimed and claimed != via:
        found["claimed"] = _short(claimed)
    for key in ("user", "dagster/user", "tracks/continues_attempt", "tracks/rule"):
        if tags.get(key):
            found[key.removeprefix("dagster/").removeprefix("tracks/")] = _short(tags[key])
    return found


def _daemon_launcher(tags: Mapping[str, str]) -> str | None:
    for key, kind in (("dagster/sensor_name", "sensor"), ("dagster/schedule_name", "schedule")):
        if tags.get(key):
            return f"{kind}:{tags[key]}"
    return None


def _short(value: str) -> str:
    return value if len(value) <= 200 else value[:200] + "…"
