"""One owner for every checkpoint decision: when to save, what to resume from, what to keep.

Saving is either synchronous (:meth:`CheckpointManager.save`) or asynchronous
(:meth:`CheckpointManager.save_async`). An async save captures on the training thread what the
next forward/backward may change, and one background thread copies the parameters and the
optimizer state into reused host buffers while that forward/backward runs (they change only in
``optimizer.step()``, which an optimizer step pre-hook holds until the copy is done), then
hashes, writes and commits the checkpoint while training goes on. At most one save is in
flight; the next save (async or not) waits for it first, because staging reuses its buffers.
A writer's error is raised on the training thread by the next ``poll``, ``save``,
``save_async`` or ``wait``, so it is never lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from pipeline import envvars
from pipeline.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    RestoreDivergedError,
    UnsafeCheckpointError,
)
from pipeline.checkpoint.layout import (
    COMMITTED_FILE,
    CORRUPT_FILE,
    MANIFEST_FILE,
    PROBE_FILE,
    TRAINER_STATE_FILE,
    checkpoint_dir_name,
    fsync_dir,
    make_dir_durably,
    parse_checkpoint_dir_name,
    replace_atomically,
)
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.state import (
    CapturedCheckpoint,
    DeviceCopies,
    ProbeSkeleton,
    StagedCheckpoint,
    StagingBuffers,
    TrainingState,
    capture_checkpoint,
    live_tensors,
    probe_logits,
    restore_training_state,
    stage_checkpoint,
)
from pipeline.checkpoint.verify import (
    CheckpointContents,
    CheckpointInfo,
    LedgerCommit,
    checkpoint_dirs,
    is_committed,
    read_trainer_state,
)
from pipeline.checkpoint.writer import (
    WrittenCheckpoint,
    commit_checkpoint_dir,
    cpu_capability,
    write_checkpoint_files,
)
from pipeline.digests import usable_cores
from pipeline.states import CheckpointState

if TYPE_CHECKING:
    from pipeline.ledger import Ledger

log = logging.getLogger(__name__)

# Test hook: sleep between MANIFEST.json and COMMITTED ("seconds" or "seconds@step"), so a
# drill can kill the process, or fence the attempt, in the middle of a checkpoint write:
# TRACKS_FAULT_SLEEP_BEFORE_COMMIT, read in _fault_sleep_before_commit.

# The background writer (and the hashing threads it starts, which inherit it) runs at this
# nice value, so the scheduler gives the training thread a core of its own. Mild on purpose:
# a starved writer would stall the next save, and an unprivileged thread cannot be un-niced.
WRITER_NICE = 5

# GPU kernels are not bit-reproducible across processes; CPU ones are (single thread).
_PROBE_RTOL, _PROBE_ATOL = 1e-4, 1e-5


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint policy: how often to save and which committed checkpoints to keep."""

    interval_steps: int = 100
    keep_last_k: int = 3
    keep_best_k: int = 0
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    # 0: the writer hashes each slice right before writing it (no second busy thread beside
    # training: (d) in bench/checkpoint_bench.py). >= 1: threads hash large files meanwhile.
    hash_workers: int = 0

    def __post_init__(self) -> None:
        if self.hash_workers < 0:
            raise ValueError(f"hash_workers must be >= 0, got {self.hash_workers}")
        if self.interval_steps < 1:
            raise ValueError(f"interval_steps must be >= 1, got {self.interval_steps}")
        if self.keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1, got {self.keep_last_k}")
        if self.keep_best_k < 0:
            raise ValueError(f"keep_best_k must be >= 0, got {self.keep_best_k}")
        if self.keep_best_k and not self.best_metric:
            raise ValueError("keep_best_k > 0 needs best_metric")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")


@dataclass(frozen=True)
class SaveStall:
    """What one async save cost the training thread, in seconds.

    ``capture``: inside ``save_async`` (waiting for the previous save included). ``staging_wait``:
    held in ``optimizer.step()`` because the parameters and optimizer state were still being
    copied (zero when the copy finished during forward/backward).
    """

    step: int
    capture: float
    staging_wait: float

    @property
    def total(self) -> float:
        return self.capture + self.staging_wait


class CheckpointManager:
    """Saves, finds, restores, validates and retires the checkpoints of one run.

    Works with ``ledger=None`` (standalone trainer): the directory is then the only record.
    With a ledger, every save is fenced by the attempt's token and every state change
    (writing, committed, corrupt, superseded) is recorded.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: CheckpointConfig,
        *,
        run_id: str,
        ledger: Ledger | None = None,
        on_event: Callable[[str, dict], None] | None = None,
        on_commit: Callable[[CheckpointInfo], None] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.config = config
        self.run_id = run_id
        self.ledger = ledger
        self._on_event = on_event or (lambda name, fields: None)
        self._on_commit = on_commit or (lambda info: None)
        self.attempt_no: int | None = None
        self.fencing_token: int | None = None
        self.last_committed: CheckpointInfo | None = None
        self._buffers = StagingBuffers()
        # None: not tried yet; False: this model's probe is computed at staging.
        self._skeleton: ProbeSkeleton | bool | None = None
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        # Set once the save in flight no longer reads live parameters or optimizer state, or
        # (on a GPU) once the writer holds the copies the capture enqueued: _device_copies.
        self._staging: threading.Event | None = None
        self._device_copies: DeviceCopies | None = None
        self._step_hook: tuple[torch.optim.Optimizer, Any] | None = None
        self.last_stall: SaveStall | None = None
        # Retention keeps the newest committed checkpoint at or before this step: the last
        # step known clean before the most recent loss spike (see protect_through).
        self.protected_through: int | None = None
        # Set only inside rollback(): resume() then looks no later than this step.
        self._resume_at_most: int | None = None
        self._thread = threading.local()
        # What the writer thread did, told on the training thread (reporters are not shared).
        self._pending: deque[Callable[[], None]] = deque()

    def bind_attempt(self, attempt_no: int, fencing_token: int | None) -> None:
        """Name the attempt whose saves this manager makes (and the token that fences them)."""
        self.attempt_no = attempt_no
        self.fencing_token = fencing_token

    # -- saving ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.config.interval_steps == 0

    def save(
        self, state: TrainingState, *, metrics: dict[str, float] | None = None
    ) -> CheckpointInfo:
        """Stage ``state``, write it and commit it before returning (after any save in flight).

        For the final and the preemption checkpoint: when this returns, it is committed.
        """
        self.wait()
        info = self.write_and_commit(self._stage(state, metrics))
        self._deliver()
        return info

    def save_async(self, state: TrainingState, *, metrics: dict[str, float] | None = None) -> None:
        """Save ``state`` in the background: stage it into host buffers, hash, write, commit.

        Returns after capturing what forward/backward may change (RNG, cursor, scheduler,
        buffers, every JSON value). The parameters and the optimizer state are copied by the
        background thread while the loop runs its next forward/backward; ``optimizer.step()``
        waits for that copy (a step pre-hook), so nothing the loop does can change what gets
        written. Code that changes parameters outside ``optimizer.step()`` calls
        :meth:`wait_staged` first. Waits first for the previous save (raising its error, if it
        failed): its buffers are about to be reused.
        """
        began = time.perf_counter()
        self.wait()
        deferred = self._guard_optimizer(state.optimizer)
        captured = self._capture(state, metrics, defer_probe=True, defer_stable=deferred)
        staging = threading.Event()
        self._writer_error = None
        self._writer = threading.Thread(
            target=self._write_in_background,
            args=(captured, staging),
            name=f"checkpoint-writer-{captured.staged.step}",
            daemon=True,  # never keeps a dying process alive; an unfinished save is uncommitted
        )
        self._staging = staging
        self._writer.start()
        capture = time.perf_counter() - began
        self.last_stall = SaveStall(step=captured.staged.step, capture=capture, staging_wait=0.0)

    def wait_staged(self) -> None:
        """Return once the save in flight no longer reads live parameters or optimizer state.

        ``optimizer.step()`` calls this itself, through a step pre-hook. On a GPU the capture
        enqueued the copies on a side stream and the host waits for nothing; this thread's
        current stream waits for them on the device, so the step's kernels run after them.
        """
        staging, self._staging = self._staging, None
        if staging is None:
            return
        if not staging.is_set():
            began = time.perf_counter()
            staging.wait()
            if self.last_stall is not None:
                waited = self.last_stall.staging_wait + time.perf_counter() - began
                self.last_stall = dataclasses.replace(self.last_stall, staging_wait=waited)
        copies, self._device_copies = self._device_copies, None
        if copies:
            copies.order_current_streams()

    def _guard_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Make ``optimizer.step()`` wait for staging; False if this optimizer cannot be hooked."""
        if self._step_hook is not None and self._step_hook[0] is optimizer:
            return True
        if self._step_hook is not None:
            self._step_hook[1].remove()
            self._step_hook = None
        register = getattr(optimizer, "register_step_pre_hook", None)
        if register is None:
            return False  # not a torch.optim.Optimizer: stage everything on this thread
        handle = register(lambda _optimizer, _args, _kwargs: self.wait_staged())
        self._step_hook = (optimizer, handle)
        return True

    @property
    def save_in_flight(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def poll(self) -> None:
        """Without blocking: report a finished background save, or raise the error it hit."""
        if self._writer is not None and not self._writer.is_alive():
            self.wait()
        else:
            self._deliver()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise the error it hit."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self._staging = None
        self._device_copies = None  # the writer synchronized them before writing
        self._deliver()
        error, self._writer_error = self._writer_error, None
        if error is not None:
            raise error

    def _stage(self, state: TrainingState, metrics: dict[str, float] | None) -> StagedCheckpoint:
        # For save(): the training loop waits until the checkpoint is committed, so the live
        # CPU tensors cannot change while they are written, and are written as they are (a
        # gigabyte copy less: 0.2 s of a synchronous save of 1 GB here). A GPU's are copied.
        return self._capture(state, metrics, alias_cpu=True).finish()

    def _capture(
        self,
        state: TrainingState,
        metrics: dict[str, float] | None,
        *,
        defer_probe: bool = False,
        defer_stable: bool = False,
        alias_cpu: bool = False,
    ) -> CapturedCheckpoint:
        attempt_no = self._require_attempt()
        # JSON (and PostgreSQL's json type) has no NaN or Infinity: such a metric is left out.
        finite = {k: float(v) for k, v in (metrics or {}).items() if math.isfinite(v)}
        if self._skeleton is None and defer_probe:
            # First async save: staged whole, with the probe computed here; a skeleton that
            # reproduces it exactly takes the probe off the training thread from then on.
            staged = stage_checkpoint(
                state,
                run_id=self.run_id,
                attempt_no=attempt_no,
                metrics=finite,
                buffers=self._buffers,
            )
            self._skeleton = ProbeSkeleton.build(state, staged) or False
            return CapturedCheckpoint(staged=staged, pending={})
        return capture_checkpoint(
            state,
            run_id=self.run_id,
            attempt_no=attempt_no,
            metrics=finite,
            buffers=self._buffers,
            run_probe=not (defer_probe and isinstance(self._skeleton, ProbeSkeleton)),
            defer_stable=defer_stable,
            alias_cpu=alias_cpu,
        )

    def _write_in_background(self, captured: CapturedCheckpoint, staging: threading.Event) -> None:
        self._thread.is_writer = True
        try:
            try:
                # At normal priority: the training loop may be waiting for it in optimizer.step.
                copies = self._device_copies = captured.enqueue()
            finally:
                staging.set()
            copies.synchronize()  # a GPU's bytes are in host memory before any is hashed
            _lower_priority()
            # The cores the training loop's own threads leave: one on a 2-core VM that trains
            # on the other, most of them beside a GPU, whose loop needs one core to launch.
            spare = usable_cores() - torch.get_num_threads()
            self.write_and_commit(captured.staged, hash_threads=max(1, spare))
        except BaseException as exc:  # raised on the training thread by poll/wait/save
            self._writer_error = exc

    def _in_writer(self) -> bool:
        return getattr(self._thread, "is_writer", False)

    def _event(self, name: str, fields: dict) -> None:
        if self._in_writer():
            self._pending.append(lambda: self._on_event(name, fields))
        else:
            self._on_event(name, fields)

    def _committed(self, info: CheckpointInfo) -> None:
        if self._in_writer():
            self._pending.append(lambda: self._on_commit(info))
        else:
            self._on_commit(info)

    def _deliver(self) -> None:
        while self._pending:
            self._pending.popleft()()

    def write_and_commit(
        self, staged: StagedCheckpoint, *, hash_threads: int | None = None
    ) -> CheckpointInfo:
        """Write a staged checkpoint and commit it; touches no live training objects.

        BLAKE3 runs on ``hash_threads`` cores (default: every core this process may use, as
        for a synchronous save, which the training loop waits for).

        The ledger commit (which enforces the fencing token) comes before COMMITTED is
        renamed into place: a refused commit leaves an uncommitted directory, which readers
        ignore, and the error propagates.
        """
        attempt_no = self._require_attempt()
        if staged.probe_pending:
            assert isinstance(self._skeleton, ProbeSkeleton)
            staged = self._skeleton.complete(staged)
        directory = self.run_dir / checkpoint_dir_name(staged.step, attempt_no)
        if is_committed(directory):
            raise CheckpointError(f"checkpoint {directory} is already committed; not overwriting")
        if directory.exists():
            shutil.rmtree(directory)  # this attempt's own half-written leftover
        # The run folder's entry in the store is made durable too, not only what is inside it.
        make_dir_durably(self.run_dir)
        parent = str(self.last_committed.path) if self.last_committed else None
        self._record_writing(directory, staged.step, attempt_no, parent)
        try:
            written = write_checkpoint_files(
                staged,
                directory,
                run_id=self.run_id,
                attempt_no=attempt_no,
                hash_workers=self.config.hash_workers,
                hash_threads=usable_cores() if hash_threads is None else hash_threads,
            )
        except BaseException as exc:
            self._abandon(directory, exc, ledger_committed=False)
            raise
        committed = self._commit(written, parent)
        info = CheckpointInfo(
            path=directory,
            run_id=self.run_id,
            attempt_no=attempt_no,
            step=staged.step,
            manifest_sha256=written.manifest_sha256,
            fencing_token=self.fencing_token,
            committed_at=committed["committed_at"],
            size_bytes=written.size_bytes,
            metrics=written.metrics,
        )
        self.last_committed = info
        self._committed(info)
        try:
            self.apply_retention()
        except Exception as exc:  # the commit stands; a missed clean-up is retried next save
            log.warning("retention after %s failed: %s", directory, exc)
            self._event("retention_failed", {"path": str(directory), "error": str(exc)})
        return info

    def _record_writing(
        self, directory: Path, step: int, attempt_no: int, parent: str | None
    ) -> None:
        """The ledger learns of the save before a byte is written (fenced by the token)."""
        if self.ledger is not None:
            self.ledger.checkpoint_writing(
                run_id=self.run_id,
                attempt_no=attempt_no,
                step=step,
                path=str(directory),
                fencing_token=self._token(),
                parent_path=parent,
            )

    def _commit(self, written: WrittenCheckpoint, parent: str | None) -> dict[str, Any]:
        """Commit the ledger row under the token, then rename COMMITTED into place.

        A refused or failed commit abandons the directory (see :meth:`_abandon`) and raises.
        """
        ledger_committed = False
        try:
            _fault_sleep_before_commit(written.step)
            if self.ledger is not None:
                self.ledger.commit_checkpoint(
                    run_id=self.run_id,
                    attempt_no=written.attempt_no,
                    path=str(written.path),
                    manifest_sha256=written.manifest_sha256,
                    size_bytes=written.size_bytes,
                    metrics=written.metrics,
                    fencing_token=self._token(),
                    step=written.step,
                    parent_path=parent,
                )
                ledger_committed = True
            return commit_checkpoint_dir(written, fencing_token=self.fencing_token)
        except BaseException as exc:
            self._abandon(written.path, exc, ledger_committed=ledger_committed)
            raise

    def _abandon(self, directory: Path, exc: BaseException, *, ledger_committed: bool) -> None:
        """A save that failed: its directory never gets COMMITTED.

        After a storage error the directory is removed, to give back the space it took (the
        last words still have to be written); after a refusal it stays, as evidence of what the
        fenced attempt had written, until a newer attempt's retention removes it.
        """
        detail = f"abandoned, never committed: {type(exc).__name__}: {exc}"[:1000]
        log.warning("checkpoint %s %s", directory, detail)
        self._event("checkpoint_abandoned", {"path": str(directory), "detail": detail})
        if isinstance(exc, OSError) and not is_committed(directory):
            shutil.rmtree(directory, ignore_errors=True)
        if self.ledger is None:
            return
        # The ledger said committed but COMMITTED never landed: the row must not be lineage.
        state = CheckpointState.CORRUPT if ledger_committed else CheckpointState.WRITING
        try:
            self.ledger.set_checkpoint_state(self.run_id, str(directory), state, detail)
        except Exception as ledger_exc:  # the original error is the one worth raising
            log.warning("could not record %s as abandoned: %s", directory, ledger_exc)

    # -- resuming -------------------------------------------------------------------------

    def committed_dirs(self) -> list[Path]:
        """Committed checkpoint directories, newest first, minus those the ledger ruled out.

        Corrupt ones failed verification; superseded ones were rolled back past (a diverged
        attempt) or retired by retention: neither is a resume target again.
        """
        ruled_out = set()
        if self.ledger is not None:
            ruled_out = {
                c.path
                for c in self.ledger.checkpoints(
                    self.run_id, [CheckpointState.CORRUPT, CheckpointState.SUPERSEDED]
                )
            }
        cap = self._resume_at_most
        return [
            d
            for d in checkpoint_dirs(self.run_dir)
            if str(d) not in ruled_out and (cap is None or _dir_step(d) <= cap)
        ]

    def ledger_commits(self) -> dict[str, LedgerCommit] | None:
        """What the ledger committed, by directory: None without a ledger (the directory is
        then the only record). A directory missing from the map has no committed row: with a
        ledger, nothing the store holds is a checkpoint unless the ledger committed it."""
        if self.ledger is None:
            return None
        return {
            c.path: LedgerCommit(c.manifest_sha256)
            for c in self.ledger.checkpoints(self.run_id, [CheckpointState.COMMITTED])
        }

    @staticmethod
    def ledger_commit_of(
        directory: Path, commits: dict[str, LedgerCommit] | None
    ) -> LedgerCommit | None:
        """The ledger's word on ``directory`` (see :meth:`ledger_commits`), None without one."""
        if commits is None:
            return None
        return commits.get(str(directory), LedgerCommit(None))

    def resume(self, state: TrainingState) -> CheckpointInfo | None:
        """Restore ``state`` from the newest committed checkpoint that verifies and validates.

        A candidate that fails is marked corrupt (in the ledger when attached) and the
        previous one is tried. Returns None, with ``state`` untouched, when none is usable.

        Each candidate is checked against the run first (its ``trainer_state.json`` alone:
        config, run, data), then its tensors are read straight into the live ones where they
        match (the model's parameters and buffers, the optimizer's moments once they exist, on
        the CPU or a GPU). A resume then maps no fresh memory for them and copies nothing
        afterwards: on a VM, first touching a gigabyte of fresh pages costs more CPU than
        reading it, and a GPU's tensors get each block as it is read and hashed.
        The price is that a candidate failing after its bytes were read (a digest, a probe)
        leaves the live state changed. An older candidate that restores overwrites all of it
        (model strictly, optimizer state whole); when none does, this raises
        :class:`RestoreDivergedError` instead of returning a state that is neither, and the
        trainer builds its initial state again from the seed.

        When nothing could be read in place (no live tensor matched, or they live on another
        kind of device), the live state keeps the rollback copy: a copy of it made before the
        first restore, skipped when the candidate's weights already reproduce its probe logits
        outside the model.
        """
        fresh: StagedCheckpoint | None = None
        changed: tuple[Path, Exception] | None = None
        commits = self.ledger_commits()
        for directory in self.committed_dirs():
            touched = False
            # With a ledger, MANIFEST.json must be the one it committed: every read below
            # verifies against that manifest, so a re-signed folder is refused before its bytes.
            vouched = self.ledger_commit_of(directory, commits)
            try:
                saved = read_trainer_state(directory, ledger_commit=vouched)
                if saved.get("config_sha256") != state.config_sha256:
                    # Written under an earlier config of this run (e.g. before an OOM retry
                    # with a smaller batch): not this trajectory, so not a resume target.
                    self._event(
                        "checkpoint_skipped",
                        {"path": str(directory), "why": "written under a different config"},
                    )
                    continue
                self._check_belongs(directory, saved, state)
                into = live_tensors(state)
                touched = any(into.values())  # bytes may land before the digest is known
                early: list[torch.Tensor] = []
                probe_early = functools.partial(_probe_early, state, into=early)
                # Nothing runs beside a resume: BLAKE3 may take every core.
                contents = load_checkpoint(
                    directory,
                    into=into,
                    on_model=probe_early,
                    hash_threads=usable_cores(),
                    ledger_commit=vouched,
                )
                touched = contents.read_in_place
                self._check_belongs(directory, contents.trainer_state, state)
                if (
                    not touched
                    and fresh is None
                    and not (
                        contents.trainer_state.get("step") == contents.info.step
                        and probe_matches_outside_model(state, contents)
                    )
                ):
                    fresh = stage_checkpoint(state, run_id=self.run_id, attempt_no=0)
                touched = True
                self.restore(state, contents, logits=early[0] if early else None)
            except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
                self.mark_corrupt(directory, exc)
                if touched:
                    if fresh is not None:
                        _restore_staged(state, fresh)
                        changed = None
                    else:
                        changed = (directory, exc)
                continue
            self.last_committed = contents.info
            return contents.info
        if changed is not None:
            raise RestoreDivergedError(changed[0], str(changed[1])) from changed[1]
        return None

    def rollback(self, state: TrainingState, *, at_most_step: int) -> CheckpointInfo | None:
        """Restore the newest committed checkpoint at or before ``at_most_step`` (a loss
        spike's rollback), by the resume path itself: verified, checked against the run, read
        into the live tensors, probed. None when there is none to go back to (``state`` is
        then untouched); :class:`RestoreDivergedError` as for :meth:`resume`.

        Waits for a save in flight first: its writer reads the live tensors this overwrites.
        """
        self.wait()
        self._resume_at_most = at_most_step
        try:
            return self.resume(state)
        finally:
            self._resume_at_most = None

    def retire_newer_than(self, target: CheckpointInfo, why: str) -> list[Path]:
        """After a rollback to ``target``: the committed checkpoints after it are superseded
        (in the ledger, with ``why``) and deleted, COMMITTED first.

        They belong to the trajectory the rollback abandoned, so nothing may resume from them,
        and the replayed steps will save under the same names. One an evaluation or promotion
        references is superseded but kept. Returns the directories deleted.
        """
        referenced: set[str] = set()
        if self.ledger is not None:
            referenced = {str(Path(p).resolve()) for p in self.ledger.referenced_checkpoint_paths()}
        deleted = []
        for directory in self.committed_dirs():
            if _dir_step(directory) <= target.step or directory == Path(target.path):
                continue
            if self.ledger is not None:
                self.ledger.set_checkpoint_state(
                    self.run_id, str(directory), CheckpointState.SUPERSEDED, why
                )
            if str(directory) in referenced:
                continue
            (directory / COMMITTED_FILE).unlink(missing_ok=True)
            fsync_dir(directory)
            shutil.rmtree(directory, ignore_errors=True)
            deleted.append(directory)
        if deleted:
            fsync_dir(self.run_dir)
            self._event("checkpoints_superseded", {"paths": [str(d) for d in deleted], "why": why})
        return deleted

    def protect_through(self, step: int | None) -> None:
        """Retention keeps the newest committed checkpoint at or before ``step`` whatever
        keep_last_k says: the last clean one before the most recent loss spike, so checkpoints
        written after it (perhaps already bad) cannot push every good one out."""
        self.protected_through = step

    def restore(
        self,
        state: TrainingState,
        contents: CheckpointContents,
        *,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Load ``contents`` into ``state`` and re-run the probe batch (post-restore validation).

        ``logits``: the probe batch's outputs, already computed from the model as it
        holds ``contents.model`` (read in place; restoring the rest does not change it).
        """
        try:
            restore_training_state(
                state,
                model_tensors=contents.model,
                training_tensors=contents.training_tensors,
                trainer_state=contents.trainer_state,
            )
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise CorruptCheckpointError(
                contents.info.path, "trainer_state.json", f"does not restore: {exc}"
            ) from exc
        if state.step != contents.info.step:
            raise CorruptCheckpointError(
                contents.info.path,
                "trainer_state.json",
                f"step {state.step} but COMMITTED says {contents.info.step}",
            )
        validate_probe(state, contents, actual=logits)

    def _check_belongs(self, directory: Path, saved: dict[str, Any], state: TrainingState) -> None:
        if saved.get("run_id") != self.run_id:
            raise CorruptCheckpointError(
                directory,
                "trainer_state.json",
                f"run_id {saved.get('run_id')!r} but the checkpoint lies under run {self.run_id!r}",
            )
        if saved.get("config_sha256") != state.config_sha256:
            raise CheckpointMismatchError(
                directory, "config_sha256", saved.get("config_sha256"), state.config_sha256
            )
        if (
            state.data_manifest_sha256 is not None
            and saved.get("data_manifest_sha256") != state.data_manifest_sha256
        ):
            raise CheckpointMismatchError(
                directory,
                "data_manifest_sha256",
                saved.get("data_manifest_sha256"),
                state.data_manifest_sha256,
            )

    def reconcile_with_ledger(
        self, state: TrainingState, resumed: CheckpointInfo | None
    ) -> CheckpointInfo | None:
        """Once this attempt holds the run's fencing token: make sure no commit was missed.

        An older attempt may have been recorded committed in the ledger just before our token
        was issued, yet renamed COMMITTED into place only after :meth:`resume` looked. Resume
        from that checkpoint, or, if its directory never got COMMITTED, mark it corrupt: either
        way the run keeps a single lineage. Nobody else can commit from here on.
        """
        if self.ledger is None:
            return resumed
        while True:
            latest = self.ledger.latest_committed_checkpoint(self.run_id)
            if latest is None:
                return resumed
            if resumed is not None and (latest.step, latest.attempt_no) <= (
                resumed.step,
                resumed.attempt_no,
            ):
                return resumed
            path = Path(latest.path)
            if is_committed(path):
                if path not in self.committed_dirs() or _config_of(path) != state.config_sha256:
                    return resumed  # not a resume target for this attempt anyway
                again = self.resume(state)
                if again is not None and again != resumed:
                    self._event("resume_target_changed", {"path": str(again.path)})
                return again
            self.mark_corrupt(
                path,
                CheckpointError(
                    f"the ledger recorded checkpoint {path} as committed but it has no "
                    f"{COMMITTED_FILE}: attempt {latest.attempt_no} stopped between the two"
                ),
            )

    def mark_corrupt(self, directory: Path, exc: Exception) -> None:
        log.warning("skipping checkpoint %s: %s", directory, exc)
        self._event("checkpoint_corrupt", {"path": str(directory), "detail": str(exc)})
        # On disk too, so a trainer without a ledger (and retention) never counts it again.
        # Never written through a link: a symlinked directory is refused, not marked.
        if directory.is_dir() and not directory.is_symlink():
            try:
                replace_atomically(directory / CORRUPT_FILE, f"{exc}\n".encode())
            except OSError as write_exc:
                log.warning("could not mark %s corrupt on disk: %s", directory, write_exc)
        if self.ledger is not None:
            self.ledger.set_checkpoint_state(
                self.run_id, str(directory), CheckpointState.CORRUPT, str(exc)
            )

    # -- retention ------------------------------------------------------------------------

    def apply_retention(self) -> list[Path]:
        """Supersede and delete committed checkpoints beyond keep-last-K and best-K.

        Never deletes the newest committed checkpoint, nor one an evaluation or promotion
        references, nor the newest one before the most recent loss spike
        (:meth:`protect_through`). Returns the directories deleted.
        """
        committed = self.committed_dirs()
        if not committed:
            return []
        keep = set(committed[: self.config.keep_last_k])
        keep.add(committed[0])
        if self.config.keep_best_k and self.config.best_metric:
            scored = [
                (m, d)
                for d in committed
                if (m := _manifest_metric(d, self.config.best_metric)) is not None
            ]
            scored.sort(key=lambda pair: pair[0], reverse=self.config.best_mode == "max")
            keep.update(d for _, d in scored[: self.config.keep_best_k])
        if self.protected_through is not None:
            clean = [d for d in committed if _dir_step(d) <= self.protected_through]
            keep.update(clean[:1])
        referenced: set[str] = set()
        if self.ledger is not None:
            referenced = {str(Path(p).resolve()) for p in self.ledger.referenced_checkpoint_paths()}
        deleted = []
        for directory in committed:
            if directory in keep or str(directory) in referenced:
                continue
            if self.ledger is not None:
                self.ledger.set_checkpoint_state(
                    self.run_id,
                    str(directory),
                    CheckpointState.SUPERSEDED,
                    f"retention: beyond keep_last_k={self.config.keep_last_k}"
                    f" and keep_best_k={self.config.keep_best_k}",
                )
            # COMMITTED goes first, so a half-deleted directory is never taken for a checkpoint.
            (directory / COMMITTED_FILE).unlink(missing_ok=True)
            fsync_dir(directory)
            shutil.rmtree(directory, ignore_errors=True)
            deleted.append(directory)
        abandoned = self._remove_abandoned(newest_step=_dir_step(committed[0]))
        if deleted or abandoned:
            fsync_dir(self.run_dir)
        if deleted:
            self._event("checkpoints_superseded", {"paths": [str(d) for d in deleted]})
        return deleted

    def _remove_abandoned(self, *, newest_step: int) -> list[Path]:
        """Delete what earlier attempts left half-written at or before the newest commit.

        Only older attempts' directories: they are dead (or fenced), and a newer checkpoint
        exists, so nothing can ever commit or read them.
        """
        removed = []
        for directory in checkpoint_dirs(self.run_dir, committed_only=False):
            key = parse_checkpoint_dir_name(directory.name)
            if key is None or is_committed(directory):
                continue
            step, attempt_no = key
            if step <= newest_step and attempt_no < (self.attempt_no or 0):
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
        return removed

    # -- helpers --------------------------------------------------------------------------

    def _require_attempt(self) -> int:
        if self.attempt_no is None:
            raise CheckpointError("bind_attempt() must name the attempt before it can save")
        return self.attempt_no

    def _token(self) -> int:
        if self.fencing_token is None:
            raise CheckpointError(
                f"attempt {self.run_id}#{self.attempt_no} has a ledger but no fencing token"
            )
        return self.fencing_token


def probe_matches_outside_model(state: TrainingState, contents: CheckpointContents) -> bool:
    """Whether the checkpoint's weights give its saved probe logits, bit for bit, without
    loading them into ``state.model`` (``torch.func.functional_call``; CPU models only).

    False means "not known", never "corrupt": only the post-restore probe decides that.
    """
    model = state.model
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return False
    if contents.probe_device != "cpu":
        return False
    from torch.func import functional_call

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = functional_call(model, contents.model, (contents.probe["inputs"],))
    except Exception:  # names or shapes the model does not take: let restore say why
        return False
    finally:
        model.train(was_training)
    expected = contents.probe["logits"]
    return logits.shape == expected.shape and torch.equal(logits, expected)


def _probe_early(
    state: TrainingState, probe: dict[str, torch.Tensor], into: list[torch.Tensor]
) -> None:
    """The probe pass on a model that already holds a candidate's weights, run while the
    optimizer's state is still being read: it costs the restore no time of its own."""
    try:
        into.append(probe_logits(state.model, probe["inputs"]).detach().cpu())
    except Exception:  # inputs the model does not take: the post-restore pass says why
        return


def validate_probe(
    state: TrainingState, contents: CheckpointContents, *, actual: torch.Tensor | None = None
) -> None:
    """Recompute the probe logits (unless ``actual`` holds them) and compare: exactly on the
    same CPU kernels, else allclose."""
    inputs, expected = contents.probe["inputs"], contents.probe["logits"]
    if actual is None:
        actual = probe_logits(state.model, inputs).detach().cpu()
    device = str(next(state.model.parameters()).device)
    # Exact only where the kernels are the same: CPU on both sides, same instruction set.
    exact = (
        contents.probe_device == "cpu"
        and device == "cpu"
        and contents.probe_cpu_capability == cpu_capability()
    )
    if actual.shape != expected.shape:
        raise CorruptCheckpointError(
            contents.info.path,
            PROBE_FILE,
            f"post-restore probe logits have shape {tuple(actual.shape)},"
            f" saved ones {tuple(expected.shape)}",
        )
    same = (
        torch.equal(actual, expected)
        if exact
        else torch.allclose(actual, expected, rtol=_PROBE_RTOL, atol=_PROBE_ATOL)
    )
    if not same:
        diff = (actual - expected).abs().max().item()
        raise CorruptCheckpointError(
            contents.info.path,
            PROBE_FILE,
            f"post-restore probe logits differ from those saved (max abs diff {diff:.3g},"
            f" {'exact' if exact else 'allclose'} comparison, saved on {contents.probe_device}"
            f" ({contents.probe_cpu_capability or 'CPU kernels not recorded'}),"
            f" restored on {device} ({cpu_capability()}))",
        )


def _restore_staged(state: TrainingState, staged: StagedCheckpoint) -> None:
    restore_training_state(
        state,
        model_tensors=staged.model,
        training_tensors=staged.training_tensors,
        trainer_state=staged.trainer_state,
    )


def _config_of(directory: Path) -> str | None:
    try:
        return json.loads((directory / TRAINER_STATE_FILE).read_bytes()).get("config_sha256")
    except (OSError, ValueError, AttributeError):
        return None


def _dir_step(directory: Path) -> int:
    key = parse_checkpoint_dir_name(directory.name)
    return key[0] if key else 0


def _manifest_metric(directory: Path, metric: str) -> float | None:
    try:
        value = json.loads((directory / MANIFEST_FILE).read_bytes()).get("metrics", {}).get(metric)
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, int | float) else None


def _lower_priority() -> None:
    # Linux: PRIO_PROCESS with a thread id renices that thread only. Elsewhere, or where it
    # is not allowed, the writer runs at normal priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


def _fault_sleep_before_commit(step: int) -> None:
    spec = envvars.TRACKS_FAULT_SLEEP_BEFORE_COMMIT.get()
    if not spec:
        return
    seconds, _, at_step = spec.partition("@")
    if at_step and int(at_step) != step:
        return
    time.sleep(float(seconds))
