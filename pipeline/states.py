"""The words of docs/architecture.md as enums: one word for one idea, in code, tables, CLI, UI."""

from __future__ import annotations

from enum import StrEnum


class Purpose(StrEnum):
    BASELINE = "baseline"
    TUNING = "tuning"
    ABLATION = "ablation"
    RECOVERY = "recovery"
    CANARY = "canary"
    SCHEDULED = "scheduled"


class RunStatus(StrEnum):
    """Where a run stands. `tracks explain` says the same words."""

    RUNNING = "running"  # an attempt is running, or the retry policy will start another
    TRAINED = "trained"  # training finished (final checkpoint committed); not promoted yet
    PROMOTED = "promoted"  # its checkpoint became the champion
    REFUSED = "refused"  # trained, but the promotion gate refused it; the promotion row says why
    FAILED = "failed"  # stopped by the retry policy; its attempts say why


class AttemptStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class TerminationReason(StrEnum):
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"
    INFRA_TRANSIENT = "infra_transient"
    OOM = "oom"
    BAD_INPUT = "bad_input"
    DIVERGED = "diverged"
    TIMEOUT = "timeout"
    EVALUATOR_CRASH = "evaluator_crash"
    USER_CODE_ERROR = "user_code_error"
    CANCELLED = "cancelled"  # a person asked for the stop
    FENCED = "fenced"  # a newer attempt of the run holds its fencing token and carries it on
    HUNG = "hung"  # a rank made no step progress past its watchdog's threshold (exit 81)


def attempt_status(reason: TerminationReason | str) -> AttemptStatus:
    """The status of an attempt that ended for ``reason``: succeeded, or failed."""
    if reason == TerminationReason.SUCCEEDED:
        return AttemptStatus.SUCCEEDED
    return AttemptStatus.FAILED


class CheckpointState(StrEnum):
    WRITING = "writing"
    COMMITTED = "committed"
    SUPERSEDED = "superseded"
    CORRUPT = "corrupt"  # failed verification; never a resume target again


class EvaluationStatus(StrEnum):
    COMPLETE = "complete"
    FAILED = "failed"


class PromotionDecision(StrEnum):
    PROMOTED = "promoted"
    REFUSED = "refused"
    # The candidate's weights are byte-identical to the champion's: no new version was
    # registered and the alias did not move (the row names the champion's version and run).
    UNCHANGED = "unchanged"
