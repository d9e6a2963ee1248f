"""How a trainer pod ended, read from its status: pure functions over API-shaped dicts.

The input is a Pod as the API server serves it (camelCase JSON, e.g.
``ApiClient().sanitize_for_serialization(v1_pod)``). The output is the same
:class:`~pipeline.reasons.AttemptEvidence` the local launcher gathers, classified by the same
:func:`~pipeline.reasons.classify`, so a preemption means the same thing on a laptop and on a
cluster. Two Kubernetes facts are decided here because no exit code carries them:

- ``state.terminated.reason == "OOMKilled"``: the kernel killed something in the container's
  cgroup. Under torchrun the killed process is often a worker, and the agent then exits 1, so
  the exit code alone would say ``user_code_error``.
- an eviction (pod ``reason`` ``Evicted``, a node shutdown or preemption) or a
  ``DisruptionTarget`` condition: the platform took the pod away, whatever the exit code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pipeline import redact
from pipeline.kube.spec import CONTAINER_NAME
from pipeline.reasons import AttemptEvidence, InsufficientEvidenceError, Termination, classify
from pipeline.states import TerminationReason

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
# Pod status reasons set when the platform, not the program, ended the pod: kubelet eviction
# (node pressure), graceful node shutdown, scheduler preemption, a node controller giving up.
DISRUPTION_REASONS = frozenset(
    {"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown", "Terminated"}
)
# Bound what a termination message may put into a receipt: the kubelet caps it at 4096 bytes,
# and with FallbackToLogsOnError it is a log tail that may hold anything.
_MAX_MESSAGE = 4096


@dataclass(frozen=True)
class TerminationMessage:
    """What the launcher wrote to ``/dev/termination-log``: its JSON verdict, or plain text."""

    words: Mapping[str, Any] | None = None  # {"reason", "detail", "exit_code", "rank", …}
    text: str | None = None  # when it was not JSON (e.g. the log tail), redacted


@dataclass(frozen=True)
class PodEnding:
    """One rank-0 pod's end: the evidence, the verdict, and where it happened."""

    termination: Termination
    evidence: AttemptEvidence
    pod_name: str | None
    node_name: str | None
    phase: str | None
    pod_reason: str | None  # status.reason, e.g. "Evicted"
    container_reason: str | None  # state.terminated.reason, e.g. "OOMKilled", "Error"
    message: TerminationMessage
    disrupted: bool
    oom_killed: bool
    scheduled_at: datetime | None = None  # bound to a node: its accelerators are held from here
    finished_at: datetime | None = None  # the trainer container's end

    @property
    def reason(self) -> TerminationReason:
        return self.termination.reason

    @property
    def exit_code(self) -> int | None:
        return self.evidence.exit_code


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def container_status(
    pod: Mapping[str, Any], name: str = CONTAINER_NAME
) -> Mapping[str, Any] | None:
    """The status of container ``name``; the only container's if none has that name."""
    statuses = _get(pod, "status", "containerStatuses") or []
    statuses = [s for s in statuses if isinstance(s, Mapping)]
    for status in statuses:
        if status.get("name") == name:
            return status
    return statuses[0] if len(statuses) == 1 else None


def terminated_state(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``state.terminated`` of the trainer container, once it has ended."""
    terminated = _get(container_status(pod), "state", "terminated")
    return terminated if isinstance(terminated, Mapping) else None


def has_started(pod: Mapping[str, Any]) -> bool:
    """True once the trainer container ran (so its log can be read) or the pod is over."""
    status = container_status(pod)
    state = _get(status, "state") or {}
    return bool(state.get("running") or state.get("terminated")) or is_finished(pod)


def is_finished(pod: Mapping[str, Any]) -> bool:
    """True when the pod will not run again: terminal phase, or the trainer container ended.

    With ``restartPolicy: Never`` a terminated container is final even before the kubelet
    moves the phase on.
    """
    return _get(pod, "status", "phase") in TERMINAL_PHASES or terminated_state(pod) is not None


def _timestamp(value: object) -> datetime | None:
    # The API serves RFC 3339 UTC ("2026-11-24T10:00:00Z"); anything else is not evidence.
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def scheduled_at(pod: Mapping[str, Any]) -> datetime | None:
    """When the scheduler bound the pod to a node (its ``PodScheduled`` condition turned
    True): the node's accelerators are the pod's from then on, pulling the image included."""
    for condition in _get(pod, "status", "conditions") or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") == "PodScheduled"
            and condition.get("status") == "True"
        ):
            return _timestamp(condition.get("lastTransitionTime"))
    return None


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's words while it cannot place the pod (``PodScheduled=False``, reason
    ``Unschedulable``), on one line and redacted; None when it is not (or no longer) so."""
    for condition in _get(pod, "status", "conditions") or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            said = redact.one_line(str(condition.get("message") or ""))
            return (said[:500] + "…" if len(said) > 500 else said) or "Unschedulable"
    return None


def finished_at(pod: Mapping[str, Any]) -> datetime | None:
    """When the trainer container ended (``state.terminated.finishedAt``), if it has."""
    return _timestamp((terminated_state(pod) or {}).get("finishedAt"))


def disruption(pod: Mapping[str, Any]) -> str | None:
    """Why the platform took the pod away, in its own words; None if it did not."""
    status = _get(pod, "status") or {}
    for condition in status.get("conditions") or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") == "DisruptionTarget"
            and condition.get("status") == "True"
        ):
            why = condition.get("reason") or "DisruptionTarget"
            said = condition.get("message")
            return f"{why}: {said}" if said else str(why)
    if status.get("reason") in DISRUPTION_REASONS:
        said = status.get("message")
        return f"{status['reason']}: {said}" if said else str(status["reason"])
    return None


def parse_termination_message(message: str | None) -> TerminationMessage:
    """The launcher's JSON verdict if the message is one, else the (redacted) text."""
    if not message or not message.strip():
        return TerminationMessage()
    text = message.strip()[-_MAX_MESSAGE:]
    try:
        words = json.loads(text)
    except ValueError:
        return TerminationMessage(text=redact.text(text))
    if not isinstance(words, Mapping):
        return TerminationMessage(text=redact.text(text))
    # Keep the keys the receipt uses; values from a file anyone in the pod could write are
    # shaped, never trusted as objects.
    kept: dict[str, Any] = {}
    for key, value in words.items():
        if isinstance(key, str) and (value is None or isinstance(value, str | int | float | bool)):
            kept[str(key)] = redact.text(value) if isinstance(value, str) else value
    return TerminationMessage(words=kept)


def evidence_from_pod(pod: Mapping[str, Any]) -> AttemptEvidence:
    """What the pod's status proves about how the attempt ended (no verdict yet)."""
    terminated = terminated_state(pod) or {}
    exit_code = terminated.get("exitCode")
    exit_code = (
        exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None
    )
    message = parse_termination_message(terminated.get("message"))
    signal = terminated.get("signal")
    disrupted = disruption(pod) is not None
    return AttemptEvidence(
        exit_code=exit_code,
        signal=str(signal) if isinstance(signal, int) and signal else None,
        last_words=message.words,
        cgroup_oom_kills=1 if terminated.get("reason") == "OOMKilled" else None,
        # A clean exit stays a success even if a disruption landed after it.
        node_lost=disrupted and exit_code != 0,
        exception_message=message.text,
    )


def classify_pod(pod: Mapping[str, Any], *, last_committed_step: int | None = None) -> PodEnding:
    """The one termination reason of the attempt whose rank-0 pod is ``pod``."""
    terminated = terminated_state(pod) or {}
    evidence = evidence_from_pod(pod)
    if last_committed_step is not None:
        evidence = replace(evidence, last_committed_step=last_committed_step)
    message = parse_termination_message(terminated.get("message"))
    oom_killed = terminated.get("reason") == "OOMKilled"
    disrupted_by = disruption(pod)
    limit = _memory_limit(pod)
    if oom_killed:
        # The kubelet's word for a cgroup OOM kill, whatever torchrun's exit code says.
        termination = Termination(
            TerminationReason.OOM,
            f"The container was OOMKilled (memory limit {limit or 'unset'}) and exited "
            f"{evidence.exit_code}; host memory ran out on rank 0's node.",
        )
    elif disrupted_by is not None and evidence.exit_code != 0 and not _trainer_said(evidence):
        termination = Termination(
            TerminationReason.PREEMPTED,
            f"The platform took the pod away ({redact.text(disrupted_by)[:300]}); "
            f"{_exit_phrase(evidence)}.",
        )
    else:
        try:
            termination = classify(evidence)
        except InsufficientEvidenceError:
            # Failed before the container ran (admission: OutOfcpu, UnexpectedAdmissionError…).
            said = _get(pod, "status", "reason") or _get(pod, "status", "phase") or "unknown"
            more = _get(pod, "status", "message")
            termination = Termination(
                TerminationReason.INFRA_TRANSIENT,
                f"Rank 0's pod ended before the trainer ran ({said}"
                + (f": {redact.text(str(more))[:300]}" if more else "")
                + ").",
            )
    return PodEnding(
        termination=termination,
        evidence=evidence,
        pod_name=_get(pod, "metadata", "name"),
        node_name=_get(pod, "spec", "nodeName"),
        phase=_get(pod, "status", "phase"),
        pod_reason=_get(pod, "status", "reason"),
        container_reason=terminated.get("reason"),
        message=message,
        disrupted=disrupted_by is not None,
        oom_killed=oom_killed,
        scheduled_at=scheduled_at(pod),
        finished_at=finished_at(pod),
    )


def lost_pod(pod_name: str | None, why: str) -> PodEnding:
    """The ending of a rank-0 pod that vanished (deleted, node gone) before it was seen to end."""
    evidence = AttemptEvidence(node_lost=True)
    return PodEnding(
        termination=Termination(
            TerminationReason.PREEMPTED, f"Rank 0's pod {pod_name} was lost before it ended: {why}."
        ),
        evidence=evidence,
        pod_name=pod_name,
        node_name=None,
        phase=None,
        pod_reason=None,
        container_reason=None,
        message=TerminationMessage(),
        disrupted=True,
        oom_killed=False,
    )


def workload_failure(obj: Mapping[str, Any]) -> str | None:
    """A TrainJob's, JobSet's or Job's ``Failed=True`` condition as one line; else None."""
    for condition in _get(obj, "status", "conditions") or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") == "Failed"
            and condition.get("status") == "True"
        ):
            reason = condition.get("reason") or "Failed"
            said = condition.get("message")
            return redact.text(f"{reason}: {said}" if said else str(reason))
    return None


def ending_without_pod(kind: str, name: str, failure: str) -> Termination:
    """The verdict when the workload failed before rank 0 ever ran."""
    if failure.startswith("DeadlineExceeded"):
        return Termination(
            TerminationReason.TIMEOUT,
            f"{kind} {name} hit its deadline before rank 0 ran: {failure}.",
        )
    # An admission or runtime error repeats on retry: stop rather than spend a retry budget.
    return Termination(
        TerminationReason.USER_CODE_ERROR, f"{kind} {name} failed before rank 0 ran: {failure}."
    )


def _trainer_said(evidence: AttemptEvidence) -> bool:
    """True when the launcher left a verdict other than success: it knows best (e.g. oom)."""
    said = (evidence.last_words or {}).get("reason")
    return isinstance(said, str) and said not in ("", TerminationReason.SUCCEEDED.value)


def _exit_phrase(evidence: AttemptEvidence) -> str:
    if evidence.exit_code is None:
        return "the container left no exit code"
    return f"the container exited {evidence.exit_code}"


def _memory_limit(pod: Mapping[str, Any]) -> str | None:
    for container in _get(pod, "spec", "containers") or []:
        if isinstance(container, Mapping) and container.get("name") == CONTAINER_NAME:
            limit = _get(container, "resources", "limits", "memory")
            return str(limit) if limit is not None else None
    return None
