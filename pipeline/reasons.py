"""Deciding an attempt's one termination reason from the evidence it left behind."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.states import TerminationReason
from pipeline.trainer import exit_codes

_BY_EXIT_CODE: dict[int, TerminationReason] = {
    exit_codes.SUCCEEDED: TerminationReason.SUCCEEDED,
    exit_codes.PREEMPTED: TerminationReason.PREEMPTED,
    exit_codes.BAD_INPUT: TerminationReason.BAD_INPUT,
    exit_codes.DIVERGED: TerminationReason.DIVERGED,
    exit_codes.OOM: TerminationReason.OOM,
    exit_codes.TIMEOUT: TerminationReason.TIMEOUT,
    exit_codes.INFRA_TRANSIENT: TerminationReason.INFRA_TRANSIENT,
    exit_codes.CONFIG_ERROR: TerminationReason.USER_CODE_ERROR,
    exit_codes.USER_CODE_ERROR: TerminationReason.USER_CODE_ERROR,
}


@dataclass(frozen=True)
class Termination:
    """The one reason an attempt ended, and one honest sentence about it."""

    reason: TerminationReason
    detail: str


def read_last_words(path: Path) -> dict[str, Any] | None:
    """The trainer's last written words, or None if it died before it could write them."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def classify_exit(
    *,
    returncode: int,
    signal_name: str | None,
    last_words: dict[str, Any] | None,
    cancelled: bool = False,
    last_committed_step: int | None = None,
) -> Termination:
    """Exactly one reason from exit code, signal, the trainer's last words and who asked."""
    said = (last_words or {}).get("detail")
    if cancelled:
        return Termination(
            TerminationReason.CANCELLED,
            "A person terminated the Dagster run; the trainer was asked to checkpoint and stop"
            + (f" and committed step {last_committed_step}." if last_committed_step else "."),
        )
    if signal_name is not None:
        # Killed without a chance to speak (SIGKILL, OOM killer, node loss): the scheduler
        # took the process away; the committed checkpoint is what survives.
        where = (
            f"the last committed checkpoint is step {last_committed_step}"
            if last_committed_step is not None
            else "no checkpoint was committed"
        )
        return Termination(
            TerminationReason.PREEMPTED,
            f"The trainer was killed by {signal_name} without writing last words; {where}.",
        )
    reason = _BY_EXIT_CODE.get(returncode)
    if last_words and last_words.get("reason") in TerminationReason._value2member_map_:
        reason = TerminationReason(last_words["reason"])
    if reason is None:
        return Termination(
            TerminationReason.USER_CODE_ERROR,
            said or f"The trainer exited with unexpected code {returncode}.",
        )
    if reason == TerminationReason.SUCCEEDED:
        return Termination(
            reason, said or "Trained to max_steps and committed the final checkpoint."
        )
    return Termination(reason, said or f"The trainer exited with code {returncode} ({reason}).")
