"""Exit codes of ``python -m pipeline.trainer``: one per termination reason the trainer can know.

The classifier (``pipeline.reasons``) maps them back to reasons, together with the trainer's
last words; the numbers follow sysexits.h where one fits.
"""

from __future__ import annotations

from pipeline.states import TerminationReason

SUCCEEDED = 0
USER_CODE_ERROR = 1  # an exception in model or training code
BAD_INPUT = 65  # EX_DATAERR: snapshot bytes differ from the manifest, schema problems
INFRA_TRANSIENT = 74  # EX_IOERR: storage or ledger errors worth a quick retry
PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM/SIGINT, final checkpoint committed
DIVERGED = 76  # NaN/Inf loss
OOM = 77  # torch.OutOfMemoryError
CONFIG_ERROR = 78  # EX_CONFIG: the config does not load, or does not match the run
TIMEOUT = 79  # max_wall_seconds reached, final checkpoint committed
FENCED = 80  # a newer attempt holds the run's fencing token; this one stopped
HUNG = 81  # the hang watchdog saw no step finish past its threshold; stacks in the last words

REASON_BY_EXIT_CODE: dict[int, TerminationReason] = {
    SUCCEEDED: TerminationReason.SUCCEEDED,
    USER_CODE_ERROR: TerminationReason.USER_CODE_ERROR,
    BAD_INPUT: TerminationReason.BAD_INPUT,
    INFRA_TRANSIENT: TerminationReason.INFRA_TRANSIENT,
    PREEMPTED: TerminationReason.PREEMPTED,
    DIVERGED: TerminationReason.DIVERGED,
    OOM: TerminationReason.OOM,
    CONFIG_ERROR: TerminationReason.USER_CODE_ERROR,
    TIMEOUT: TerminationReason.TIMEOUT,
    # Not this attempt's failure and not worth a retry: the newer attempt carries the run on.
    FENCED: TerminationReason.FENCED,
    # Alive but stuck: ended by its own watchdog, resumed from the last commit on a budget.
    HUNG: TerminationReason.HUNG,
}
