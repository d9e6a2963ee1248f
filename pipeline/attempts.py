"""One attempt from the orchestrator's side: open the receipt, launch, classify, decide.

Framework-free so the Dagster asset, the CLI and the drills share it: the caller only supplies
how the trainer process is launched and how it ended.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from pipeline import envvars, ids, redact
from pipeline.checkpoint import layout
from pipeline.data.snapshot import Snapshot
from pipeline.distributed.ranks import ranks_summary_path
from pipeline.environment import code_commit, container_digest, placement
from pipeline.fencing import newer_attempt
from pipeline.ledger import (
    AttemptAlreadyEndedError,
    AttemptRecord,
    AttemptStart,
    CheckpointRecord,
    Ledger,
    RunRecord,
)
from pipeline.ledger.notes import NOTE_SOURCE_OF_TRACKS, note_text
from pipeline.reasons import (
    AttemptEvidence,
    ObservedEnding,
    Termination,
    classify,
    classify_exit,
    classify_observed,
    evidence_for_attempt,
    oom_kills_since,
    read_cgroup_oom_kills,
    read_last_words,
)
from pipeline.retry import (
    TERMINATED_BEFORE_CONTINUING,
    RetryAction,
    RetryDecision,
    RetryPolicy,
    config_changes,
    decide,
    decide_from_ledger,
    end_with_decision,
    policy_for_run,
    record_decision,
)
from pipeline.states import Purpose, RunStatus, TerminationReason
from pipeline.trainer.attempt import last_words_path
from pipeline.trainer.config import TrainConfig


class AttemptRefusedError(Exception):
    """The retry policy says this run gets no further attempt."""

    def __init__(self, run_id: str, decision: RetryDecision) -> None:
        super().__init__(
            f"run {run_id} gets no attempt {decision.attempt_no + 1}: {decision.reason} "
            f"(rule {decision.rule})"
        )
        self.run_id = run_id
        self.decision = decision


@dataclass(frozen=True)
class PreparedAttempt:
    """An attempt whose receipt is open in the ledger and whose trainer is about to start."""

    run: RunRecord
    attempt: AttemptRecord
    train_config: TrainConfig
    config_path: Path
    # The plan only: the checkpoint the trainer is expected to resume from. It may skip it (a
    # corrupt one, another config's), so the receipt records what the trainer reports instead.
    planned_resume_from: CheckpointRecord | None
    oom_kills_before: int | None

    def trainer_args(self, store: Path) -> list[str]:
        """The trainer's command-line contract for this attempt (no secrets: argv is public)."""
        return [
            "--config", str(self.config_path),
            "--run-id", self.run.run_id,
            "--store", str(store),
            "--attempt-no", str(self.attempt.attempt_no),
            "--fencing-token", str(self.attempt.fencing_token),
        ]  # fmt: skip

    @staticmethod
    def trainer_env(
        ledger_url: str, mlflow_uri: str | None = None, mlflow_artifacts: str | None = None
    ) -> dict[str, str]:
        """What the trainer reads from its environment: URLs, which may hold a password,
        travel here and never on the command line (`ps` shows argv to every user)."""
        env = {envvars.TRACKS_LEDGER_URL.name: ledger_url}
        if mlflow_uri:
            env[envvars.TRACKS_MLFLOW_URI.name] = mlflow_uri
        if mlflow_artifacts:
            env[envvars.TRACKS_MLFLOW_ARTIFACTS.name] = mlflow_artifacts
        return env


@dataclass(frozen=True)
class FinishedAttempt:
    """The closed receipt, its one termination reason and what the retry policy decided."""

    attempt: AttemptRecord
    termination: Termination
    decision: RetryDecision
    # False where another process ended the attempt first (its ending and decision are the
    # ones above): that process carries the run on, never this one.
    ended_here: bool = True

    @property
    def succeeded(self) -> bool:
        return self.termination.reason == TerminationReason.SUCCEEDED


def new_run_id(model_family: str, snapshot_id: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    ids.model_family(model_family)
    return f"{model_family}-{snapshot_id.split('-')[-1][:8]}-{stamp}-{secrets.token_hex(2)}"


def prepare_attempt(
    ledger: Ledger,
    *,
    snapshot: Snapshot,
    train_config: TrainConfig,
    work_root: Path,
    run_id: str | None = None,
    owner: str = "tracks",
    purpose: Purpose | str = Purpose.BASELINE,
    retry_policy: RetryPolicy | None = None,
    dagster_run_id: str | None = None,
    launched_by: dict[str, Any] | None = None,
    note: str | None = None,
) -> PreparedAttempt:
    """Create the run (or continue ``run_id``) and open the next attempt's receipt.

    ``launched_by`` is the evidence of who or what launched it (``{"via": "sensor:…" |
    "schedule:…" | "ui" | "cli" | …, "dagster_run_id": …}``); the receipt also keeps which rule
    admitted it (``admission``): a new run, or the retry decision that allows this continuation,
    a person's relaunch after a ``stop`` included.

    Continuing a run first asks the retry policy about its last ended attempt with the config
    the new attempt would use, so an OOM retried with an unchanged batch is refused here,
    before any accelerator time is spent.

    ``note`` (a launch-time description) becomes a note on the new attempt, by whoever
    ``launched_by`` names (its user, else how it was launched), from source ``dagster launch
    <dagster_run_id>``; a note the logbook refuses is refused before a run or attempt opens.
    """
    if note is not None:
        note = note_text(note)
    resolved = train_config.to_dict()
    if run_id is None:
        run = ledger.create_run(
            run_id=new_run_id(train_config.model_family, snapshot.snapshot_id),
            model_family=train_config.model_family,
            owner=owner,
            purpose=purpose,
            config_sha256=train_config.sha256(),
            snapshot_id=snapshot.snapshot_id,
            code_commit=code_commit(),
            retry_policy=(retry_policy or RetryPolicy()).to_json(),
        )
        admission: dict[str, Any] = {"rule": "new run", "reason": "a new run starts fresh"}
    else:
        run = ledger.get_run(ids.run_id(run_id))
        admission = _refuse_unless_policy_allows(ledger, run, resolved)

    run_dir = layout.run_dir(work_root, run.run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / f"config-{train_config.sha256()[:12]}.yaml"
    config_path.write_text(yaml.safe_dump(resolved, sort_keys=True))

    planned = ledger.latest_committed_checkpoint(run.run_id)
    attempt = ledger.begin_attempt(
        run.run_id,
        AttemptStart(
            config_snapshot=resolved,
            config_sha256=train_config.sha256(),
            data_manifest_sha256=snapshot.manifest_sha256,
            container_digest=container_digest(),
            placement=placement(),
            dagster_run_id=dagster_run_id,
            code_commit=run.code_commit,
            # Nothing is restored yet: resumed_from/restored_step stay empty until the trainer
            # reports its restore, so an attempt that dies loading data claims no restore.
            resumed_from_checkpoint=None,
            launched_by={**(launched_by or {"via": "api"}), "dagster_run_id": dagster_run_id},
            admission=admission,
        ),
    )
    if note is not None:
        launched = attempt.launched_by or {}
        ledger.add_note(
            run.run_id,
            note,
            attempt_no=attempt.attempt_no,
            author=str(launched.get("user") or launched.get("via")),
            source=f"dagster launch {dagster_run_id}" if dagster_run_id else "launch",
        )
    return PreparedAttempt(
        run=run,
        attempt=attempt,
        train_config=train_config,
        config_path=config_path,
        planned_resume_from=planned,
        oom_kills_before=read_cgroup_oom_kills(),
    )


def _refuse_unless_policy_allows(
    ledger: Ledger, run: RunRecord, next_config: dict[str, Any]
) -> dict[str, Any]:
    """Raise unless the retry policy admits another attempt; else say which rule admitted it."""
    attempts = ledger.attempts(run.run_id)
    last = attempts[-1] if attempts else None
    if last is None:
        return {"rule": "first attempt", "reason": "the run had no attempt yet"}
    if last.termination_reason is None:
        # Still running: the fencing token settles who wins.
        return {
            "rule": "fencing",
            "reason": f"attempt {last.attempt_no} is still open; the new token fences it",
        }
    decision = decide(
        policy_for_run(run), attempts, last, next_config, checkpoints=ledger.checkpoints(run.run_id)
    )
    admitted = {
        "after_attempt": last.attempt_no,
        "after_decision": (last.retry_decision or {}).get("action"),
        "decision": str(decision.action),
        "rule": decision.rule,
        "reason": decision.reason,
        "config_changes": config_changes(last.config_snapshot, next_config),
    }
    if decision.action == RetryAction.NONE:
        # The run already succeeded; a new attempt resumes at max_steps and ends at once.
        return admitted
    if not decision.continues:
        raise AttemptRefusedError(run.run_id, decision)
    return admitted


def _words_field(words: dict[str, Any] | None, key: str, kind: type) -> Any:
    value = (words or {}).get(key)
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def accelerators_held(placement: dict[str, Any]) -> int:
    """Accelerators the attempt held: one per rank when distributed, else every visible one."""
    visible = int(placement.get("accelerator_count") or 0)
    world = int(placement.get("world_size") or 1)
    return world if visible and world > 1 else visible


def step_reached(ledger: Ledger, attempt: AttemptRecord, said: int | None = None) -> int | None:
    """The furthest step this attempt itself is known to have reached.

    Evidence of this attempt only: the checkpoints it committed, the step it restored, the
    step its own heartbeats carried, and ``said`` (its own last words). Another attempt's
    checkpoint proves nothing about this one: a retry that started fresh after an OOM never
    reached the step its predecessor committed.
    """
    fresh = ledger.get_attempt(attempt.run_id, attempt.attempt_no)
    own = [
        c.step
        for c in ledger.checkpoints(attempt.run_id)
        if c.attempt_no == attempt.attempt_no and c.committed_at is not None
    ]
    steps = [*own, fresh.restored_step, fresh.last_step, said]
    return max((s for s in steps if s is not None), default=None)


def _rank_phrase(count: int, world_size: Any) -> str:
    if count != world_size:
        return f"all {count} ranks on this node"
    return "both ranks" if count == 2 else f"all {count} ranks"


@dataclass(frozen=True)
class StoredEvidence:
    """What the attempt's processes left in the store: last words and the ranks' endings.

    The ranks' part comes from the launcher's summary (``attempt-N.ranks.json``): every rank's
    ending with its signal, the rank that failed first when the evidence orders them, the
    ranks a peer's failure ended (collateral), or how they all stopped together.
    """

    words: dict[str, Any] | None  # the story's words: the first failed rank's, else rank 0's
    signal: str | None  # the signal the story's rank received (its words, else the launcher's)
    reached: int | None  # the furthest step any rank said it reached
    first_failure: dict[str, Any] | None  # the launcher's first failed rank (distributed)
    ranks: tuple[dict[str, Any], ...] = ()  # every rank's ending, as the summary holds it
    together: dict[str, Any] | None = None  # every rank ended alike: no rank failed first
    unordered: tuple[int, ...] = ()  # ranks that failed on their own, too close to order

    def told(self, termination: Termination) -> Termination:
        """``termination`` with what the ranks did: who failed first, or that none did."""
        said = [termination.detail]
        first, together = self.first_failure, self.together
        if first is not None:
            said.append(f"Rank {first.get('rank')} failed first: {_clause(first.get('detail'))}.")
        elif together is not None:
            said.append(_together_sentence(together))
        elif self.unordered:
            listed = ", ".join(str(r) for r in self.unordered[:-1])
            said.append(
                f"Ranks {listed} and {self.unordered[-1]} failed on their own too close together "
                "for their exit times to say which came first."
            )
        for rank in self.ranks:
            if rank.get("collateral"):
                said.append(
                    f"Rank {rank.get('rank')} was collateral, ended by a peer's failure "
                    f"(exit {rank.get('exit_code')}): {_clause(rank.get('detail'))}."
                )
        if len(said) == 1:
            return termination
        return replace(termination, detail=" ".join(said))


def _clause(text: Any) -> str:
    # A rank's words inside the attempt's sentence: one line, no password, a bounded length.
    return redact.one_line(str(text or "no words"))[:300].rstrip(".")


def _together_sentence(together: dict[str, Any]) -> str:
    ranks = _rank_phrase(int(together.get("ranks") or 0), together.get("world_size"))
    step = together.get("step")
    at = f" at step {step}" if isinstance(step, int) else ""
    signal = together.get("signal")
    if signal and together.get("killed"):
        return f"The signal reached every rank: {ranks} were killed by {signal}{at}."
    if signal:
        return f"The signal reached every rank: {ranks} stopped on {signal}{at}."
    return f"Every rank ended alike: {ranks} exited {together.get('exit_code')}{at}."


def stored_evidence(
    store: Path, run_id: str, attempt_no: int, first_failure: dict[str, Any] | None = None
) -> StoredEvidence:
    """Read the attempt's last words and the launcher's ranks summary from the store.

    ``first_failure`` may be given by a launcher that decided it itself (the summary on disk,
    when there is one, holds the same rank with its signal).
    """
    words = rank0_words = read_last_words(last_words_path(store, run_id, attempt_no))
    summary = read_last_words(ranks_summary_path(store, run_id, attempt_no)) or {}
    first = summary.get("first_failure")
    first = first if isinstance(first, dict) else first_failure
    ranks = tuple(r for r in summary.get("ranks") or () if isinstance(r, dict))
    together = summary.get("together") if isinstance(summary.get("together"), dict) else None
    unordered = tuple(r for r in summary.get("unordered") or () if isinstance(r, int))
    if first is not None and first.get("rank"):
        # Rank 0's last words describe what it saw (a peer gone); the rank that failed first
        # is the story, with its own last words when it left any (a SIGKILL leaves none).
        words = read_last_words(last_words_path(store, run_id, attempt_no, rank=int(first["rank"])))
    # A trainer that caught SIGTERM exits 75 on its own, so the process shows no signal, but its
    # last words name the one it received (the story's words only: rank 0's SIGTERM from the
    # agent is not why a SIGKILLed peer's attempt ended). Else the launcher's record of the
    # story's rank says it (a rank killed outright leaves no words), or of every rank at once.
    signal_name = (
        _words_field(words, "signal", str)
        or _words_field(first, "signal", str)
        or _words_field(together, "signal", str)
    )
    # The ranks step together: the furthest any of them says it got is the attempt's.
    steps = [_words_field(w, "step", int) for w in (words, rank0_words, *ranks)]
    reached = max((s for s in steps if s is not None), default=None)
    return StoredEvidence(
        words=words,
        signal=signal_name,
        reached=reached,
        first_failure=first,
        ranks=ranks,
        together=together,
        unordered=unordered,
    )


def end_self_owned_attempt(
    ledger: Ledger,
    *,
    store: Path,
    run_id: str,
    attempt_no: int,
    exit_code: int,
    first_failure: dict[str, Any] | None,
    reached: int | None,
    cpu_seconds: float,
    gpu_seconds: float,
) -> AttemptRecord | None:
    """Close a self-owned distributed attempt from the launcher, which saw every rank end.

    Rank 0 began the attempt and left its end to the launcher: rank 0 alone would say what it
    saw (a collective that broke), not which rank failed first and why. Classified from the
    same evidence as :func:`finish_attempt`. None if the attempt was already closed.
    """
    attempt = ledger.get_attempt(run_id, attempt_no)
    if attempt.ended_at is not None:
        return None
    found = stored_evidence(store, run_id, attempt_no, first_failure)
    latest = ledger.latest_committed_checkpoint(run_id)
    # The classifier is told the run's newest commit (what a next attempt resumes from) and,
    # apart, the step reached, which counts this attempt's own evidence only.
    said = max((s for s in (found.reached, reached) if s is not None), default=None)
    last_step = step_reached(ledger, attempt, said)
    termination = found.told(
        classify(
            evidence_for_attempt(
                attempt,
                exit_code=exit_code,
                signal_name=found.signal,
                last_words=found.words,
                last_committed_step=latest.step if latest else None,
                step_reached=last_step,
                newer_attempt=newer_attempt(ledger, attempt),
            )
        )
    )
    try:
        ended = ledger.end_attempt(
            run_id,
            attempt_no,
            termination_reason=termination.reason,
            termination_detail=termination.detail,
            exit_code=exit_code,
            signal=found.signal,
            gpu_seconds=gpu_seconds,
            cpu_seconds=cpu_seconds,
            last_step=last_step,
        )
    except AttemptAlreadyEndedError:
        return None  # closed meanwhile (the resume sensor): that ending stands
    from pipeline.tracking import mirror_in_trainer_env

    mirror_in_trainer_env(ledger, run_id, attempt_no)  # MLflow's run follows the ledger
    return ended


def finish_attempt(
    ledger: Ledger,
    prepared: PreparedAttempt,
    *,
    store: Path,
    returncode: int | None,
    signal_name: str | None,
    cancelled: bool = False,
    cpu_seconds: float = 0.0,
    observed: ObservedEnding | None = None,
    placement: Mapping[str, Any] | None = None,
) -> FinishedAttempt:
    """Classify how the trainer ended, close the receipt, and record the retry decision.

    ``observed`` is what the platform running the trainer saw (a Kubernetes pod's status: an
    eviction, an ``OOMKilled`` container, a pod that never ran); it is merged with what is read
    here (last words, the last committed step) by :func:`~pipeline.reasons.classify_observed`.
    ``placement`` adds where the trainer ran (pod, node, workload, image) to the receipt.
    """
    run_id, attempt_no = prepared.run.run_id, prepared.attempt.attempt_no
    latest = ledger.latest_committed_checkpoint(run_id)
    last_step = latest.step if latest else None  # committed, never merely reached
    # Evidence first: the process's own signal, else the one its ranks' records name.
    found = stored_evidence(store, run_id, attempt_no)
    words = found.words
    signal_name = signal_name or found.signal
    # The classifier hears about the run's newest commit and, apart, the step this attempt
    # reached: what it wrote, restored or said.
    reached = step_reached(ledger, prepared.attempt, found.reached)
    newer = newer_attempt(ledger, prepared.attempt)
    wall = (datetime.now(UTC) - prepared.attempt.started_at).total_seconds()
    if observed is None:
        termination = classify_exit(
            returncode=-1 if returncode is None else returncode,
            signal_name=signal_name,
            last_words=words,
            cancelled=cancelled,
            last_committed_step=last_step,
            cgroup_oom_kills=oom_kills_since(prepared.oom_kills_before),
            wall_seconds=wall,
            max_wall_seconds=prepared.train_config.max_wall_seconds,
            step_reached=reached,
            newer_attempt=newer,
        )
    else:
        # The trainer ran elsewhere: this process's cgroup says nothing about its memory.
        termination = classify_observed(
            observed,
            AttemptEvidence(
                signal=signal_name,
                last_words=words,
                cancelled=cancelled,
                last_committed_step=last_step,
                wall_seconds=wall,
                max_wall_seconds=prepared.train_config.max_wall_seconds,
                step_reached=reached,
                newer_attempt=newer,
            ),
        )
    termination = found.told(termination)
    if placement:
        ledger.merge_placement(run_id, attempt_no, dict(placement))
    current = ledger.get_attempt(run_id, attempt_no)
    accelerators = accelerators_held(current.placement or {})

    policy = policy_for_run(prepared.run)
    try:
        _, decision = end_with_decision(
            ledger,
            current,
            functools.partial(decide_from_ledger, ledger, policy),
            termination_reason=termination.reason,
            termination_detail=termination.detail,
            exit_code=returncode,
            signal=signal_name,
            # Kubernetes: time queued for a node is not GPU time; the cluster says when it was.
            gpu_seconds=accelerators
            * (
                observed.accelerator_wall_seconds
                if observed is not None and observed.accelerator_wall_seconds is not None
                else wall
            ),
            cpu_seconds=cpu_seconds,
            last_step=reached,
        )
    except AttemptAlreadyEndedError:
        return _ended_elsewhere(ledger, prepared, termination, returncode, signal_name)
    if termination.reason == TerminationReason.SUCCEEDED:
        ledger.set_run_status(run_id, RunStatus.TRAINED)
    elif not decision.continues:
        ledger.set_run_status(run_id, RunStatus.FAILED)
    return FinishedAttempt(
        attempt=ledger.get_attempt(run_id, attempt_no), termination=termination, decision=decision
    )


def _ended_elsewhere(
    ledger: Ledger,
    prepared: PreparedAttempt,
    seen: Termination,
    returncode: int | None,
    signal_name: str | None,
) -> FinishedAttempt:
    """The attempt was closed by another process first (the resume sensor, finding it silent
    past the heartbeat timeout, before its trainer's exit reached this one). That ending and
    its decision stand, and the process that made them carries the run on; what this one saw
    is added to the attempt as a note, so the receipt holds both."""
    run_id, attempt_no = prepared.run.run_id, prepared.attempt.attempt_no
    stored = ledger.get_attempt(run_id, attempt_no)
    ending = signal_name or f"exit code {returncode}"
    ledger.add_note(
        run_id,
        f"The Dagster run {prepared.attempt.dagster_run_id or '(none)'} saw this attempt's "
        f"trainer end ({ending}; read as {seen.reason}: {seen.detail}) after another process "
        f"had ended the attempt {stored.termination_reason}; that ending and its retry "
        "decision stand.",
        author="tracks",
        source=NOTE_SOURCE_OF_TRACKS,
        attempt_no=attempt_no,
    )
    decided = stored.retry_decision
    return FinishedAttempt(
        attempt=stored,
        termination=Termination(
            TerminationReason(stored.termination_reason or seen.reason),
            stored.termination_detail or seen.detail,
        ),
        decision=RetryDecision.from_json(decided) if decided else _no_decision(stored),
        ended_here=False,
    )


def cancel_unlaunched(ledger: Ledger, dagster_run_id: str) -> list[AttemptRecord]:
    """End ``cancelled`` every attempt Dagster run ``dagster_run_id`` opened and has not closed:
    a person terminated it between opening an attempt and launching its trainer (the receipt
    of a launched trainer is closed where it is launched, termination or not). Their runs are
    failed, as after any cancellation. Returns the attempts closed here."""
    closed = []
    for attempt in ledger.attempts_for_dagster_run(dagster_run_id):
        if attempt.ended_at is not None:
            continue
        policy = policy_for_run(ledger.get_run(attempt.run_id))
        try:
            ended, _ = end_with_decision(
                ledger,
                attempt,
                functools.partial(decide_from_ledger, ledger, policy),
                termination_reason=TerminationReason.CANCELLED,
                termination_detail=f"A person terminated Dagster run {dagster_run_id} after this "
                "attempt was opened and before its trainer launched; nothing was trained.",
            )
        except AttemptAlreadyEndedError:
            continue
        ledger.set_run_status(attempt.run_id, RunStatus.FAILED)
        closed.append(ended)
    return closed


def stop_after_termination(
    ledger: Ledger,
    run_id: str,
    ended_attempt_no: int,
    dagster_run_id: str,
    *,
    when: str | None = None,
) -> AttemptRecord:
    """A person terminated the Dagster run that was continuing ``run_id`` in place, after
    attempt ``ended_attempt_no`` ended and before the next one's trainer launched. Returns the
    attempt whose receipt now says so. ``when`` says when the termination was found, where
    not by that run's own step (the resume sensor finds the run already terminated).

    If the next attempt was already opened, it ends ``cancelled`` (:func:`cancel_unlaunched`).
    Otherwise the ended attempt gets a second decision, ``stop``, its first kept under
    ``previous``: the resume sensor must not carry on a run a person stopped while it waited.
    Either way the run is failed, as after any cancellation.
    """
    opened = cancel_unlaunched(ledger, dagster_run_id)
    if opened:
        return opened[-1]
    ended = ledger.get_attempt(run_id, ended_attempt_no)
    earlier = ended.retry_decision or {}
    record_decision(
        ledger,
        ended,
        RetryDecision(
            action=RetryAction.STOP,
            rule=TERMINATED_BEFORE_CONTINUING,
            reason=f"Stop: A person terminated Dagster run {dagster_run_id} "
            + (when or f"while it waited to continue the run in place after attempt {ended.key}")
            + "; the earlier decision "
            f"({earlier.get('action', 'none')}, rule {earlier.get('rule', '-')}) is kept under "
            "previous.",
            termination_reason=TerminationReason(ended.termination_reason or "cancelled"),
            attempt_no=ended.attempt_no,
            budget_left=dict(earlier.get("budget_left") or {}),
            spent=dict(earlier.get("spent") or {}),
        ),
    )
    ledger.set_run_status(run_id, RunStatus.FAILED)
    return ledger.get_attempt(run_id, ended_attempt_no)


def _no_decision(attempt: AttemptRecord) -> RetryDecision:
    """What stands in for a decision the process that ended the attempt did not record."""
    return RetryDecision(
        action=RetryAction.NONE,
        rule="ended_elsewhere",
        reason=f"Attempt {attempt.key} was ended by another process, which recorded no decision.",
        termination_reason=TerminationReason(attempt.termination_reason or "cancelled"),
        attempt_no=attempt.attempt_no,
        budget_left={},
        spent={},
    )
