"""Who this trainer process is in the ledger, and the receipt it leaves when it stops.

Three modes: standalone (no ledger: the run directory is the only record), orchestrated
(``--attempt-no/--fencing-token``: Dagster began the attempt and will end it; the trainer
heartbeats and commits checkpoints), and self-owned (``--ledger-url`` alone: the trainer
creates the run if missing, begins the attempt and ends it).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import envvars, ids, redact
from pipeline.checkpoint import layout
from pipeline.checkpoint.layout import parse_checkpoint_dir_name, replace_atomically
from pipeline.fencing import fenced_detail
from pipeline.states import Purpose, TerminationReason

if TYPE_CHECKING:
    from pipeline.ledger import Ledger
    from pipeline.trainer.config import TrainConfig
    from pipeline.trainer.reporting import Reporter

# How often a running trainer tells the ledger it is alive (and the step it reached); drills
# shorten it with TRACKS_HEARTBEAT_SECONDS so the receipt follows the steps closely (read when
# the handle is made, never at import).
_LAST_WORDS_RE = re.compile(r"^attempt-(\d+)(?:\.rank-\d+)?\.last_words\.json\Z")


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: one reason, its exit code and one honest sentence."""

    reason: TerminationReason
    exit_code: int
    detail: str
    step: int | None = None
    exception: BaseException | None = None
    signal: str | None = None
    # A success that trained no step (the final checkpoint was already committed): its
    # sentence is left as last words too, so a receipt closed from them says the same.
    nothing_trained: bool = False


def last_words_path(store: str | Path, run_id: str, attempt_no: int, *, rank: int = 0) -> Path:
    """``<store>/<run_id>/attempt-<n>.last_words.json``: what the classifier reads.

    Ranks other than 0 keep theirs beside it (``attempt-<n>.rank-<r>.last_words.json``).
    """
    number = ids.attempt_no(attempt_no)
    suffix = f".rank-{int(rank):05d}" if rank else ""
    return layout.run_dir(store, run_id) / f"attempt-{number}{suffix}.last_words.json"


def stacks_path(store: str | Path, run_id: str, attempt_no: int, *, rank: int = 0) -> Path:
    """``attempt-<n>[.rank-<r>].stacks.txt`` beside the last words: every thread's stack, dumped
    by the hang watchdog of that rank when it fired (``faulthandler``)."""
    words = last_words_path(store, run_id, attempt_no, rank=rank)
    return words.with_name(words.name.replace(".last_words.json", ".stacks.txt"))


def next_standalone_attempt_no(run_dir: Path) -> int:
    """Without a ledger, the next attempt number is one past any the run directory shows."""
    seen = [0]
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            if parsed := parse_checkpoint_dir_name(child.name):
                seen.append(parsed[1])
            elif match := _LAST_WORDS_RE.match(child.name):
                seen.append(int(match[1]))
    return max(seen) + 1


class AttemptHandle:
    """The attempt's number, fencing token and ledger duties, whichever mode it runs in."""

    def __init__(
        self,
        *,
        run_id: str,
        run_dir: Path,
        ledger: Ledger | None,
        attempt_no: int | None,
        fencing_token: int | None,
        reporter: Reporter,
    ) -> None:
        self.run_id = run_id
        self.run_dir = run_dir
        self.ledger = ledger
        self.owns_attempt = ledger is not None and attempt_no is None
        if ledger is None and attempt_no is None:
            attempt_no = next_standalone_attempt_no(run_dir)
        self.attempt_no = attempt_no
        self.fencing_token = fencing_token
        self.begun = not self.owns_attempt
        self._reporter = reporter
        self._last_heartbeat = 0.0
        self._heartbeat_seconds = envvars.TRACKS_HEARTBEAT_SECONDS.get()

    def begin(
        self,
        config: TrainConfig,
        *,
        snapshot_id: str | None,
        data_manifest_sha256: str | None,
        resumed_from: str | None,
    ) -> None:
        """Self-owned mode: create the run if missing and begin the attempt (fresh token).

        Orchestrated mode: the attempt is open already; record where it really resumed from
        (the orchestrator's guess skips nothing; the trainer skips corrupt checkpoints and those
        of another config).
        """
        if self.ledger is None:
            return
        if self.begun:
            assert self.attempt_no is not None
            self.ledger.set_resumed_from(self.run_id, self.attempt_no, resumed_from)
            return
        from sqlalchemy.exc import IntegrityError

        from pipeline.environment import code_commit, container_digest, placement
        from pipeline.ledger import AttemptStart, UnknownRunError

        commit = code_commit()
        try:
            run = self.ledger.get_run(self.run_id)
        except UnknownRunError:
            # Another process may create it between our read and insert: its row is as good.
            with contextlib.suppress(IntegrityError):
                self.ledger.create_run(
                    run_id=self.run_id,
                    model_family=config.model_family,
                    owner=_owner(),
                    purpose=Purpose.BASELINE,
                    config_sha256=config.sha256(),
                    snapshot_id=snapshot_id or Path(config.snapshot_dir).name,
                    code_commit=commit,
                )
            run = self.ledger.get_run(self.run_id)
        if run.config_sha256 != config.sha256():
            self._reporter.event(
                "run_config_differs",
                {"run_id": self.run_id, "run": run.config_sha256, "attempt": config.sha256()},
                level="warning",
            )
        record = self.ledger.begin_attempt(
            self.run_id,
            AttemptStart(
                config_snapshot=config.to_dict(),
                config_sha256=config.sha256(),
                data_manifest_sha256=data_manifest_sha256 or "unknown",
                container_digest=container_digest(),
                placement=placement(),
                dagster_run_id=os.environ.get("DAGSTER_RUN_ID"),
                code_commit=commit,
                resumed_from_checkpoint=resumed_from,
                # Self-owned: the trainer CLI was started by a person or a script, not by an
                # orchestrator that opened the attempt for it.
                launched_by={"via": "cli", "user": _owner(), "pid": os.getpid()},
                admission={"rule": "trainer cli", "reason": "a standalone trainer owns its run"},
            ),
        )
        self.attempt_no, self.fencing_token, self.begun = (
            record.attempt_no,
            record.fencing_token,
            True,
        )

    def begin_unloadable(self, source: str, problem: str) -> None:
        """Self-owned mode, config that did not load: still a first-class attempt row.

        The run is created if missing (family ``unknown`` when the config never said), and the
        attempt's config snapshot names the file and what was wrong with it.
        """
        if self.ledger is None or self.begun:
            return
        import hashlib

        from sqlalchemy.exc import IntegrityError

        from pipeline.environment import container_digest, placement
        from pipeline.ledger import AttemptStart, UnknownRunError

        try:
            digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()
        except OSError:
            digest = "0" * 64  # the file itself could not be read
        try:
            self.ledger.get_run(self.run_id)
        except UnknownRunError:
            with contextlib.suppress(IntegrityError):
                self.ledger.create_run(
                    run_id=self.run_id, model_family="unknown", owner=_owner(),
                    purpose=Purpose.BASELINE, config_sha256=digest, snapshot_id="unknown",
                )  # fmt: skip
        record = self.ledger.begin_attempt(
            self.run_id,
            AttemptStart(
                config_snapshot={"unloadable_config": source, "problem": problem},
                config_sha256=digest,
                data_manifest_sha256="unknown",
                container_digest=container_digest(),
                placement=placement(),
                dagster_run_id=os.environ.get("DAGSTER_RUN_ID"),
                launched_by={"via": "cli", "user": _owner(), "pid": os.getpid()},
                admission={"rule": "trainer cli", "reason": "a standalone trainer owns its run"},
            ),
        )
        self.attempt_no, self.fencing_token, self.begun = (
            record.attempt_no,
            record.fencing_token,
            True,
        )

    def heartbeat(self, step: int, *, force: bool = False) -> None:
        """Every few seconds (and on each checkpoint); a missed heartbeat never stops training."""
        if self.ledger is None or self.attempt_no is None:
            return
        now = time.monotonic()
        if not force and now - self._last_heartbeat < self._heartbeat_seconds:
            return
        self._last_heartbeat = now
        try:
            self.ledger.heartbeat(self.run_id, self.attempt_no, step=step)
        except Exception as exc:
            self._reporter.event(
                "heartbeat_failed", {"step": step, "error": str(exc)[:300]}, level="warning"
            )

    def end(self, outcome: Outcome, *, cpu_seconds: float, gpu_seconds: float) -> None:
        """Self-owned mode only: the orchestrator ends attempts it began."""
        if not self.owns_attempt or not self.begun or self.ledger is None:
            return
        assert self.attempt_no is not None
        from pipeline.ledger.errors import AttemptAlreadyEndedError

        detail = outcome.detail
        if outcome.reason == TerminationReason.FENCED:
            detail = fenced_detail(self.ledger, self.run_id, self.attempt_no, outcome.step)
        try:
            self.ledger.end_attempt(
                self.run_id,
                self.attempt_no,
                termination_reason=outcome.reason,
                termination_detail=detail,
                exit_code=outcome.exit_code,
                signal=outcome.signal,
                cpu_seconds=cpu_seconds,
                gpu_seconds=gpu_seconds,
                last_step=outcome.step,
            )
        except AttemptAlreadyEndedError as exc:
            # The resume sensor found it silent and closed it first: that ending stands, and
            # what this trainer knew is in its last words and its events.
            self._reporter.event(
                "attempt_already_ended",
                {
                    "attempt": f"{self.run_id}#{self.attempt_no}",
                    "reason": exc.reason,
                    "outcome": str(outcome.reason),
                },
                level="warning",
            )


def _owner() -> str:
    try:
        return os.environ.get("USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (common in containers)
        return f"uid-{os.getuid()}"


def write_last_words(
    path: Path,
    *,
    run_id: str,
    attempt_no: int,
    outcome: Outcome,
    last_checkpoint: str | None,
    extra: dict[str, Any] | None = None,
) -> None:
    """The trainer's last words, written atomically before it exits on a classified stop (or a
    success that trained nothing).

    ``extra`` adds evidence of the ending's own (a hung rank's ``hang`` record, the story of
    every rank's hang, its step timing ``steps``) beside the fields every ending has, which it
    never replaces.
    """
    exc = outcome.exception
    payload: dict[str, Any] = {
        "run_id": run_id,
        "attempt_no": attempt_no,
        "reason": str(outcome.reason),
        "exit_code": outcome.exit_code,
        "detail": redact.text(outcome.detail),
        "step": outcome.step,
        "signal": outcome.signal,
        "exception_type": type(exc).__qualname__ if exc else None,
        "exception_module": type(exc).__module__ if exc else None,
        # Redacted before the cut (a URL cut short of its '@' no longer looks like one): the
        # words are read back into receipts and termination sentences.
        "exception_message": redact.text(str(exc))[:2000] if exc else None,
        "errno": exc.errno if isinstance(exc, OSError) and isinstance(exc.errno, int) else None,
        "last_checkpoint": last_checkpoint,
        "pid": os.getpid(),
        "written_at": datetime.now(UTC).isoformat(),
    }
    payload = {**(extra or {}), **payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, json.dumps(payload, indent=1, sort_keys=True).encode())
