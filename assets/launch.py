"""Who or what launched a Dagster run, read from the evidence Dagster leaves in its tags."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster._core.storage.tags import RUN_KEY_TAG, SCHEDULED_EXECUTION_TIME_TAG, TICK_ID_TAG

from pipeline.launch_facts import IN_RUN_VIA, RESUME_SENSOR_NAME

# Set by Tracks' own launchers (`tracks demo`, `tracks canary`, the resume sensor) to name
# themselves; Dagster sets the others.
LAUNCHED_BY_TAG = "tracks/launched_by"
# What Dagster's daemon launches leaves its own tags; a Tracks tag naming one of these without
# them is a claim, not evidence.
_DAEMON_LAUNCHERS = ("sensor:", "schedule:", "backfill:")
# Set on the receipt by the step that continues a run in place (never read from a tag): a
# launch tagged with it is a claim too.
_RECEIPT_ONLY_LAUNCHERS = (*_DAEMON_LAUNCHERS, IN_RUN_VIA)
# The resume sensor's name for the continuation a Dagster run is: "<run id>:attempt-<n>".
CONTINUATION_TAG = "tracks/continuation"
# The run and attempt a launch says it is (the resume sensor sets both); checked, not believed.
_IDENTITY_TAGS = {"run_id": "tracks/run_id", "continuation": CONTINUATION_TAG}
# What Dagster 1.13's daemon adds to the runs it launches: the sensor tick's id (sensors), the
# scheduled execution time (schedules; a hidden tag) and the request's run key (both).
_DAEMON_TAGS = {
    "tick": TICK_ID_TAG,
    "scheduled_for": SCHEDULED_EXECUTION_TIME_TAG,
    "run_key": RUN_KEY_TAG,
}
# Set by the resume sensor: whose trainer config its continuation carries over.
TRAINER_CONFIG_FROM_TAG = "tracks/trainer_config_from"


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
    elif tags.get(LAUNCHED_BY_TAG, "").startswith(_RECEIPT_ONLY_LAUNCHERS):
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
    # Which run and attempt the tags say this is: kept to be checked against the ledger's
    # attempt row (pipeline.launch_facts.contradicted_tags), never to choose the run.
    tagged = {name: _short(tags[key]) for name, key in _IDENTITY_TAGS.items() if tags.get(key)}
    if tagged:
        found["tagged"] = tagged
    if via.startswith(("sensor:", "schedule:")):
        # Which tick or scheduled execution it was, where Dagster's daemon says.
        for name, key in _DAEMON_TAGS.items():
            if tags.get(key):
                found[name] = _short(tags[key])
    return found


def continued_in_run(
    first_launch: Mapping[str, Any],
    dagster_run_id: str,
    ended_key: str,
    ended_attempt_no: int,
    termination_reason: str,
    rule: str,
) -> dict[str, Any]:
    """``launched_by`` of an attempt that the Dagster run ``dagster_run_id`` opened itself
    after the attempt ``ended_key`` ended (``via`` ``in_run:<Dagster run id>``).

    The evidence is the ended attempt, its termination reason and the decision's rule, not the
    run's tags (they describe the launch of the run's first attempt in this Dagster run). The
    trainer config and the user are the first launch's: the same step, the same trainer
    resource.
    """
    found: dict[str, Any] = {
        "via": _short(f"{IN_RUN_VIA}{dagster_run_id}"),
        "continues_attempt": str(ended_attempt_no),
        "ended_attempt": _short(ended_key),
        "termination_reason": termination_reason,
        "rule": _short(rule),
    }
    for key in ("user", "trainer_config"):
        if first_launch.get(key):
            found[key] = first_launch[key]
    return found


def trainer_config_source(
    tags: Mapping[str, str], run_config: Mapping[str, Any], dagster_run_id: str, via: str
) -> dict[str, Any]:
    """Where this launch's trainer config (backend, ranks, nodes) came from, for the receipt.

    The resume sensor names its source in a tag (:data:`TRAINER_CONFIG_FROM_TAG`), believed
    only on a run the sensor launched (``via``); otherwise it is this Dagster run's own
    ``resources.trainer`` run config, or the deployment's trainer resource when it sets none.
    """
    claimed = tags.get(TRAINER_CONFIG_FROM_TAG, "")
    if via == f"sensor:{RESUME_SENSOR_NAME}" and claimed:
        kind, _, rest = claimed.partition(":")
        if kind == "dagster_run" and rest:
            return {"from": "dagster_run", "dagster_run_id": _short(rest)}
        attempt = tags.get("tracks/continues_attempt", "")
        if kind == "placement" and rest.isdigit() and attempt.isdigit():
            return {"from": "placement", "attempt": int(attempt), "ranks": int(rest)}
        if kind == "deployment":
            return {"from": "deployment"}
    if (run_config.get("resources") or {}).get("trainer"):
        return {"from": "run_config", "dagster_run_id": dagster_run_id}
    return {"from": "deployment"}


def _daemon_launcher(tags: Mapping[str, str]) -> str | None:
    for key, kind in (("dagster/sensor_name", "sensor"), ("dagster/schedule_name", "schedule")):
        if tags.get(key):
            return f"{kind}:{tags[key]}"
    return None


def _short(value: str) -> str:
    return value if len(value) <= 200 else value[:200] + "…"
