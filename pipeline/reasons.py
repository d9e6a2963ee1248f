"""Deciding an attempt's one termination reason from the evidence it left behind.

The orchestrator gathers an :class:`AttemptEvidence` when an attempt ends (or when its heartbeat
goes silent) and :func:`classify` turns it into exactly one :class:`~pipeline.states.
TerminationReason` and one honest sentence. The rules, first match wins:

1. exit 0 and nothing against it: ``succeeded``.
2. evidence from an evaluator (``evaluator`` set) that did not succeed: ``evaluator_crash``.
3. a person cancelled, or terminated the Dagster run that launched the attempt, which ended
   without closing it: ``cancelled``; a newer attempt holds the run's fencing token (exit 80,
   ``StaleFencingTokenError``): ``fenced``.
4. SIGKILL (or exit 137) and the cgroup's ``oom_kill`` counter went up: ``oom``.
5. the trainer's last words, when present and consistent with the exit code: their reason
   (``hung``: a rank's watchdog saw no step finish past its threshold, exit 81; the words name
   the stuck rank, the phase and step it was in and the top frames of its stack).
6. a signal, a lost node or an expired heartbeat: ``timeout`` if the wall-clock limit was
   reached, else ``preempted`` (the scheduler took the process away).
7. the exception type (and message): ``oom``, ``infra_transient``, ``diverged``, ``bad_input``,
   else ``user_code_error``.
8. the exit code of ``python -m pipeline.trainer`` (``pipeline.trainer.exit_codes``).
9. anything else: ``user_code_error`` naming the unexpected exit code.
"""

from __future__ import annotations

import errno
import json
import re
import signal as signals
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import redact
from pipeline.states import TerminationReason
from pipeline.trainer import exit_codes

if TYPE_CHECKING:
    from pipeline.ledger import AttemptRecord

R = TerminationReason

# Signals that mean "the platform took the process away" rather than "the code crashed".
_PREEMPTING_SIGNALS = frozenset({"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGPWR"})
# Native crashes: a bug in model code or an extension, not the platform.
_CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGABRT", "SIGILL", "SIGFPE", "SIGSYS", "SIGTRAP"})
# SIGBUS in training is nearly always /dev/shm or a network file system going away.
_INFRA_SIGNALS = frozenset({"SIGBUS", "SIGPIPE"})

_OOM_EXCEPTIONS = frozenset({"OutOfMemoryError", "MemoryError"})
_DIVERGED_EXCEPTIONS = frozenset(
    {"FloatingPointError", "DivergedError", "NonFiniteLossError", "LossSpikeError"}
)
_BAD_INPUT_EXCEPTIONS = frozenset(
    {
        "BadInputError",
        "DataError",
        "SnapshotIntegrityError",
        "SnapshotMismatchError",
        "SnapshotNotFoundError",
        "MissingColumnError",
        "EmptySplitError",
        "NoLandingFilesError",
        "SchemaError",  # pandera
        "SchemaErrors",
        "SchemaContractError",
        "DataQualityError",
        "ArrowInvalid",  # pyarrow: a Parquet file that does not parse
    }
)
_INFRA_EXCEPTIONS = frozenset(
    {
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "TimeoutError",
        "timeout",  # socket.timeout
        "DistError",
        "DistNetworkError",
        "DistStoreError",
        "DistBackendError",
        "RendezvousError",
        "RendezvousTimeoutError",
        "RendezvousConnectionError",
        "RendezvousClosedError",
        "OperationalError",  # a database that blinked
        "InterfaceError",
        "EndpointConnectionError",  # botocore
        "ReadTimeoutError",
        "ReadTimeout",
        "ConnectTimeout",
        "LandingChangedError",
    }
)
# OSErrors that are a caller's mistake (a wrong path), not storage misbehaving.
_USER_OS_ERRORS = frozenset(
    {"FileNotFoundError", "PermissionError", "IsADirectoryError", "NotADirectoryError"}
)
_USER_CODE_EXCEPTIONS = frozenset({"ConfigError", "CheckpointMismatchError", "UnknownSplitError"})
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ESTALE,
        errno.EAGAIN,
        errno.ENOSPC,
        errno.EREMOTEIO,
    }
)
_INFRA_MESSAGE = re.compile(
    r"nccl|rendezvous|collective operation timeout|watchdog caught|connection reset|"
    r"timed out|stale file handle|input/output error|no space left|"
    r"connection refused|temporarily unavailable|broken pipe",
    re.IGNORECASE,
)
_OOM_MESSAGE = re.compile(r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|OOM", re.IGNORECASE)
_NONFINITE_MESSAGE = re.compile(r"\b(nan|inf|non-finite|not finite)\b", re.IGNORECASE)


class InsufficientEvidenceError(ValueError):
    """Nothing says the attempt ended: no exit code, no signal, and its heartbeat is fresh."""


@dataclass(frozen=True)
class Termination:
    """The one reason an attempt ended, and one honest sentence about it."""

    reason: TerminationReason
    detail: str


@dataclass(frozen=True)
class AttemptEvidence:
    """Everything known about how an attempt (or an evaluation) ended.

    Fields are optional because a silent death leaves little: a SIGKILLed trainer has no last
    words, a lost node not even an exit code. ``cgroup_oom_kills`` is how many times the
    cgroup's OOM killer fired during the attempt (see :func:`read_cgroup_oom_kills`).
    ``last_committed_step`` is the run's newest committed checkpoint (the ledger's), and
    ``step_reached`` the furthest step the attempt is known to have trained: two facts, never
    one in the other's words. ``newer_attempt`` is the attempt that holds the run's fencing
    token now (``{"attempt_no": …, "via": …}``), when it is not this one.
    ``terminated_dagster_run`` is the Dagster run that launched the attempt, where a person
    terminated it and it ended without closing the attempt (the resume sensor's evidence).
    """

    exit_code: int | None = None
    signal: str | None = None
    exception_type: str | None = None
    exception_message: str | None = None
    last_words: Mapping[str, Any] | None = None
    cgroup_oom_kills: int | None = None
    cancelled: bool = False
    node_lost: bool = False
    heartbeat_age_seconds: float | None = None
    heartbeat_timeout_seconds: float | None = None
    last_committed_step: int | None = None
    wall_seconds: float | None = None
    max_wall_seconds: float | None = None
    evaluator: str | None = None
    step_reached: int | None = None
    newer_attempt: Mapping[str, Any] | None = None
    terminated_dagster_run: str | None = None

    @property
    def signal_name(self) -> str | None:
        """The signal, from ``signal`` or a negative / 128+N exit code (shells, containers)."""
        if self.signal:
            return _normalise_signal(self.signal)
        code = self.exit_code
        if code is not None and (code < 0 or 128 < code < 128 + 65):
            number = -code if code < 0 else code - 128
            try:
                return signals.Signals(number).name
            except ValueError:
                return f"SIG{number}"
        return None

    @property
    def heartbeat_expired(self) -> bool:
        return (
            self.heartbeat_age_seconds is not None
            and self.heartbeat_timeout_seconds is not None
            and self.heartbeat_age_seconds > self.heartbeat_timeout_seconds
        )

    @property
    def wall_limit_reached(self) -> bool:
        return (
            self.wall_seconds is not None
            and self.max_wall_seconds is not None
            and self.wall_seconds >= self.max_wall_seconds
        )


def _normalise_signal(name: str) -> str:
    name = name.strip().upper()
    if name.isdigit():
        try:
            return signals.Signals(int(name)).name
        except ValueError:
            return f"SIG{name}"
    return name if name.startswith("SIG") else f"SIG{name}"


def _short_type(name: str | None) -> str | None:
    # "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError" and "OutOfMemoryError" are one.
    return name.rsplit(".", 1)[-1] if name else None


def _where(e: AttemptEvidence, *, reached: bool = True) -> str:
    """The last committed step, after the step reached when the attempt trained past it."""
    committed = e.last_committed_step
    where = (
        "no checkpoint was committed"
        if committed is None
        else f"the last committed checkpoint is step {committed}"
    )
    past = e.step_reached is not None and (committed is None or e.step_reached > committed)
    return f"it reached step {e.step_reached}; {where}" if reached and past else where


def _exit_phrase(e: AttemptEvidence) -> str:
    return "no exit code" if e.exit_code is None else f"exit code {e.exit_code}"


def _step_phrase(step: Any) -> str:
    return f" at step {step}" if isinstance(step, int) else ""


def _sentence(text: str) -> str:
    text = " ".join(str(text).split())
    return text if text.endswith((".", "!", "?")) else text + "."


def _reason_of_exception(
    type_name: str | None, message: str | None, os_errno: int | None = None
) -> TerminationReason | None:
    """The reason an exception type (and its message) points at; None if there is no type."""
    short = _short_type(type_name)
    if short is None:
        return None
    text = message or ""
    if short in _OOM_EXCEPTIONS or (short == "RuntimeError" and _OOM_MESSAGE.search(text)):
        return R.OOM
    if short in _USER_CODE_EXCEPTIONS or short in _USER_OS_ERRORS:
        return R.USER_CODE_ERROR
    if short in _BAD_INPUT_EXCEPTIONS:
        return R.BAD_INPUT
    if short in _DIVERGED_EXCEPTIONS:
        return R.DIVERGED
    if short in _INFRA_EXCEPTIONS or (short.endswith("Error") and "Nccl" in short):
        return R.INFRA_TRANSIENT
    if short in {"OSError", "IOError"}:
        # A bare OSError is storage or network misbehaving unless its errno says otherwise.
        if os_errno is None or os_errno in _TRANSIENT_ERRNOS:
            return R.INFRA_TRANSIENT
        return R.USER_CODE_ERROR
    if short == "RuntimeError" and _INFRA_MESSAGE.search(text):
        return R.INFRA_TRANSIENT  # NCCL and c10d report timeouts as RuntimeError
    loss_went_bad = re.search(r"\bloss\b", text, re.I) and _NONFINITE_MESSAGE.search(text)
    if short in {"ValueError", "RuntimeError"} and loss_went_bad:
        return R.DIVERGED
    return R.USER_CODE_ERROR


def _exception_sentence(reason: TerminationReason, e: AttemptEvidence, step: Any) -> str:
    kind = e.exception_type or "an exception"
    said = redact.one_line(e.exception_message or "")[:300]
    head = f"{kind}{_step_phrase(step)}" + (f": {said}" if said else "")
    tail = {
        R.OOM: "the attempt ran out of accelerator or host memory",
        R.INFRA_TRANSIENT: "storage, network or a collective failed under the trainer",
        R.DIVERGED: "training went numerically wrong",
        R.BAD_INPUT: "the input data is not what the contract promises",
        R.USER_CODE_ERROR: "an error in model or training code",
    }[reason]
    return _sentence(f"{head} ({tail}; {_where(e)})")


def _from_last_words(e: AttemptEvidence) -> Termination | None:
    words = e.last_words
    if not words:
        return None
    said_reason = words.get("reason")
    if said_reason not in R._value2member_map_:
        return None
    reason = R(said_reason)
    if reason == R.SUCCEEDED:
        return None  # success is told by exit 0, never by a note left behind
    expected = None
    # Exit 1 contradicts nothing: it is also what Python and torchrun's agent exit with when a
    # worker fails, whatever the worker wrote.
    if e.exit_code not in (None, exit_codes.USER_CODE_ERROR) and e.signal_name is None:
        expected = exit_codes.REASON_BY_EXIT_CODE.get(e.exit_code)
    if expected is not None and expected != reason:
        return None  # inconsistent: the exit code and what follows from it decide
    detail = words.get("detail")
    if not detail:
        step = words.get("step")
        exc = words.get("exception_type")
        detail = (
            f"The trainer stopped{_step_phrase(step)} and said {reason}"
            + (f" ({exc})" if exc else "")
            + f"; {_where(e)}"
        )
    sig = e.signal_name
    if sig and sig not in detail:
        detail = _sentence(detail) + f" It was then killed by {sig} before it exited."
    return Termination(reason, _sentence(detail))


def classify(evidence: AttemptEvidence) -> Termination:
    """Exactly one termination reason, and one sentence naming the step, signal or exception.

    The sentence is stored and printed, so no URL password in it survives: it may quote last
    words written by an older trainer that did not redact, or a platform's message.

    Raises :class:`InsufficientEvidenceError` for an attempt that has not visibly ended (no
    exit code, no signal, not cancelled, node not lost, heartbeat not expired).
    """
    found = _classify(evidence)
    return replace(found, detail=redact.text(found.detail))


def _classify(evidence: AttemptEvidence) -> Termination:
    e = evidence
    sig = e.signal_name
    words = dict(e.last_words or {})
    step = words.get("step")  # where it failed; the last committed step is said apart
    exc_type = e.exception_type or words.get("exception_type")
    exc_message = e.exception_message or words.get("exception_message")
    if isinstance(exc_message, str):
        # Redacted here, before any sentence cuts it short and hides the URL's '@'.
        exc_message = redact.text(exc_message)
    if exc_type != e.exception_type or exc_message != e.exception_message:
        e = replace(e, exception_type=exc_type, exception_message=exc_message)

    # 1. A clean exit is a success, whatever was asked of it.
    if e.exit_code == 0 and sig is None and not e.node_lost:
        if e.evaluator:
            return Termination(R.SUCCEEDED, f"Evaluator {e.evaluator} finished with exit code 0.")
        detail = words.get("detail") or (
            f"The trainer exited 0 and committed its final checkpoint at step "
            f"{e.last_committed_step}."
            if e.last_committed_step is not None
            else "The trainer exited 0."
        )
        return Termination(R.SUCCEEDED, _sentence(detail))

    # 2. An evaluator's failure is its own reason: retry the evaluator, never the training.
    if e.evaluator and not e.cancelled:
        cause = exc_type or (f"signal {sig}" if sig else _exit_phrase(e))
        said = " ".join((exc_message or "").split())[:300]
        return Termination(
            R.EVALUATOR_CRASH,
            _sentence(
                f"Evaluator {e.evaluator} crashed with {cause}"
                + (f": {said}" if said else "")
                + "; the training checkpoint is untouched"
            ),
        )

    # 3. A person asked for it. A terminated Dagster run that never closed its attempt (its run
    # worker killed before its cleanup) is that person's doing too, whatever signal or last
    # words the stop left: never a preemption to resume.
    if e.terminated_dagster_run is not None and not e.cancelled:
        how = f"; the trainer stopped on {sig}" if sig else ""
        return Termination(
            R.CANCELLED,
            _sentence(
                f"A person terminated Dagster run {e.terminated_dagster_run}, which launched "
                f"this attempt, and that run ended without closing its receipt{how}; "
                f"{_where(e)}"
            ),
        )
    if e.cancelled:
        by = f" (the trainer then exited on {sig})" if sig else ""
        return Termination(
            R.CANCELLED,
            _sentence(
                f"A person cancelled the run; the trainer was asked to checkpoint and stop{by}, "
                f"and {_where(e)}"
            ),
        )

    # 3b. A newer attempt took the run's fencing token: this one stopped, nobody's failure.
    if _fenced(e, sig, words):
        return _fenced_termination(e, step)

    # 4. The kernel's OOM killer leaves no last words, only a counter in the cgroup.
    if sig == "SIGKILL" and e.cgroup_oom_kills:
        return Termination(
            R.OOM,
            _sentence(
                f"Killed by SIGKILL after the cgroup OOM killer fired "
                f"(memory.events oom_kill +{e.cgroup_oom_kills}); host memory ran out and "
                f"{_where(e)}"
            ),
        )

    # 5. What the trainer wrote before it exited, if the exit code agrees.
    if said := _from_last_words(e):
        return said

    # 6. Taken away by the platform: a signal, a lost node, a heartbeat gone silent.
    silent = e.exit_code is None and sig is None and exc_type is None
    if silent and not e.node_lost and not e.heartbeat_expired:
        raise InsufficientEvidenceError(
            "no exit code, no signal, no exception, node not lost and heartbeat not expired "
            f"(age {e.heartbeat_age_seconds}s, timeout {e.heartbeat_timeout_seconds}s): "
            "the attempt has not visibly ended"
        )
    if sig in _PREEMPTING_SIGNALS or e.node_lost or silent:
        if sig is not None:
            how = f"Killed by {sig} without writing last words"
        elif e.node_lost:
            how = "The node or pod was lost (evicted or unreachable) without last words"
        else:
            how = (
                f"The heartbeat expired: none for {e.heartbeat_age_seconds:.0f}s "
                f"(timeout {e.heartbeat_timeout_seconds:.0f}s) and no exit was seen, so the "
                "trainer is taken to be lost"
            )
        if e.wall_limit_reached:
            return Termination(
                R.TIMEOUT,
                _sentence(
                    f"{how} after {e.wall_seconds:.0f}s, past the wall-clock limit of "
                    f"{e.max_wall_seconds:.0f}s; {_where(e)}"
                ),
            )
        return Termination(R.PREEMPTED, _sentence(f"{how}; {_where(e)}"))
    if sig in _CRASH_SIGNALS:
        return Termination(
            R.USER_CODE_ERROR,
            _sentence(f"The trainer crashed with {sig} (native code); {_where(e)}"),
        )
    if sig in _INFRA_SIGNALS:
        return Termination(
            R.INFRA_TRANSIENT,
            _sentence(
                f"The trainer died of {sig} (shared memory or a network file system went away); "
                f"{_where(e)}"
            ),
        )

    # 7. An exception the orchestrator saw (a Pipes error message, a traceback).
    os_errno = words.get("errno") if isinstance(words.get("errno"), int) else None
    if (by_exception := _reason_of_exception(exc_type, exc_message, os_errno)) is not None:
        by_code = exit_codes.REASON_BY_EXIT_CODE.get(e.exit_code) if e.exit_code else None
        # The trainer's own exit code is a considered verdict; prefer it when they differ,
        # except 1, which is also what Python exits with on any uncaught exception.
        generic = by_code in (None, R.SUCCEEDED) or e.exit_code == exit_codes.USER_CODE_ERROR
        reason = by_exception if generic else by_code
        return Termination(reason, _exception_sentence(reason, e, step))

    # 8. The trainer's exit codes.
    if e.exit_code is not None and (
        by_code := exit_codes.REASON_BY_EXIT_CODE.get(e.exit_code)
    ) not in (None, R.SUCCEEDED):
        if e.wall_limit_reached and by_code == R.PREEMPTED:
            by_code = R.TIMEOUT
        meaning = {
            R.PREEMPTED: "stopped on a signal and saved",
            R.TIMEOUT: "reached its wall-clock limit",
            R.OOM: "ran out of memory",
            R.DIVERGED: "saw a non-finite loss",
            R.BAD_INPUT: "found bad input data",
            R.INFRA_TRANSIENT: "hit a storage or network error",
            R.USER_CODE_ERROR: "raised an error in training code",
            R.HUNG: "finished no step past its hang watchdog's threshold",
        }[by_code]
        return Termination(
            by_code,
            _sentence(
                f"The trainer exited with code {e.exit_code} ({meaning}) without last words; "
                f"{_where(e)}"
            ),
        )

    # 9. Nothing we recognise.
    return Termination(
        R.USER_CODE_ERROR,
        _sentence(
            f"The trainer exited with unexpected {_exit_phrase(e)}"
            + (f" ({sig})" if sig else "")
            + f" and no last words; {_where(e)}"
        ),
    )


def _fenced(e: AttemptEvidence, sig: str | None, words: Mapping[str, Any]) -> bool:
    if e.exit_code == exit_codes.FENCED:
        return True
    # Without the exit code (a silent attempt), the words or the exception say it, unless a
    # signal came after them: then the signal is the ending.
    stale = _short_type(e.exception_type) == "StaleFencingTokenError"
    return (stale or words.get("reason") == R.FENCED) and sig is None


def _fenced_termination(e: AttemptEvidence, step: Any) -> Termination:
    newer = e.newer_attempt or {}
    number, via = newer.get("attempt_no"), newer.get("via")
    if isinstance(number, int):
        by = f"attempt {number}" + (f" (launched by {via})" if via else "")
    else:
        by = "a newer attempt of the run"
    if not isinstance(step, int):
        step = e.step_reached
    return Termination(
        R.FENCED,
        _sentence(
            f"Fenced out{_step_phrase(step)} by {by}, which holds a newer fencing token and "
            f"carries the run on; no person stopped this attempt, and {_where(e, reached=False)}"
        ),
    )


@dataclass(frozen=True)
class ObservedEnding:
    """What the platform that ran the trainer saw of its end: a Kubernetes pod's status.

    ``evidence`` is the platform's share of an :class:`AttemptEvidence` (exit code, signal, an
    OOM kill, a lost node, the launcher's termination message as last words); ``termination`` is
    the platform's own verdict on it. ``decisive`` says that verdict stands whatever else is
    known, because no exit code or last words carry those facts: an ``OOMKilled`` container
    (torchrun's agent then exits 1), an evicted or preempted pod, a pod that never ran or
    vanished. Otherwise the evidence is classified again with what the orchestrator knows.
    """

    evidence: AttemptEvidence
    termination: Termination
    decisive: bool = False
    # How long the platform held the attempt's accelerators: from the pod's scheduling (when
    # its GPUs were allocated) to the container's end; 0.0 when no pod was ever scheduled.
    # None: not known, and the attempt's wall time is charged.
    accelerator_wall_seconds: float | None = None


def launcher_failed(error: BaseException) -> ObservedEnding:
    """The ending to record when the launcher itself raised: no exit code or signal was seen.

    Without this the receipt would read a missing exit code as a signal and tell a story the
    evidence does not hold. Stopping (``user_code_error``) is the safe verdict: a person reads
    the error before a retry repeats it.
    """
    said = redact.text(f"{type(error).__name__}: {error}").rstrip(".")
    return ObservedEnding(
        AttemptEvidence(),
        Termination(
            TerminationReason.USER_CODE_ERROR,
            f"The launcher raised {said}, so no exit code or signal of the trainer was seen.",
        ),
        decisive=True,
    )


def classify_observed(observed: ObservedEnding, known: AttemptEvidence) -> Termination:
    """One reason from what the platform observed and what the orchestrator read itself.

    ``known`` holds the orchestrator's facts: the trainer's last words (from the shared store),
    the ledger's last committed step, wall time and its limit, whether a person cancelled.
    """
    platform = observed.evidence
    if observed.decisive and not known.cancelled:
        where = _where(known)
        said = redact.text(observed.termination.detail)  # the platform's words may quote a URL
        return Termination(
            observed.termination.reason,
            f"{_sentence(said)} {_sentence(where[0].upper() + where[1:])}",
        )
    merged = replace(
        platform,
        # The trainer's own words beat the launcher's summary of them in the termination message.
        last_words=known.last_words or platform.last_words,
        signal=platform.signal or known.signal,
        cancelled=known.cancelled,
        last_committed_step=known.last_committed_step,
        wall_seconds=known.wall_seconds,
        max_wall_seconds=known.max_wall_seconds,
        step_reached=known.step_reached,
        newer_attempt=known.newer_attempt,
    )
    try:
        return classify(merged)
    except InsufficientEvidenceError:
        # The platform's verdict is all there is; its words may quote a URL.
        return replace(observed.termination, detail=redact.text(observed.termination.detail))


def classify_exit(
    *,
    returncode: int,
    signal_name: str | None,
    last_words: Mapping[str, Any] | None,
    cancelled: bool = False,
    last_committed_step: int | None = None,
    **evidence: Any,
) -> Termination:
    """The first classifier's call, kept for ``assets/training.py``: wraps :func:`classify`.

    Extra keyword arguments are :class:`AttemptEvidence` fields (``cgroup_oom_kills``,
    ``exception_type``, ``wall_seconds``, ``max_wall_seconds`` …).
    """
    return classify(
        AttemptEvidence(
            exit_code=None if cancelled and returncode == -1 and not signal_name else returncode,
            signal=signal_name,
            last_words=last_words,
            cancelled=cancelled,
            last_committed_step=last_committed_step,
            **evidence,
        )
    )


def evidence_for_attempt(
    attempt: AttemptRecord,
    *,
    exit_code: int | None = None,
    signal_name: str | None = None,
    last_words: Mapping[str, Any] | None = None,
    cancelled: bool = False,
    node_lost: bool = False,
    last_committed_step: int | None = None,
    cgroup_oom_kills: int | None = None,
    exception_type: str | None = None,
    exception_message: str | None = None,
    heartbeat_timeout_seconds: float | None = None,
    now: datetime | None = None,
    step_reached: int | None = None,
    newer_attempt: Mapping[str, Any] | None = None,
    terminated_dagster_run: str | None = None,
) -> AttemptEvidence:
    """Evidence for a ledger attempt: heartbeat age, wall time and max wall from its receipt.

    ``last_committed_step`` comes from the ledger's checkpoints only; the receipt's step
    reached (its heartbeats) is ``step_reached`` unless a later one is given.
    """
    now = now or datetime.now(UTC)
    age = (now - attempt.heartbeat_at).total_seconds() if attempt.heartbeat_at else None
    end = attempt.ended_at or now
    max_wall = (attempt.config_snapshot or {}).get("max_wall_seconds")
    return AttemptEvidence(
        exit_code=exit_code,
        signal=signal_name,
        exception_type=exception_type,
        exception_message=exception_message,
        last_words=last_words,
        cgroup_oom_kills=cgroup_oom_kills,
        cancelled=cancelled,
        node_lost=node_lost,
        heartbeat_age_seconds=age,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        last_committed_step=last_committed_step,
        wall_seconds=(end - attempt.started_at).total_seconds(),
        max_wall_seconds=float(max_wall) if isinstance(max_wall, int | float) else None,
        step_reached=max(
            (s for s in (step_reached, attempt.last_step) if s is not None), default=None
        ),
        newer_attempt=newer_attempt,
        terminated_dagster_run=terminated_dagster_run,
    )


def read_last_words(path: Path) -> dict[str, Any] | None:
    """The trainer's last written words, or None if it died before it could write them."""
    try:
        words = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return words if isinstance(words, dict) else None


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_oom_file(pid: int | str = "self", root: Path = CGROUP_ROOT) -> Path | None:
    """The file holding a process's cgroup ``oom_kill`` counter, or None where there is none.

    cgroup v2: ``<root>/<path>/memory.events``. cgroup v1 (kernels since 4.13):
    ``<root>/memory/<path>/memory.oom_control``. Inside a container the cgroup namespace makes
    the path ``/``, so the file sits at the root.
    """
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        relative = relative.lstrip("/")
        if hierarchy == "0" and controllers == "":
            candidates += [root / relative / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates += [
                root / "memory" / relative / "memory.oom_control",
                root / "memory" / "memory.oom_control",
            ]
    return next((c for c in candidates if c.is_file()), None)


def read_cgroup_oom_kills(path: Path | None = None) -> int | None:
    """The cgroup's ``oom_kill`` counter (``memory.events`` or ``memory.oom_control``).

    None when unavailable. Read it before launching the trainer and again after it exits
    (:func:`oom_kills_since`): the difference is the attempt's ``cgroup_oom_kills``.
    """
    path = path or cgroup_oom_file()
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def oom_kills_since(before: int | None, path: Path | None = None) -> int | None:
    """How many OOM kills the cgroup saw since ``before`` was read; None when unknowable."""
    after = read_cgroup_oom_kills(path)
    if before is None or after is None:
        return None
    return max(after - before, 0)
