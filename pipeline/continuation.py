"""Which runs should get another attempt now, and which attempts went silent.

The resume sensor is a thin loop over this: the ledger, not Dagster's run events, is the truth
about what ended how (a sensor's cursor misses failures from before it was turned on).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

from pipeline.attempts import accelerators_held, step_reached
from pipeline.ledger import AttemptAlreadyEndedError, AttemptRecord, Ledger, RunRecord
from pipeline.reasons import classify, evidence_for_attempt
from pipeline.retry import (
    RetryAction,
    RetryDecision,
    RetryPolicyError,
    decide_from_ledger,
    end_with_decision,
    policy_for_run,
)
from pipeline.states import RunStatus, TerminationReason
from pipeline.tracking import mirror_attempt

CONTINUING_ACTIONS = (RetryAction.RESUME, RetryAction.RETRY, RetryAction.ROLLBACK)

# The Dagster step that saw its trainer die opens the next attempt itself (continuing in place)
# when the decision continues the run and waits at most this long: a preemption waits 0 s, and
# a wait this short costs the step less than a new Dagster run would (6.3 s of sensor tick,
# daemon launch and code location load on 2 quiet vCPUs, 12.5 s under load;
# bench/results/2026-11-27-resume-latency-in-place.md).
# A longer backoff (infra_transient's 30 s and up) is left to the resume sensor, so a Dagster
# run never sits idle holding its run slot through a wait.
IN_RUN_MAX_BACKOFF_SECONDS = 5.0
# How long the resume sensor leaves an attempt to the Dagster run that hosted it while that run
# is not finished: a silent attempt's ending (that step sees its trainer exit, or its pod's
# status) and an ended attempt's continuation (the step opens the next attempt within seconds
# of closing one). Counted from when the attempt went quiet: its end, or its heartbeat's
# timeout if that came first. A run still unfinished long after (its run worker died with the
# node and nothing marked the run failed) holds neither: the sensor closes the attempt from
# what remains and continues the run, and fencing tokens make a late second attempt lose.
IN_RUN_CLAIM_SECONDS = 120.0


def continues_in_run(decision: RetryDecision) -> bool:
    """Whether the step that ran the ended attempt opens the next one itself: the decision
    continues the run (resume, retry, rollback) after a backoff of at most
    :data:`IN_RUN_MAX_BACKOFF_SECONDS`. The budget is already in the decision: a spent one
    says stop."""
    seconds = decision.backoff_seconds
    return (
        decision.action in CONTINUING_ACTIONS
        and math.isfinite(seconds)
        and 0 <= seconds <= IN_RUN_MAX_BACKOFF_SECONDS
    )


def went_quiet_at(attempt: AttemptRecord, heartbeat_timeout_seconds: float) -> datetime:
    """When ``attempt`` went quiet: its end, or the moment its last heartbeat (its start, before
    the first) passed the timeout, whichever came first."""
    beat = attempt.heartbeat_at or attempt.started_at
    expired = beat + timedelta(seconds=heartbeat_timeout_seconds)
    return min(attempt.ended_at, expired) if attempt.ended_at is not None else expired


def in_run_claim_open(
    attempt: AttemptRecord, now: datetime, heartbeat_timeout_seconds: float
) -> bool:
    """Whether ``attempt`` (its ending where it is silent, its continuation where it ended)
    still belongs to the Dagster run that hosted it, when that run is not finished: within
    :data:`IN_RUN_CLAIM_SECONDS` of :func:`went_quiet_at`.

    An attempt the sensor closed after the claim ran out is not claimed again by its end: the
    continuation goes out on the same tick, not :data:`IN_RUN_CLAIM_SECONDS` later.
    """
    quiet = went_quiet_at(attempt, heartbeat_timeout_seconds)
    return (now - quiet).total_seconds() <= IN_RUN_CLAIM_SECONDS


class HostingRun(StrEnum):
    """What the Dagster run that launched an attempt says about it, as the resume sensor reads
    that run's status (:func:`in_run_claim_open` bounds the first and the second)."""

    AT_WORK = "at_work"  # starting, started or being terminated: its step may still end it
    TERMINATED = "terminated"  # a person terminated it, and it ended without ending the attempt
    GONE = "gone"  # finished otherwise, unknown, or unfinished past its claim: no evidence


@dataclass(frozen=True)
class Continuation:
    """A run whose last attempt ended with a decision to continue it."""

    run: RunRecord
    ended: AttemptRecord
    decision: RetryDecision
    not_before: datetime

    @property
    def next_attempt_no(self) -> int:
        return self.ended.attempt_no + 1

    @property
    def run_key(self) -> str:
        # One Dagster run per (run, attempt number), however many ticks see it.
        return f"{self.run.run_id}:attempt-{self.next_attempt_no}"


def pending_continuations(
    ledger: Ledger, *, on_skip: Callable[[str, str], None]
) -> list[Continuation]:
    """Runs still ``running`` whose newest attempt ended with resume, retry or rollback.

    A run whose stored decision cannot be read, or names a wait no clock can hold (a legacy or
    hand-edited row), is left out and handed to ``on_skip(run_key, why)``: one bad row must
    not hold up every other run's continuation.
    """
    found = []
    for run in ledger.find_runs(status=RunStatus.RUNNING, limit=1000):
        last = ledger.latest_attempt(run.run_id)
        if last is None or last.ended_at is None or not last.retry_decision:
            continue
        try:
            decision = RetryDecision.from_json(last.retry_decision)
            if decision.action not in CONTINUING_ACTIONS:
                continue
            not_before = last.ended_at + _backoff(decision)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            on_skip(
                f"{run.run_id}:attempt-{last.attempt_no + 1}",
                f"the retry decision stored on attempt {last.key} is unusable "
                f"({type(exc).__name__}: {exc}); decide again or stop the run",
            )
            continue
        found.append(Continuation(run, last, decision, not_before))
    return found


def _backoff(decision: RetryDecision) -> timedelta:
    seconds = decision.backoff_seconds
    # timedelta(seconds=nan) fails with a message that names no value, and no policy asks
    # for a negative wait: either is a row written by something else.
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"backoff_seconds is {seconds!r}, not a finite wait >= 0")
    return timedelta(seconds=seconds)


def expire_silent_attempts(
    ledger: Ledger,
    heartbeat_timeout_seconds: float,
    *,
    now: datetime | None = None,
    checkpoint_root: Path | None = None,
    tracking_uri: str | None = None,
    on_warning: Callable[[str], None] | None = None,
    hosting_run: Callable[[AttemptRecord], HostingRun] | None = None,
) -> list[AttemptRecord]:
    """Close attempts that are alive on paper but silent past the timeout (node lost).

    Each is classified from what remains (heartbeat age, last committed checkpoint) and gets
    its retry decision, exactly like an attempt whose process exit was seen. With
    ``tracking_uri``, the run's MLflow run is told too (it would otherwise stay RUNNING);
    what MLflow refused goes to ``on_warning``.

    ``hosting_run`` says what the Dagster run that launched an attempt is doing. At work, it
    keeps the attempt open: it will end it from what it sees (the trainer's exit, the pod's
    status), which beats an inference from silence. Terminated by a person without closing it
    (its run worker killed before its cleanup), the attempt ends ``cancelled``, whatever the stop
    left behind: a preemption would be resumed, against that person's decision.
    """
    now = now or datetime.now(UTC)
    closed = []
    for attempt in ledger.silent_attempts(heartbeat_timeout_seconds, now=now):
        hosting = hosting_run(attempt) if hosting_run is not None else HostingRun.GONE
        if hosting is HostingRun.AT_WORK:
            continue
        latest = ledger.latest_committed_checkpoint(attempt.run_id)
        # A trainer that could not reach the ledger still wrote its last words to disk: they
        # are the evidence of how it ended (infra_transient, a signal), read before silence.
        words = _last_words(checkpoint_root, attempt)
        signal = words.get("signal") if isinstance(words.get("signal"), str) else None
        reached = words.get("step") if isinstance(words.get("step"), int) else None
        termination = classify(
            evidence_for_attempt(
                attempt,
                signal_name=signal,
                last_words=words or None,
                last_committed_step=latest.step if latest else None,
                step_reached=reached,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                now=now,
                terminated_dagster_run=(
                    attempt.dagster_run_id if hosting is HostingRun.TERMINATED else None
                ),
            )
        )
        # The accelerators were held from the start to the last heartbeat at least: that is
        # charged. Past it nobody knows. CPU time stays 0: it is a measured figure (the
        # trainer's own process clock), and a silent trainer never reported one; wall x ranks
        # would state a measurement nobody made, while GPU-seconds are a reservation anyway.
        held = max((attempt.heartbeat_at - attempt.started_at).total_seconds(), 0.0)
        run = ledger.get_run(attempt.run_id)

        def decide_for(ended: AttemptRecord, run: RunRecord = run) -> RetryDecision:
            try:
                policy = policy_for_run(run)
            except RetryPolicyError as exc:
                # A stored policy that no longer loads (written before its numbers were
                # bounded) must not fail the tick for every run: this one stops, and says why.
                return _stop_for_unreadable_policy(ended, exc)
            return decide_from_ledger(ledger, policy, ended)

        try:
            _, decision = end_with_decision(
                ledger,
                attempt,
                decide_for,
                termination_reason=termination.reason,
                termination_detail=termination.detail,
                signal=signal,
                gpu_seconds=held * accelerators_held(attempt.placement or {}),
                last_step=step_reached(ledger, attempt, reached),
            )
        except AttemptAlreadyEndedError:
            continue  # its own process ended it meanwhile, with what it saw: not silent after all
        if not decision.continues:
            ledger.set_run_status(run.run_id, RunStatus.FAILED)
        unmirrored = mirror_attempt(
            ledger, attempt.run_id, attempt.attempt_no, tracking_uri=tracking_uri
        )
        if unmirrored and on_warning is not None:
            on_warning(unmirrored)
        closed.append(ledger.get_attempt(attempt.run_id, attempt.attempt_no))
    return closed


def _stop_for_unreadable_policy(ended: AttemptRecord, error: RetryPolicyError) -> RetryDecision:
    return RetryDecision(
        action=RetryAction.STOP,
        rule="retry_policy_unreadable",
        reason=f"Stop: the retry policy stored on run {ended.run_id} does not load ({error}); "
        f"a person decides whether attempt {ended.attempt_no + 1} follows.",
        termination_reason=TerminationReason(ended.termination_reason),
        attempt_no=ended.attempt_no,
        budget_left={"count": None, "gpu_seconds": None},
        spent={},
    )


def _last_words(checkpoint_root: Path | None, attempt: AttemptRecord) -> dict[str, Any]:
    if checkpoint_root is None:
        return {}
    from pipeline.reasons import read_last_words
    from pipeline.trainer.attempt import last_words_path

    words = read_last_words(last_words_path(checkpoint_root, attempt.run_id, attempt.attempt_no))
    # Only this attempt's words count (a file copied from elsewhere names another attempt).
    if not words or words.get("attempt_no") != attempt.attempt_no:
        return {}
    return words
