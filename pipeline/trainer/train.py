"""The training loop: build, maybe resume, step, maybe save (nanoGPT / torchtitan style).

``run_training`` never raises and never exits: it returns the exit code, having written the
receipt (last words, ledger) for whatever happened. Determinism is a feature here: with the
same config and snapshot, an interrupted-and-resumed run on CPU reproduces an uninterrupted
one bit for bit.

Stopping (SIGTERM/SIGINT set a flag, :mod:`pipeline.trainer.stop`): the loop reads the flag
once per step and, distributed, the ranks agree on it at every step; only what they agreed
decides, so every rank saves the same step and exits 75 (a flag set later is seen at the next
agreement). During a distributed start-up a stop ends the attempt where it is, exit 75, nothing
trained or saved. A stop whose collectives find a peer rank gone (torchrun's agent SIGTERMs the
survivors of a dead rank) is still a preemption, exit 75, and its sentence says the peer died
and which checkpoint is the newest committed; the launcher's exit code is then the dead rank's.
"""

from __future__ import annotations

import functools
import math
import os
import random
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import envvars, redact
from pipeline.checkpoint import (
    CheckpointConfig,
    CheckpointInfo,
    CheckpointManager,
    CheckpointMismatchError,
    RestoreDivergedError,
    RNGState,
    TrainingState,
    checkpoint_dirs,
    layout,
    parse_checkpoint_dir_name,
)
from pipeline.checkpoint.direct_io import DIRECT_MIN_BYTES, prepare_read_buffers
from pipeline.determinism import use_deterministic_kernels
from pipeline.distributed import CollectiveError, Groups, PeerRankError, World
from pipeline.distributed.launch import launched_here
from pipeline.distributed.world import JoinAbandoned
from pipeline.environment import fault_hooks
from pipeline.states import TerminationReason
from pipeline.tracking import TrainingTracker
from pipeline.trainer import exit_codes, optimizers
from pipeline.trainer.attempt import (
    AttemptHandle,
    Outcome,
    last_words_path,
    next_standalone_attempt_no,
    write_last_words,
)
from pipeline.trainer.averaging import GradientAverager
from pipeline.trainer.config import ConfigError, TrainConfig
from pipeline.trainer.data import BadInputError, EpochSampler, TrainingData, load_training_data
from pipeline.trainer.families import family
from pipeline.trainer.gradients import GradientBuffer
from pipeline.trainer.reporting import Reporter, StdoutReporter, make_reporter
from pipeline.trainer.spikes import HealthEvent, Spike, TrainingHealth, spike_words
from pipeline.trainer.startup import Beside, StartupClock
from pipeline.trainer.stop import StopRequest
from pipeline.trainer.timing import BETWEEN, StepTimer
from pipeline.trainer.watchdog import HangContext, HangFault, Stall, Watchdog, end_hung_attempt

# Test hook: after step N, pause ("seconds@N") until the pause ends or a stop is requested,
# so a drill can SIGKILL or SIGTERM the trainer at a known step.
FAULT_SLEEP_AFTER_STEP = envvars.TRACKS_FAULT_SLEEP_AFTER_STEP.name
# Test hook: a "smaller node": the first step raises torch.OutOfMemoryError when the batch is
# larger than this, so drills can exercise the OOM reason and its retry rule on a CPU.
FAULT_OOM_ABOVE_BATCH = envvars.TRACKS_FAULT_OOM_ABOVE_BATCH.name
# Test hook: "seconds@step@rank" (step and rank may be left empty: every one) pauses that rank
# inside the stop agreement, after it read its own flag and before it reduces, so a drill can
# land a signal there: on this rank, or on a peer waiting in the reduction.
FAULT_SLEEP_BEFORE_AGREEMENT = envvars.TRACKS_FAULT_SLEEP_BEFORE_AGREEMENT.name
# Test hook: "60,61": the batches numbered 60 and 61 in the data order (steps 60 and 61 of a run
# that skipped none) reach the model corrupted by their family (digits: pixels scaled by 1000;
# text-lm: targets permuted), a loss spike on demand.
# By batch, not by step: a rollback that deals past them leaves no corrupted batch behind.
FAULT_SPIKE_BATCHES = envvars.TRACKS_FAULT_SPIKE_BATCHES.name


class StoppedBeforeTraining(Exception):
    """A distributed rank was asked to stop during start-up: it stops there, trained nothing.

    Its peers may be gone (torchrun's agent SIGTERMs the survivors of a dead rank), and the
    next collective could wait minutes on them; there is nothing new to save anyway.
    """

    def __init__(self, rank: int, when: str) -> None:
        self.rank, self.when = rank, when  # "after loading the training data"
        super().__init__(f"rank {rank}: stop requested, seen {when}")


def run_training(
    config: TrainConfig | str | Path,
    *,
    run_id: str,
    store: str | Path,
    ledger_url: str | None = None,
    attempt_no: int | None = None,
    fencing_token: int | None = None,
    reporter: Reporter | None = None,
    stop: StopRequest | None = None,
    startup: StartupClock | None = None,
) -> int:
    """Train ``run_id`` to ``max_steps`` under ``store``, resuming from its newest checkpoint.

    Returns an exit code from :mod:`pipeline.trainer.exit_codes`. ``config`` may be a path
    to a YAML file (a config that does not load is a ``CONFIG_ERROR`` with last words).
    ``startup``: the clock ``main()`` started, so the receipt's start-up split
    (``timings.startup``) counts the process's start and its imports too.
    """
    started, cpu_started = time.monotonic(), time.process_time()
    startup = startup or StartupClock()
    startup.entered()
    world = World.from_env()
    # Rank 0 alone speaks for the attempt (Pipes, ledger); the other ranks write JSON lines
    # to their own stdout, which the launcher keeps in a file per rank.
    reporter = reporter or (make_reporter() if world.leader else StdoutReporter())
    stop = stop or StopRequest()
    # Refused before anything is written: an id that would leave the store is bad input.
    run_dir = layout.run_dir(store, run_id)
    attempt: AttemptHandle | None = None
    trainer: Trainer | None = None
    loaded: TrainConfig | None = None
    try:
        # The ledger first: a config that does not load still leaves its attempt row.
        with startup.part("ledger"):
            ledger = (
                _open_ledger(ledger_url, orchestrated=attempt_no is not None)
                if world.leader
                else None
            )
        attempt = AttemptHandle(
            run_id=run_id,
            run_dir=run_dir,
            ledger=ledger,
            attempt_no=attempt_no,
            fencing_token=fencing_token,
            reporter=reporter,
        )
        loaded = config if isinstance(config, TrainConfig) else TrainConfig.load(config)
        trainer = Trainer(
            loaded, attempt, reporter, stop, started=started, world=world, startup=startup
        )
        outcome = trainer.run()
    except Exception as exc:
        outcome = classify_exception(exc, step=trainer.step if trainer else None)
        reporter.event(
            "error",
            {"reason": str(outcome.reason), "traceback": traceback.format_exc(limit=20)},
            level="error",
        )
    ended = time.monotonic()
    wall = ended - started
    # What each clock measured, so "ran 15 s" on the receipt and this process's 11.7 s agree
    # on what they are: the receipt counts from the orchestrator's begin to its end.
    timings: dict[str, Any] = {"trainer_process_seconds": round(wall, 3)}
    if trainer is not None and trainer.loop_started is not None:
        timings["setup_seconds"] = round(trainer.loop_started - started, 3)
        timings["training_seconds"] = round(ended - trainer.loop_started, 3)
    # Where the start-up went, up to the end of the first step (pipeline/trainer/startup.py).
    if split := startup.split(trainer.loop_started if trainer is not None else None):
        timings["startup"] = split
    if trainer is not None and (steps := trainer.step_timings()):
        timings["steps"] = steps  # type: ignore[assignment]  # per rank: median, p99 per phase
    cpu_seconds = time.process_time() - cpu_started
    # One accelerator per rank when distributed; every visible one for a single process.
    gpu_seconds = (
        wall * (world.world_size if world.distributed else torch.cuda.device_count())
        if trainer and trainer.on_gpu
        else 0.0
    )
    # Self-owned and distributed under the launcher: the launcher closes the attempt, because
    # it alone sees which rank failed first (rank 0 sees a broken collective).
    defer_end = bool(
        world.distributed and launched_here() and attempt is not None and attempt.owns_attempt
    )
    number = _leave_receipt(
        outcome,
        config=loaded,
        attempt=attempt,
        trainer=trainer,
        reporter=reporter,
        store=Path(store),
        run_id=run_id,
        attempt_no=attempt_no,
        config_source=None if isinstance(config, TrainConfig) else str(config),
        cpu_seconds=cpu_seconds,
        gpu_seconds=gpu_seconds,
        rank=world.rank,
        defer_end=defer_end,
    )
    if trainer is not None and trainer.groups is not None:
        trainer.groups.close()
    if world.distributed:
        from pipeline.distributed.launch import write_rank_outcome

        try:
            write_rank_outcome(
                world.rank,
                exit_code=outcome.exit_code,
                reason=str(outcome.reason),
                detail=outcome.detail,
                step=outcome.step,
                attempt_no=attempt.attempt_no if attempt is not None else attempt_no,
                deferred_end=defer_end,
                cpu_seconds=cpu_seconds,
                gpu_seconds=gpu_seconds,
            )
        except OSError as exc:
            reporter.event("outcome_unwritten", {"error": str(exc)[:300]}, level="warning")
    reporter.event(
        "attempt_finished",
        {
            "run_id": run_id,
            "attempt_no": number,
            "reason": str(outcome.reason),
            "exit_code": outcome.exit_code,
            "detail": outcome.detail,
            "step": outcome.step,
            "last_checkpoint": trainer.last_checkpoint_path if trainer else None,
            "wall_seconds": round(wall, 3),
            "timings": timings,
        },
        level="info" if outcome.exit_code == exit_codes.SUCCEEDED else "warning",
    )
    if attempt is not None and attempt.ledger is not None and attempt.attempt_no is not None:
        try:
            attempt.ledger.set_timings(run_id, attempt.attempt_no, timings)
        except Exception as exc:  # a receipt detail; never worth failing the attempt over
            reporter.event("ledger_unreachable", {"error": str(exc)[:500]}, level="warning")
    reporter.close()
    return outcome.exit_code


def _leave_receipt(
    outcome: Outcome,
    *,
    config: TrainConfig | None,
    attempt: AttemptHandle | None,
    trainer: Trainer | None,
    reporter: Reporter,
    store: Path,
    run_id: str,
    attempt_no: int | None,
    cpu_seconds: float,
    gpu_seconds: float,
    config_source: str | None = None,
    rank: int = 0,
    defer_end: bool = False,
) -> int:
    """End a self-owned attempt in the ledger and write last words; returns the attempt number.

    ``defer_end``: begin the attempt if it failed before it could, but leave its end to the
    launcher (``pipeline.distributed.launch.end_deferred_attempt``).
    """
    data = trainer.data if trainer else None
    if attempt is not None and config is None and config_source is not None:
        try:
            attempt.begin_unloadable(config_source, outcome.detail)
            if not defer_end:
                attempt.end(outcome, cpu_seconds=cpu_seconds, gpu_seconds=gpu_seconds)
        except Exception as exc:
            reporter.event("ledger_unreachable", {"error": str(exc)[:500]}, level="error")
    if attempt is not None and config is not None:
        try:
            if not attempt.begun and outcome.reason != TerminationReason.SUCCEEDED:
                # Failed before it could begin: still a first-class attempt row.
                attempt.begin(
                    config,
                    snapshot_id=data.snapshot_id if data else None,
                    data_manifest_sha256=data.manifest_sha256 if data else None,
                    # A stop at start-up may come after the restore: the receipt keeps it.
                    resumed_from=trainer.last_checkpoint_path if trainer else None,
                )
            if not defer_end:
                attempt.end(outcome, cpu_seconds=cpu_seconds, gpu_seconds=gpu_seconds)
        except Exception as exc:
            reporter.event("ledger_unreachable", {"error": str(exc)[:500]}, level="error")
    number = (attempt.attempt_no if attempt else None) or attempt_no
    if number is None:
        number = next_standalone_attempt_no(layout.run_dir(store, run_id))
    if outcome.reason != TerminationReason.SUCCEEDED or outcome.nothing_trained:
        try:
            write_last_words(
                last_words_path(store, run_id, number, rank=rank),
                run_id=run_id,
                attempt_no=number,
                outcome=outcome,
                last_checkpoint=trainer.last_checkpoint_path if trainer else None,
            )
        except OSError as exc:
            reporter.event("last_words_unwritten", {"error": str(exc)[:500]}, level="error")
    return number


class Trainer:
    """One attempt's training: build, maybe resume, step, maybe save."""

    # Set when the loop starts: its step timer, hang watchdog and the drill's hang hook; at
    # several ranks, every rank's step timing once the loop ended together.
    _timer: StepTimer | None = None
    _watchdog: Watchdog | None = None
    _hang_fault: HangFault | None = None
    _step_timings: dict[str, Any] | None = None

    def __init__(
        self,
        config: TrainConfig,
        attempt: AttemptHandle,
        reporter: Reporter,
        stop: StopRequest,
        *,
        started: float,
        world: World | None = None,
        startup: StartupClock | None = None,
    ) -> None:
        self.config = config
        self.world = world or World()
        self.startup = startup or StartupClock()  # the receipt's start-up split
        self.groups: Groups | None = None
        # The gradients' average over the ranks, when distributed (pipeline/trainer/averaging.py).
        self._averager: GradientAverager | None = None
        self.attempt = attempt
        self.reporter = reporter
        self.stop = stop
        self.started = started
        self.loop_started: float | None = None  # when the first step began (set-up is over)
        self.step: int | None = None
        self.data: TrainingData | None = None
        self.on_gpu = config.device == "cuda"
        self.last_checkpoint: CheckpointInfo | None = None
        self._manager: CheckpointManager | None = None
        self._tracker: TrainingTracker | None = None
        self._stop_save_step: int | None = None  # the step of a preemption save under way

    @property
    def last_checkpoint_path(self) -> str | None:
        return str(self.last_checkpoint.path) if self.last_checkpoint else None

    def run(self) -> Outcome:
        """Start up, maybe resume, train to ``max_steps`` or to a stop; the attempt's outcome.

        Distributed, a stop during start-up ends the attempt there (nothing trained, nothing to
        save), and a stop that finds a peer rank gone is still a stop, whose sentence says so.
        """
        try:
            return self._start_and_train()
        except (StoppedBeforeTraining, JoinAbandoned) as exc:
            return self._stopped_before_training(exc)
        except CollectiveError as exc:
            # torchrun's agent SIGTERMs the survivors of a dead rank: the broken collective is
            # how this rank learnt of the death it was asked to stop for, not a failure of its own.
            if not (self.stop.requested and self.loop_started is None):
                raise
            return self._stopped_before_training(exc)

    def _start_and_train(self) -> Outcome:
        cfg = self.config
        world = self.world
        device = make_deterministic(cfg)
        if world.distributed and cfg.batch_size % world.world_size:
            raise ConfigError(
                "config",
                "batch_size",
                f"{cfg.batch_size} does not split evenly over {world.world_size} ranks",
            )
        # The data loads on a thread of its own while this rank waits for the other ranks to
        # join. Only waits run beside it: the model's build imports torch's modules, and two
        # threads importing at once only slow each other down (a GIL hand-off at every file
        # the import machinery reads: measured 2026-11-27, when the optimizer still imported
        # torch._dynamo, a resume's first step took 24 s with the build beside the data load
        # and 16 s after it, medians of 6 on a loaded 2-vCPU VM). Nor can the restore run
        # beside it: it checks the checkpoint against the data's digest and restores the data
        # cursor, whose size is the data's.
        loading = Beside(
            lambda: load_training_data(
                cfg.snapshot_dir,
                model_family=cfg.model_family,
                model_section=cfg.to_dict()["model"],
                ledger=self.attempt.ledger,
            ).to(device),
            name="training-data",
        )
        if world.distributed:
            if self.stop.requested:  # joining would only keep the peers waiting for nothing
                raise StoppedBeforeTraining(world.rank, "before joining the other ranks")
            # Given up on a stop: a peer killed before it joined would hold this rank for minutes.
            self.groups = Groups(world, device, abandon=lambda: self.stop.requested)
        elif _resumes_large_files(self.attempt.run_dir):
            prepare_read_buffers()  # on a thread of its own, while the data loads
        try:
            self.data = data = loading.result()
        finally:
            self.startup.add("data", loading.seconds or 0.0)
        self._agree_before_training("after loading the training data")
        seeded = RNGState().state_dict()
        state = build_training_state(self.config, data, device)
        manager = self._make_manager()
        self._manager = manager
        try:
            with self.startup.part("restore"):
                resumed = manager.resume(state)
        except RestoreDivergedError as exc:
            # Every checkpoint failed (each is marked corrupt), the last after it was read
            # into the live tensors: the initial state again, built from the same generators
            # as the first time, as if there had been no checkpoint.
            self.reporter.event("restore_diverged", {"error": str(exc)[:600]}, level="warning")
            RNGState().load_state_dict(seeded)
            state = build_training_state(self.config, data, device)
            resumed = None
        self.step, self.last_checkpoint = state.step, resumed
        if resumed is not None and state.step >= cfg.max_steps:
            # An attempt like any other (self-owned: begun now, with the restore it did), so
            # stdout, Pipes and the ledger all say the same: it restored the final checkpoint
            # and trained nothing.
            with self.startup.part("ledger"):
                self.attempt.begin(
                    cfg,
                    snapshot_id=data.snapshot_id,
                    data_manifest_sha256=data.manifest_sha256,
                    resumed_from=str(resumed.path),
                )
                # Where it ran, as for any attempt: the receipt's placement must not say one
                # rank for an attempt launched on several that found nothing to train.
                self._record_world(manager)
            return Outcome(
                TerminationReason.SUCCEEDED,
                exit_codes.SUCCEEDED,
                f"The final checkpoint (step {state.step}) was already committed at "
                f"{resumed.path}; nothing left to train.",
                step=state.step,
                nothing_trained=True,
            )
        self._agree_before_training(
            "after restoring the newest checkpoint" if resumed else "after finding none to restore"
        )
        with self.startup.part("ledger"):
            self.attempt.begin(
                cfg,
                snapshot_id=data.snapshot_id,
                data_manifest_sha256=data.manifest_sha256,
                resumed_from=str(resumed.path) if resumed else None,
            )
        manager.bind_attempt(self.attempt.attempt_no, self.attempt.fencing_token)  # type: ignore[arg-type]
        # Rank 0 began the attempt; the others learnt its number from it.
        self.attempt.attempt_no = manager.attempt_no
        # Holding the token now: a commit an older attempt made just before is not missed.
        with self.startup.part("restore"):
            reconciled = manager.reconcile_with_ledger(state, resumed)
        # A self-owned begin leaves restored_step empty without a path; a fresh start is a
        # restore of step 0 that did happen, so it is recorded now, as the orchestrated one is.
        fresh_self_owned = self.attempt.owns_attempt and resumed is None
        with self.startup.part("ledger"):
            if (reconciled != resumed or fresh_self_owned) and self.attempt.ledger is not None:
                self.attempt.ledger.set_resumed_from(
                    self.attempt.run_id,
                    self.attempt.attempt_no,  # type: ignore[arg-type]
                    str(reconciled.path) if reconciled else None,
                )
            resumed = reconciled
            self.step, self.last_checkpoint = state.step, resumed
            self._record_world(manager)
        # The restored history (cumulative over the lineage) protects its clean checkpoint too.
        health = _health_of(state)
        manager.protect_through(health.clean_through() if health else None)
        self._record_health(health)
        if world.distributed:
            # Built after the restore: it checks that every rank holds the same model and
            # gives every rank rank 0's weights.
            self._averager = GradientAverager(state.model, world)
        self.reporter.event(
            "attempt_started",
            {
                "run_id": self.attempt.run_id,
                "attempt_no": self.attempt.attempt_no,
                "step": state.step,
                "max_steps": cfg.max_steps,
                "resumed_from": str(resumed.path) if resumed else None,
                "config_sha256": state.config_sha256,
                "snapshot_id": data.snapshot_id,
                "config": state.config,
            },
        )
        with self.startup.part("ledger"):
            self.attempt.heartbeat(state.step, force=True)
        self._tracker = self._start_tracking(state, data)
        outcome: Outcome | None = None
        try:
            try:
                outcome = self._loop(state, manager, data)
            except CollectiveError as exc:
                if not self.stop.requested:
                    raise
                outcome = self._stopped_without_peer(exc)
            return outcome
        finally:
            self._settle(manager)
            if self._tracker is not None:
                reason = str(outcome.reason) if outcome else "failed"
                self._tracker.finished(
                    self.attempt.attempt_no or 0,
                    reason,
                    final=outcome is not None and outcome.reason == TerminationReason.SUCCEEDED,
                )

    def _make_manager(self) -> CheckpointManager:
        cfg = self.config
        policy = CheckpointConfig(
            interval_steps=cfg.checkpoint_every_steps,
            keep_last_k=cfg.keep_last_k,
            keep_best_k=cfg.keep_best_k,
            best_metric=cfg.best_metric,
            best_mode=cfg.best_mode,  # type: ignore[arg-type]
        )
        if self.groups is None:
            return CheckpointManager(
                self.attempt.run_dir,
                policy,
                run_id=self.attempt.run_id,
                ledger=self.attempt.ledger,
                on_event=self._checkpoint_event,
                on_commit=self._checkpoint_committed,
            )
        from pipeline.checkpoint.sharded import ShardedCheckpointManager

        return ShardedCheckpointManager(
            self.attempt.run_dir,
            policy,
            run_id=self.attempt.run_id,
            world=self.world,
            groups=self.groups,
            ledger=self.attempt.ledger,
            on_event=self._checkpoint_event,
            on_commit=self._checkpoint_committed,
        )

    def _record_world(self, manager: CheckpointManager) -> None:
        """The world this attempt ran as, and whether its restore resharded, on the receipt."""
        # The checkpoint resumed from says how many ranks wrote it (resume and reconcile set it).
        written_by = manager.last_committed.world_size if manager.last_committed else None
        resharded_from = written_by if written_by not in (None, self.world.world_size) else None
        fields: dict[str, Any] = {**self.world.placement(), "resharded_from": resharded_from}
        # The drill hooks this trainer runs with: an orchestrator's environment may lack them.
        fields["fault_hooks"] = fault_hooks()
        if resharded_from is not None:
            self.reporter.event(
                "resharded",
                {
                    "path": self.last_checkpoint_path,
                    "written_by_world_size": resharded_from,
                    "world_size": self.world.world_size,
                },
                level="warning",
            )
        ledger, number = self.attempt.ledger, self.attempt.attempt_no
        if ledger is not None and number is not None:
            try:
                ledger.merge_placement(self.attempt.run_id, number, fields)
            except Exception as exc:  # a receipt detail; never worth failing the attempt over
                self.reporter.event("ledger_unreachable", {"error": str(exc)[:500]}, "warning")

    def _start_tracking(self, state: TrainingState, data: TrainingData) -> TrainingTracker | None:
        """The attempt's MLflow tracker, or None. Off the first step's path: the tracker imports
        MLflow (seconds) and finds its run on a thread of its own, and queues the steps trained
        meanwhile, so the first step waits for neither and MLflow still gets every step."""
        uri = envvars.TRACKS_MLFLOW_URI.get()
        if not uri or not self.world.leader:
            return None  # a standalone trainer without MLflow: the ledger is the record
        return TrainingTracker.start(
            lambda message: self.reporter.event("tracking_off", {"detail": message}, "warning"),
            tracking_uri=uri,
            artifact_root=envvars.TRACKS_MLFLOW_ARTIFACTS.raw(),  # as written: MLflow's location
            run_id=self.attempt.run_id,
            attempt_no=self.attempt.attempt_no or 0,
            config=state.config,
            run_dir=self.attempt.run_dir,
            restored_step=state.step,
            tags={
                "restored_step": str(state.step),
                "snapshot_id": data.snapshot_id,
                "dagster_run_id": os.environ.get("DAGSTER_RUN_ID", ""),
            },
        )

    def _loop(
        self, state: TrainingState, manager: CheckpointManager, data: TrainingData
    ) -> Outcome:
        """The steps, timed per phase and watched for a hang; every rank's timing at the end."""
        self._hang_fault = HangFault.from_env(self.world.world_size)
        self._timer = StepTimer()
        self._watchdog = Watchdog(self.config.watchdog, self._timer, self._end_hung)
        try:
            outcome = self._steps(state, manager, data)
        except BaseException:
            # The training thread woke up (a collective broke when a hung peer left) after its
            # watchdog fired: that thread tells the story and ends the process, not this one.
            self._watchdog.check_in()
            raise
        finally:
            self._watchdog.stop()
        if self.world.distributed and self.groups is not None:
            # Every rank left the loop at the same step with nothing in flight: each one's
            # timing reaches rank 0, which writes the receipt.
            self._settle(manager)
            self._step_timings = _gather_step_timings(self.groups, self._timer.summary())
        return outcome

    def _end_hung(self, stall: Stall) -> None:
        """The watchdog fired (its thread): the receipt, then exit 81 (never returns)."""
        world = self.world
        devices = world.world_size if world.distributed else torch.cuda.device_count()
        end_hung_attempt(
            stall,
            HangContext(
                attempt=self.attempt,
                world=world,
                reporter=self.reporter,
                timer=self._timer,
                config=self.config.watchdog,
                # The manager's: a background commit the stuck training thread never heard of.
                last_checkpoint=lambda: (
                    str(self._manager.last_committed.path)
                    if self._manager is not None and self._manager.last_committed is not None
                    else self.last_checkpoint_path
                ),
                started=self.started,
                gpu_devices=devices if self.on_gpu else 0,
                defer_end=bool(world.distributed and launched_here() and self.attempt.owns_attempt),
                clocks=self._hung_clocks,
            ),
        )

    def _hung_clocks(self) -> dict[str, Any]:
        """What ``run_training`` would have written of the clocks, had the attempt ended there."""
        now, looped = time.monotonic(), self.loop_started
        clocks: dict[str, Any] = {}
        if looped is not None:
            clocks["setup_seconds"] = round(looped - self.started, 3)
            clocks["training_seconds"] = round(now - looped, 3)
        if split := self.startup.split(looped):
            clocks["startup"] = split
        return clocks

    def step_timings(self) -> dict[str, Any]:
        """The receipt's ``timings.steps``: each rank's median and p99 per phase, by rank."""
        if self._step_timings:
            return self._step_timings
        summary = self._timer.summary() if self._timer is not None else {}
        return {str(self.world.rank): summary} if summary else {}

    def _steps(
        self, state: TrainingState, manager: CheckpointManager, data: TrainingData
    ) -> Outcome:
        cfg = self.config
        timer, watchdog = self._timer, self._watchdog
        assert timer is not None and watchdog is not None
        first_step = state.step
        _fault_oom_above_batch(cfg.batch_size)
        window_start, window_steps = time.monotonic(), 0
        self.loop_started = window_start
        while state.step < cfg.max_steps:
            timer.begin(state.step + 1)
            health = _health_of(state)
            loss = train_step(
                state,
                data,
                world=self.world,
                averager=self._averager,
                health=health,
                timer=timer,
                fault=self._hang_fault,
            )
            state.step += 1
            self.step = state.step
            self.startup.stepped()  # the first step ends the start-up (timings.startup)
            window_steps += 1
            with watchdog.suspended():  # a commit the background writer made reaches the ledger
                manager.poll()  # a background save that failed stops the attempt here
            if not math.isfinite(loss):
                self._settle(manager)
                return self._diverged(loss, state.step)
            spike = health.take_pending() if health is not None else None
            if spike is not None:
                stopped = self._act_on_spike(spike, state, manager)
                if stopped is not None:
                    return stopped
                if state.step < spike.step:
                    continue  # rolled back: the steps since that checkpoint are trained again
            if state.step % cfg.log_every_steps == 0 or state.step == cfg.max_steps:
                now = time.monotonic()
                window_rate = round(
                    window_steps * cfg.batch_size / max(now - window_start, 1e-9), 1
                )
                self.reporter.step(
                    {
                        "run_id": self.attempt.run_id,
                        "attempt_no": self.attempt.attempt_no,
                        "step": state.step,
                        "max_steps": cfg.max_steps,
                        "loss": loss,
                        "lr": state.optimizer.param_groups[0]["lr"],
                        "epoch": state.data_cursor.epoch,  # type: ignore[attr-defined]
                        "examples_per_second": window_rate,
                        # This rank's seconds per phase, means over the steps since the last
                        # message: data, compute, collective, health, save_stall, total.
                        "timing": timer.window_means(),
                    }
                )
                window_start, window_steps = now, 0
                if self._tracker is not None:
                    self._tracker.step(
                        state.step,
                        {
                            "loss": loss,
                            "lr": state.optimizer.param_groups[0]["lr"],
                            "examples_per_second": window_rate,
                        },
                    )
            # The ledger retries for up to a minute while its server restarts: not a hang.
            with watchdog.suspended():
                self.attempt.heartbeat(state.step)
            # A drill's pause is no stall: it is neither counted against the watchdog (the
            # clock restarts after it) nor in the step's time.
            with watchdog.suspended(), timer.paused():
                _fault_sleep_after_step(state.step, self.stop, self.attempt)
            timed_out = (
                cfg.max_wall_seconds is not None
                and time.monotonic() - self.started >= cfg.max_wall_seconds
            )
            # The flag is read once per step, and only that reading (distributed: what the
            # ranks agreed from theirs) decides this step; a signal landing later, inside the
            # agreement or the save, is acted on at the next step, by every rank alike.
            requested = self.stop.requested
            if self.world.distributed:
                # Every rank saves and stops at the same step: a signal or the clock may
                # reach the ranks at different moments.
                with timer.phase("collective", "agreeing when to stop"):
                    requested, timed_out = _agree_to_stop(
                        requested, timed_out, self.world, step=state.step
                    )
                if requested and not self.stop.requested:
                    self.stop.from_peer = True
            last = state.step >= cfg.max_steps
            stopping = last or requested or timed_out
            if manager.should_save(state.step) or stopping:
                # The final and the preemption checkpoint are committed before we go on.
                self._stop_save_step = state.step if requested else None
                # A save is progress: it has its own limits (the checkpoint group's timeout,
                # the grace period), so the watchdog waits it out; its time is the save stall.
                with timer.phase("save", "saving a checkpoint"), watchdog.suspended():
                    self._save(state, manager, data, loss, wait=stopping or not cfg.async_save)
                self._stop_save_step = None
            timer.end()
            watchdog.arm()  # from the first finished step: start-up and restore are not steps
            watchdog.check_in()
            if last:
                break
            if requested:
                return Outcome(
                    TerminationReason.PREEMPTED,
                    exit_codes.PREEMPTED,
                    f"Stopped on {self.stop.cause} after step {state.step} of "
                    f"{cfg.max_steps} and committed a checkpoint at step {state.step}.",
                    step=state.step,
                    signal=self.stop.signal_name,
                )
            if timed_out:
                return Outcome(
                    TerminationReason.TIMEOUT,
                    exit_codes.TIMEOUT,
                    f"Reached max_wall_seconds={cfg.max_wall_seconds} at step {state.step} of "
                    f"{cfg.max_steps} and committed a checkpoint at step {state.step}.",
                    step=state.step,
                )
        return Outcome(
            TerminationReason.SUCCEEDED,
            exit_codes.SUCCEEDED,
            f"Trained steps {first_step + 1}-{state.step} of {cfg.max_steps} and committed the "
            f"final checkpoint {self.last_checkpoint_path}.",
            step=state.step,
        )

    def _save(
        self,
        state: TrainingState,
        manager: CheckpointManager,
        data: TrainingData,
        loss: float,
        *,
        wait: bool,
    ) -> None:
        metrics = {"train_loss": loss, **evaluate(state.model, data)}
        if wait:
            manager.save(state, metrics=metrics)
        else:
            manager.save_async(state, metrics=metrics)

    def _checkpoint_committed(self, info: CheckpointInfo) -> None:
        # Called on the training thread, also for saves the background writer committed.
        self.last_checkpoint = info
        if not self.world.leader:
            return
        fields: dict[str, Any] = {
            "run_id": info.run_id,
            "attempt_no": info.attempt_no,
            "step": info.step,
            "path": str(info.path),
            "manifest_sha256": info.manifest_sha256,
            "bytes": info.size_bytes,
            "metrics": info.metrics,
        }
        stall = self._manager.last_stall if self._manager is not None else None
        if stall is not None and stall.step == info.step:
            # What this (async) save cost the training loop: capture + wait in optimizer.step.
            fields["stall_seconds"] = round(stall.total, 4)
        self.reporter.checkpoint_committed(fields)
        if self._tracker is not None:
            self._tracker.committed(info.step, info.metrics)
        self.attempt.heartbeat(self.step or info.step, force=True)

    def _settle(self, manager: CheckpointManager) -> None:
        """Let a save in flight finish before the attempt ends, whatever ended it."""
        try:
            manager.wait()
        except Exception as exc:  # the reason the attempt is ending is already decided
            self.reporter.event(
                "checkpoint_failed", {"error": f"{type(exc).__name__}: {exc}"}, level="warning"
            )

    def _checkpoint_event(self, name: str, fields: dict[str, Any]) -> None:
        warn = ("checkpoint_corrupt", "retention_failed", "checkpoint_abandoned")
        level = "warning" if name in warn else "info"
        self.reporter.event(name, fields, level=level)

    def _agree_before_training(self, when: str) -> None:
        """Distributed start-up: if any rank was asked to stop by now, every rank stops here."""
        if not self.world.distributed:
            return
        requested, _ = _agree_to_stop(self.stop.requested, False, self.world, step=None)
        if requested:
            self.stop.from_peer = self.stop.from_peer or not self.stop.requested
            raise StoppedBeforeTraining(self.world.rank, when)

    def _stopped_before_training(
        self, exc: StoppedBeforeTraining | JoinAbandoned | CollectiveError
    ) -> Outcome:
        if isinstance(exc, StoppedBeforeTraining):
            when = exc.when
        elif isinstance(exc, JoinAbandoned):
            when = "while waiting for the other ranks to join"
        else:
            when = f"when a peer rank was gone ({exc.what} failed)"
        restored = (
            f"; the checkpoint it restored (step {self.last_checkpoint.step}) stands"
            if self.last_checkpoint is not None
            else ""
        )
        return Outcome(
            TerminationReason.PREEMPTED,
            exit_codes.PREEMPTED,
            f"Stopped on {self.stop.cause} during start-up, {when}: this attempt trained no "
            f"step and saved nothing{restored}.",
            step=self.step,
            signal=self.stop.signal_name,
        )

    def _stopped_without_peer(self, exc: CollectiveError) -> Outcome:
        """A stop during training that the ranks could not finish together: a peer is gone.

        Still a preemption (the signal is why the attempt ended); the sentence says what the
        peer's death cost, from the run directory: which checkpoint is committed.
        """
        newest = checkpoint_dirs(self.attempt.run_dir)[:1]
        parsed = parse_checkpoint_dir_name(newest[0].name) if newest else None
        saving = self._stop_save_step
        if saving is None:
            during = ""
        elif parsed == (saving, self.attempt.attempt_no):
            during = f", after the preemption checkpoint at step {saving} was committed"
        else:
            during = f", so the preemption checkpoint at step {saving} was not committed"
        stands = (
            f"The newest committed checkpoint is step {parsed[0]} ({newest[0].name})."
            if parsed
            else "No checkpoint of the run is committed."
        )
        return Outcome(
            TerminationReason.PREEMPTED,
            exit_codes.PREEMPTED,
            f"Stopped on {self.stop.cause} after step {self.step} of {self.config.max_steps}, "
            f"but a peer rank died or became unreachable while {exc.what}{during}. {stands}",
            step=self.step,
            signal=self.stop.signal_name,
            exception=exc,
        )

    def _diverged(self, loss: float, step: int, *, spike: HealthEvent | None = None) -> Outcome:
        where = (
            f"the last committed checkpoint is step {self.last_checkpoint.step}"
            if self.last_checkpoint
            else "no checkpoint was committed"
        )
        what = f"Loss became {loss} at step {step}"
        if spike is not None:
            why = spike.why or "spikes.action is stop"
            what = f"Loss spike: {spike_words(spike.to_json())}; {why}"
        return Outcome(
            TerminationReason.DIVERGED,
            exit_codes.DIVERGED,
            f"{what}; stopped without saving, {where}.",
            step=step,
        )

    def _act_on_spike(
        self, spike: Spike, state: TrainingState, manager: CheckpointManager
    ) -> Outcome | None:
        """Do what ``spike`` calls for (train_step already left its update out); an outcome
        when the attempt stops. Every rank takes the same branch: the verdict was reached
        from the global loss and the averaged gradients' norm."""
        from contextlib import nullcontext

        health = _health_of(state)
        assert health is not None
        number, cfg = self.attempt.attempt_no, self.config.spikes
        if spike.action == "stop":
            event = health.record(spike, attempt_no=number)
            self._spike_seen(event, health)
            self._settle(manager)
            return self._diverged(spike.judgement.value, spike.step, spike=event)
        skipped = (spike.batch, spike.batch)
        why = None
        if spike.action == "rollback":
            first = max(1, spike.batch - cfg.skip_batches_before)
            last = spike.batch + cfg.skip_batches_after
            # No checkpoint after the step before the first skipped batch: its cursor has dealt
            # none of them (batch numbers never fall behind steps), so skipping them is real.
            bound = spike.step - 1 - cfg.skip_batches_before
            # A restore is progress, not a hang: the watchdog waits it out.
            suspended = self._watchdog.suspended() if self._watchdog else nullcontext()
            try:
                with suspended, health.history_kept():
                    target = manager.rollback(state, at_most_step=bound) if bound > 0 else None
            except RestoreDivergedError as exc:
                event = health.record(
                    spike,
                    attempt_no=number,
                    action="stop",
                    why=f"the rollback found no checkpoint that restores ({exc})",
                )
                self._spike_seen(event, health)
                return self._diverged(spike.judgement.value, spike.step, spike=event)
            if target is not None:
                state.data_cursor.skip_batches(first, last)  # type: ignore[attr-defined]
                event = health.record(
                    spike,
                    attempt_no=number,
                    skipped_batches=(first, last),
                    rolled_back_to={"step": target.step, "path": str(target.path)},
                )
                if self.world.leader:
                    manager.retire_newer_than(
                        target,
                        f"rolled back past it to step {target.step} after a loss spike at "
                        f"step {spike.step} (batches {first}-{last} skipped)",
                    )
                self.step, self.last_checkpoint = state.step, target
                self._spike_seen(event, health)
                manager.protect_through(health.clean_through())
                return None
            why = (
                f"no committed checkpoint at or before step {max(bound, 0)} to roll back to: "
                "the update was skipped instead"
            )
        event = health.record(
            spike, attempt_no=number, action="skip", skipped_batches=skipped, why=why
        )
        self._spike_seen(event, health)
        manager.protect_through(health.clean_through())
        return None

    def _spike_seen(self, event: HealthEvent, health: TrainingHealth) -> None:
        """Tell it now: a warning event (Pipes or stdout) and the attempt's health record."""
        self.reporter.event(
            "spike",
            {
                "run_id": self.attempt.run_id,
                "attempt_no": self.attempt.attempt_no,
                **event.to_json(),
                "spikes": health.spikes,
                "max_spikes": self.config.spikes.max_spikes,
            },
            level="warning",
        )
        self._record_health(health)

    def _record_health(self, health: TrainingHealth | None) -> None:
        """The attempt's ``health`` in the ledger: the settings and the history so far (the
        restored checkpoint's included), rewritten whole at each event."""
        ledger, number = self.attempt.ledger, self.attempt.attempt_no
        if health is None or ledger is None or number is None or not self.world.leader:
            return
        try:
            ledger.set_attempt_health(self.attempt.run_id, number, health.provenance())
        except Exception as exc:  # a receipt detail; never worth failing the attempt over
            self.reporter.event("ledger_unreachable", {"error": str(exc)[:500]}, "warning")


def build_training_state(
    cfg: TrainConfig, data: TrainingData, device: torch.device
) -> TrainingState:
    """A fresh run's state: the model, optimizer, schedule, data cursor and spike detector
    ``cfg`` describes, on ``device``, over ``data``."""
    model = family(cfg.model_family).build_model(cfg.to_dict()["model"]).to(device)
    optimizer, scheduler = build_optimizer(cfg, model)
    try:
        sampler = EpochSampler(data.num_train_examples, cfg.batch_size, cfg.seed)
    except ValueError as exc:
        raise ConfigError("config", "batch_size", str(exc)) from exc
    return TrainingState(
        model=model,
        optimizer=optimizer,
        data_cursor=sampler,
        config=cfg.to_dict(),
        config_sha256=cfg.sha256(),
        probe_inputs=data.eval_inputs[: cfg.probe_size],
        lr_scheduler=scheduler,
        data_manifest_sha256=data.manifest_sha256,
        snapshot_id=data.snapshot_id,
        health=TrainingHealth(cfg.spikes),
    )


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and LR scheduler (None for a constant rate) that ``cfg`` describes."""
    if cfg.optimizer == "adam":
        optimizer: torch.optim.Optimizer = optimizers.Adam(
            model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )
    else:
        optimizer = optimizers.SGD(
            model.parameters(),
            lr=cfg.learning_rate,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
    schedule = cfg.lr_schedule
    scheduler: Any = None
    if schedule.warmup_steps:
        # One LambdaLR for warm-up and schedule together: its state is one step count, like
        # the schedulers below, so a checkpoint restores it the same way.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_lr_factor, cfg))
    elif schedule.kind == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=cfg.max_steps, eta_min=schedule.min_lr
        )
    elif schedule.kind == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=schedule.step_size, gamma=schedule.gamma
        )
    return optimizer, scheduler


def _lr_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate's factor after ``step`` updates: linear warm-up times the schedule's
    closed form (the same values CosineAnnealingLR and StepLR step through)."""
    schedule = cfg.lr_schedule
    warm = min(1.0, (step + 1) / schedule.warmup_steps) if schedule.warmup_steps else 1.0
    if schedule.kind == "cosine":
        floor = schedule.min_lr / cfg.learning_rate
        return warm * (floor + (1 - floor) * (1 + math.cos(math.pi * step / cfg.max_steps)) / 2)
    if schedule.kind == "step":
        return warm * schedule.gamma ** (step // schedule.step_size)
    return warm


def train_step(
    state: TrainingState,
    data: TrainingData,
    *,
    world: World | None = None,
    averager: GradientAverager | None = None,
    health: TrainingHealth | None = None,
    timer: StepTimer | None = None,
    fault: HangFault | None = None,
) -> float:
    """One optimizer step on the next batch of the data cursor; returns the (global) loss.

    Distributed: every rank draws the same global batch from the cursor (so the cursor, and
    the data position a checkpoint records, do not depend on the world size) and trains on
    its own slice; ``averager`` averages the gradients (its all-reduces start during backward,
    bucket by bucket, and are waited for after it), and the loss is averaged too.

    The gradients live in a flat buffer (``state.gradients``, bound at the first step;
    pipeline/trainer/gradients.py): zeroed there, accumulated into by backward. With
    ``health``, the step is judged after backward and before the update (global loss and
    gradient norm, verdict, then ``optimizer.step``): a spike's update is left out, and the
    verdict is left in ``health.pending`` for the loop.

    ``timer`` is told each phase as the step enters it (data, compute, collective); ``fault``
    is the drill's hang hook (``TRACKS_FAULT_HANG_AT_STEP``).
    """
    step, world_ = state.step + 1, world or World()
    _now_in(timer, "data", "loading the batch")
    if fault is not None:
        fault.hang_if_due(step, world_, "data")
    cursor = state.data_cursor
    indices = cursor.next_indices()  # type: ignore[attr-defined]
    if world is not None and world.distributed:
        indices = indices[world.rank :: world.world_size]
    row = family(data.family)
    inputs, targets = data.train_inputs[indices], data.train_targets[indices]
    if _fault_spike_due(cursor.dealt):  # type: ignore[attr-defined]
        inputs, targets = row.corrupt(inputs, targets)
    _now_in(timer, "compute", _COMPUTE_WORDS[world_.distributed])
    gradients = state.gradients = GradientBuffer.of(state.optimizer, state.gradients)
    gradients.zero()
    if averager is not None:
        averager.prepare(gradients)
    try:
        loss = row.loss(state.model(inputs), targets)
        loss.backward()  # distributed: the buckets' all-reduces start from here
    except RuntimeError as exc:
        if world is not None and world.distributed and _is_collective_failure(exc):
            raise CollectiveError("averaging the gradients", world.rank, exc) from exc
        raise
    gradients.check_bound()
    if averager is not None:
        _now_in(timer, "collective", "averaging the gradients")
        averager.finish()
    if world is not None and world.distributed:
        _now_in(timer, "collective", "averaging the loss")
        value = _global_mean(loss.detach(), world)
        if fault is not None:
            fault.hang_if_due(step, world, "collective")
        _now_in(timer, "compute", "judging the step and the optimizer's update")
    else:
        value = float(loss.item())
    spike = None
    if health is not None and health.config.enabled:
        began = timer.clock() if timer is not None else 0.0
        # Every rank holds the same averaged gradients, so the same norm: with the global
        # loss, every rank reaches the same verdict without another collective.
        norm = gradients.norm()
        # Two comparisons clear the usual step (spikes.py's bounds); the rest is judged exactly.
        if not health.detector.clean(value, norm):
            spike = health.judge(
                step=state.step + 1,
                batch=cursor.dealt,  # type: ignore[attr-defined]
                loss=value,
                grad_norm=norm,
            )
        health.pending = spike
        if timer is not None:
            timer.carve("health", began)  # not a switch: see StepTimer.carve
    if spike is None:
        state.optimizer.step()
    # A skipped update is still a step: the schedule follows the step count, as max_steps does.
    if state.lr_scheduler is not None:
        state.lr_scheduler.step()
    _now_in(timer, BETWEEN, "between the parts of the step")
    return value


# The compute phase in words, alone and among ranks (whose gradients' all-reduces start inside
# backward, overlapped with it; the wait for them after it is the "collective" phase).
_COMPUTE_WORDS = {
    False: "forward, backward and the optimizer's update",
    True: "forward and backward, which starts the gradients' all-reduces",
}


def _now_in(timer: StepTimer | None, phase: str, what: str) -> None:
    if timer is not None:
        timer.switch(phase, what)


def _health_of(state: TrainingState) -> TrainingHealth | None:
    return state.health if isinstance(state.health, TrainingHealth) else None


def _is_collective_failure(exc: RuntimeError) -> bool:
    """Whether a collective failed (a peer rank gone), not the model's own code.

    A bucket's all-reduce starts inside backward: a broken gloo transport comes out of backward
    as a plain RuntimeError, which only its origin, named in the message, tells apart from an
    error in the model.
    """
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or "gloo/transport" in text or "NCCL" in text


def _global_mean(loss: torch.Tensor, world: World) -> float:
    import torch.distributed as dist

    total = loss.to("cpu", torch.float64).reshape(1)
    try:
        dist.all_reduce(total)
    except Exception as exc:
        raise CollectiveError("averaging the loss", world.rank, exc) from exc
    return float(total.item()) / world.world_size


def _gather_step_timings(groups: Groups, summary: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's step-timing summary, by rank (on every rank), over the checkpoint group.

    None when a peer did not answer: the receipt then carries this rank's own, and the loop's
    outcome stands (it was decided before).
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * groups.world.world_size
    try:
        dist.all_gather_object(gathered, summary, group=groups.checkpoint)
    except Exception:
        return None
    return {str(rank): said for rank, said in enumerate(gathered) if said}


def _agree_to_stop(
    requested: bool, timed_out: bool, world: World, *, step: int | None
) -> tuple[bool, bool]:
    """Whether any rank asked to stop, or ran out of time (at ``step``; None: start-up)."""
    import torch.distributed as dist

    flags = torch.tensor([float(requested), float(timed_out)])
    if step is not None:
        _fault_sleep_before_agreement(step, world.rank)
    try:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    except Exception as exc:
        raise CollectiveError("agreeing when to stop", world.rank, exc) from exc
    return bool(flags[0].item()), bool(flags[1].item())


def evaluate(model: torch.nn.Module, data: TrainingData) -> dict[str, float]:
    """The family's held-out metrics, eval_loss first (eval mode, no grad, no RNG: the
    trajectory is untouched)."""
    return family(data.family).evaluate(model, data.eval_inputs, data.eval_targets)


def classify_exception(exc: BaseException, *, step: int | None) -> Outcome:
    """One termination reason and exit code for an exception that ended the attempt."""
    from pipeline.data.errors import DataError
    from pipeline.ledger import LedgerError, StaleFencingTokenError

    reason, code = TerminationReason.USER_CODE_ERROR, exit_codes.USER_CODE_ERROR
    if isinstance(exc, StaleFencingTokenError):
        reason, code = TerminationReason.FENCED, exit_codes.FENCED
    elif isinstance(exc, ConfigError | CheckpointMismatchError | LedgerError):
        reason, code = TerminationReason.USER_CODE_ERROR, exit_codes.CONFIG_ERROR
    elif isinstance(exc, DataError):
        reason = exc.termination_reason
        code = {
            TerminationReason.BAD_INPUT: exit_codes.BAD_INPUT,
            TerminationReason.INFRA_TRANSIENT: exit_codes.INFRA_TRANSIENT,
        }.get(reason, exit_codes.USER_CODE_ERROR)
    elif isinstance(exc, BadInputError):
        reason, code = TerminationReason.BAD_INPUT, exit_codes.BAD_INPUT
    elif isinstance(exc, torch.OutOfMemoryError):
        reason, code = TerminationReason.OOM, exit_codes.OOM
    elif isinstance(exc, CollectiveError | PeerRankError):
        # A peer rank died or failed: this rank is collateral; the launcher names the first.
        reason, code = TerminationReason.INFRA_TRANSIENT, exit_codes.INFRA_TRANSIENT
    elif isinstance(exc, OSError) or _is_database_error(exc):
        reason, code = TerminationReason.INFRA_TRANSIENT, exit_codes.INFRA_TRANSIENT
    where = f" at step {step}" if step is not None else " before the first step"
    message = redact.one_line(str(exc))[:600]
    return Outcome(
        reason, code, f"{type(exc).__name__}{where}: {message}", step=step, exception=exc
    )


def _is_database_error(exc: BaseException) -> bool:
    try:
        from sqlalchemy.exc import DBAPIError
    except ImportError:
        return False
    return isinstance(exc, DBAPIError)


def _open_ledger(url: str | None, *, orchestrated: bool) -> Any:
    if not url:
        return None
    from pipeline.ledger import Ledger

    # The orchestrator migrated the schema before it began the attempt.
    return Ledger(url) if orchestrated else Ledger.open(url)


def _resumes_large_files(run_dir: Path) -> bool:
    """Whether the newest committed checkpoint has a file read around the page cache.

    Only a hint for warming the read buffers: resume verifies everything itself.
    """
    newest = checkpoint_dirs(run_dir)[:1]
    if not newest:
        return False
    try:
        return any(
            entry.is_file(follow_symlinks=False) and entry.stat().st_size >= DIRECT_MIN_BYTES
            for entry in os.scandir(newest[0])
        )
    except OSError:
        return False


def make_deterministic(cfg: TrainConfig) -> torch.device:
    """Seed every generator from ``cfg.seed``, make kernels deterministic, use one thread;
    the device to train on (ConfigError: cuda asked for, none visible)."""
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("config", "device", "is cuda but no CUDA device is visible")
        # Needed by deterministic cuBLAS; must be set before the first CUDA call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    use_deterministic_kernels()
    # One thread: float reductions then add in one order, in every process.
    torch.set_num_threads(1)
    return torch.device(cfg.device)


def _fault_oom_above_batch(batch_size: int) -> None:
    limit = envvars.TRACKS_FAULT_OOM_ABOVE_BATCH.get()
    if limit is not None and batch_size > limit:
        raise torch.OutOfMemoryError(
            f"injected by {FAULT_OOM_ABOVE_BATCH}={limit}: batch {batch_size} does not fit"
        )


@functools.cache
def _spike_batches(spec: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in spec.split(",") if part.strip())
    except ValueError as exc:
        raise ConfigError(
            FAULT_SPIKE_BATCHES, None, f"{spec!r} is not a comma-separated list of batch numbers"
        ) from exc


def _fault_spike_due(batch: int) -> bool:
    """Whether the drill corrupts batch number ``batch``; the family says how (a new tensor:
    the snapshot's stay clean for every other step that draws them)."""
    spec = envvars.TRACKS_FAULT_SPIKE_BATCHES.get()
    return bool(spec) and batch in _spike_batches(spec)


def _fault_sleep_before_agreement(step: int, rank: int) -> None:
    spec = envvars.TRACKS_FAULT_SLEEP_BEFORE_AGREEMENT.get()
    if not spec:
        return
    seconds, at_step, at_rank = [*spec.split("@"), "", ""][:3]
    if (at_step and int(at_step) != step) or (at_rank and int(at_rank) != rank):
        return
    time.sleep(float(seconds))  # not cut short by a stop: a signal is meant to land in it


def _fault_sleep_after_step(step: int, stop: StopRequest, attempt: Any) -> None:
    spec = envvars.TRACKS_FAULT_SLEEP_AFTER_STEP.get()
    if not spec:
        return
    seconds, _, at_step = spec.partition("@")
    if at_step and int(at_step) != step:
        return
    # The ledger learns where the pause holds the trainer: a drill signals it there.
    attempt.heartbeat(step, force=True)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not stop.requested:
        time.sleep(0.02)
