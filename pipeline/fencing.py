"""Fenced out: which newer attempt took a run over, and the sentence of the one it fenced out.

Both sides of an attempt write that sentence: the orchestrator when it finishes an attempt
(``pipeline.attempts``) and a self-owned trainer when it ends its own
(``pipeline.trainer.attempt``). It lives here, below them both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.reasons import AttemptEvidence, classify
from pipeline.states import TerminationReason
from pipeline.trainer import exit_codes

if TYPE_CHECKING:
    from pipeline.ledger import AttemptRecord, Ledger


def newer_attempt(ledger: Ledger, attempt: AttemptRecord) -> dict[str, Any] | None:
    """The attempt that holds the run's fencing token now, if a newer one took it from ``attempt``.

    ``{"attempt_no": …, "via": …}``: who took the run over and how it was launched, for the
    sentence of an attempt that was fenced out.
    """
    run = ledger.get_run(attempt.run_id)
    if run.fencing_token <= attempt.fencing_token:
        return None
    holder = next(
        (a for a in ledger.attempts(attempt.run_id) if a.fencing_token == run.fencing_token), None
    )
    if holder is None:
        return None
    return {"attempt_no": holder.attempt_no, "via": (holder.launched_by or {}).get("via")}


def fenced_detail(ledger: Ledger, run_id: str, attempt_no: int, step: int | None) -> str:
    """The sentence of a self-owned attempt fenced out at ``step``: who took the run over."""
    attempt = ledger.get_attempt(run_id, attempt_no)
    latest = ledger.latest_committed_checkpoint(run_id)
    return classify(
        AttemptEvidence(
            exit_code=exit_codes.FENCED,
            last_words={"reason": str(TerminationReason.FENCED), "step": step},
            last_committed_step=latest.step if latest else None,
            newer_attempt=newer_attempt(ledger, attempt),
        )
    ).detail
