"""Which runs should get another attempt now, and which attempts went silent.

The resume sensor is a thin loop over this: the ledger, not Dagster's run events, is the truth
about what ended how (a sensor's cursor misses failures from before it was turned on).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pipeline.ledger import AttemptRecord, Ledger, RunRecord
from pipeline.reasons import classify, evidence_for_attempt
from pipeline.retry import RetryAction, RetryDecision, decide, policy_for_run, record_decision
from pipeline.states import RunStatus

CONTINUING_ACTIONS = (RetryAction.RESUME, RetryAction.RETRY, RetryAction.ROLLBACK)


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


def pending_continuations(ledger: Ledger) -> list[Continuation]:
    """Runs still ``running`` whose newest attempt ended with resume, retry or rollback."""
    found = []
    for run in ledger.find_runs(status=RunStatus.RUNNING, limit=1000):
        last = ledger.latest_attempt(run.run_id)
        if last is None or last.ended_at is None or not last.retry_decision:
            continue
        decision = RetryDecision.from_json(last.retry_decision)
        if decision.action not in CONTINUING_ACTIONS:
            continue
        not_before = last.ended_at + timedelta(seconds=decision.backoff_seconds)
        found.append(Continuation(run, last, decision, not_before))
    return found


def expire_silent_attempts(
    ledger: Ledger,
    heartbeat_timeout_seconds: float,
    *,
    now: datetime | None = None,
    checkpoint_root: Path | None = None,
) -> list[AttemptRecord]:
    """Close attempts that are alive on paper but silent past the timeout (node lost).

    Each is classified from what remains (heartbeat age, last committed checkpoint) and gets
    its retry decision, exactly like an attempt whose process exit was seen.
    """
    now = now or datetime.now(UTC)
    closed = []
    for attempt in ledger.silent_attempts(heartbeat_timeout_seconds, now=now):
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
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                now=now,
            )
        )
        steps = [s for s in (reached, latest.step if latest else None) if s is not None]
        ended = ledger.end_attempt(
            attempt.run_id,
            attempt.attempt_no,
            termination_reason=termination.reason,
            termination_detail=termination.detail,
            signal=signal,
            last_step=max(steps) if steps else None,
        )
        run = ledger.get_run(attempt.run_id)
        decision = decide(
            policy_for_run(run),
            ledger.attempts(run.run_id),
            ended,
            checkpoints=ledger.checkpoints(run.run_id),
        )
        record_decision(ledger, ended, decision)
        if not decision.continues:
            ledger.set_run_status(run.run_id, RunStatus.FAILED)
        closed.append(ledger.get_attempt(attempt.run_id, attempt.attempt_no))
    return closed


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
