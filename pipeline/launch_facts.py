"""What an attempt's launch record says, checked against the ledger's own facts.

Dagster tags are input from whoever launches a run: a person can copy another run's tags
(``tracks/run_id``, ``tracks/continuation``) onto a launch of a different run. The ledger's
attempt row is the fact; a tag that disagrees is stated as a claim, never believed. The same
goes for where an attempt's trainer came from: each attempt records the source of its trainer
config, so a change of placement between two attempts can be told with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.ledger import AttemptRecord

RESUME_SENSOR_NAME = "resume_after_preemption"
_RESUME_SENSOR = f"sensor:{RESUME_SENSOR_NAME}"
# ``via`` of an attempt the Dagster run that hosted the ended one opened itself (continued in
# place): ``in_run:<Dagster run id>``.
IN_RUN_VIA = "in_run:"


def in_run_words(launched: Mapping[str, Any] | None) -> str | None:
    """ "Continued in place by Dagster run D after attempt R#N ended preempted, rule `…`: …",
    or None when the attempt was not continued in place."""
    launched = launched or {}
    via = str(launched.get("via") or "")
    if not via.startswith(IN_RUN_VIA):
        return None
    ended = launched.get("ended_attempt") or launched.get("continues_attempt") or "?"
    reason = launched.get("termination_reason") or "with an unrecorded reason"
    rule = f", rule `{launched['rule']}`" if launched.get("rule") else ""
    return (
        f"Continued in place by Dagster run {via.removeprefix(IN_RUN_VIA)} after attempt "
        f"{ended} ended {reason}{rule}: the step that saw it end opened this attempt itself, "
        "with no new Dagster run and no resume sensor tick"
    )


def continuation_key(run_id: str, attempt_no: int) -> str:
    """The resume sensor's name for "attempt N of run R" (its ``tracks/continuation`` tag)."""
    return f"{run_id}:attempt-{attempt_no}"


def contradicted_tags(
    launched: Mapping[str, Any] | None, run_id: str, attempt_no: int
) -> str | None:
    """A sentence naming the tags that claim another run or attempt than the ledger's; else None.

    ``launched`` is the attempt's ``launched_by``: ``tagged`` holds the identity tags the
    launch carried (``run_id``, ``continuation``) and ``continues_attempt`` the attempt the
    tags say it continues.
    """
    launched = launched or {}
    tagged = launched.get("tagged") or {}
    claims = []
    other_run = bool(tagged.get("run_id")) and tagged["run_id"] != run_id
    if other_run:
        claims.append(f"run {tagged['run_id']}")
    continuation = tagged.get("continuation")
    if continuation and continuation != continuation_key(run_id, attempt_no):
        claims.append(f"continuation {continuation}")
        other_run = other_run or not continuation.startswith(f"{run_id}:attempt-")
    continues = str(launched.get("continues_attempt") or "")
    if continues and continues != str(attempt_no - 1):
        claims.append(f"that it continues attempt {continues}")
    if not claims:
        return None
    said = "a new run's first attempt" if attempt_no == 1 else f"attempt {attempt_no}"
    if other_run:
        why = "the tags came from another run's launch and are not this attempt's"
    elif continues.isdigit() and int(continues) < attempt_no - 1:
        between = f"{int(continues) + 1}" + (
            f" to {attempt_no - 1}" if int(continues) + 1 < attempt_no - 1 else ""
        )
        why = (
            f"attempt {between} of this run opened between the decision the tags continue "
            "and this attempt"
        )
    else:
        why = "the tags name another attempt of this run"
    return (
        f"Its Dagster tags claim {' / '.join(claims)}; the ledger says run {run_id}, {said}: {why}."
    )


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _backend(a: AttemptRecord) -> str | None:
    p = a.placement or {}
    if p.get("launcher") == "kubernetes":
        return "kubernetes"
    backend = p.get("backend")
    return str(backend) if backend else None


def _world(placement: Mapping[str, Any]) -> int:
    """The ranks the trainer reported (it records ``ranks_per_node`` with them); before that,
    the ranks the orchestrator launched; else the one process an attempt begins as."""
    if "ranks_per_node" not in placement and placement.get("launched_ranks"):
        return int(placement["launched_ranks"])
    return int(placement.get("world_size") or 1)


def placement_changes(previous: AttemptRecord, current: AttemptRecord) -> list[str]:
    """Clauses for each placement fact that differs: ranks, nodes, backend, device, accelerators.

    A fact unknown on either attempt (a receipt from before it was recorded) is not compared.
    """
    p, c = previous.placement or {}, current.placement or {}
    n, m = previous.attempt_no, current.attempt_no
    out = []
    world_p, world_c = _world(p), _world(c)
    if world_p != world_c:
        out.append(f"attempt {m} ran on {_ranks(world_c)} where attempt {n} ran on {world_p}")
    nodes_p, nodes_c = int(p.get("nodes") or 1), int(c.get("nodes") or 1)
    if nodes_p != nodes_c:
        out.append(f"attempt {m} ran on {nodes_c} node(s) where attempt {n} ran on {nodes_p}")
    pairs = (
        ("used backend", _backend(previous), _backend(current)),
        (
            "used device",
            (previous.config_snapshot or {}).get("device"),
            (current.config_snapshot or {}).get("device"),
        ),
        ("had accelerator count", p.get("accelerator_count"), c.get("accelerator_count")),
    )
    for verb, before, now in pairs:
        if before is not None and now is not None and before != now:
            out.append(f"attempt {m} {verb} {now} where attempt {n} had {before}")
    return out


def trainer_source_words(
    launched: Mapping[str, Any] | None, attempts: Sequence[AttemptRecord]
) -> str:
    """Where the attempt's trainer config (backend, ranks, nodes) came from, in words."""
    launched = launched or {}
    via = str(launched.get("via") or "an unrecorded launcher")
    source = launched.get("trainer_config") or {}
    kind = source.get("from")
    if via == _RESUME_SENSOR:
        who = "the resume sensor"
    elif via.startswith(IN_RUN_VIA):
        who = f"the in-place continuation in Dagster run {via.removeprefix(IN_RUN_VIA)}"
    else:
        who = via
    if kind == "dagster_run":
        dagster_run = source.get("dagster_run_id")
        ran = [str(a.attempt_no) for a in attempts if a.dagster_run_id == dagster_run]
        whose = f" (attempt {', '.join(ran)}'s)" if ran else ""
        return f"{who} carried over the trainer config of Dagster run {dagster_run}{whose}"
    if kind == "placement":
        return (
            f"{who} chose {_ranks(int(source.get('ranks') or 1))} under torchrun from "
            f"attempt {source.get('attempt')}'s placement"
        )
    if kind == "deployment":
        return (
            f"launched by {via} on this deployment's trainer resource (its run config sets "
            "no resources.trainer)"
        )
    if kind == "run_config":
        return (
            f"launched by {via} with the resources.trainer run config of Dagster run "
            f"{source.get('dagster_run_id')}"
        )
    if via == "cli":
        return "the trainer CLI ran it itself, with as many ranks as it was started with"
    return f"launched by {via}; the receipt does not record where its trainer config came from"


def placement_change_sentence(
    previous: AttemptRecord, current: AttemptRecord, attempts: Sequence[AttemptRecord]
) -> str | None:
    """ "Attempt 3 ran on 2 ranks where attempt 2 ran on 1: <why>", or None when alike."""
    changes = placement_changes(previous, current)
    if not changes:
        return None
    text = "; ".join(changes)
    return f"{text[0].upper()}{text[1:]}: {trainer_source_words(current.launched_by, attempts)}."


def fault_hooks_words(placement: Mapping[str, Any] | None) -> str | None:
    """``drill hooks active: NAME=value, …`` when the attempt ran with fault hooks set."""
    hooks = (placement or {}).get("fault_hooks")
    if not isinstance(hooks, Mapping) or not hooks:
        return None
    return "drill hooks active: " + ", ".join(f"{k}={v}" for k, v in sorted(hooks.items()))
