"""The hang watchdog: a rank alive but stuck ends its attempt ``hung``, with its stacks.

Every rank runs one :class:`Watchdog` thread, armed once the attempt's first step has finished
(start-up and restore are not steps; the join and the checkpoint group have their own
timeouts). It reads the rank's :class:`~pipeline.trainer.timing.StepTimer` and fires when no
step has finished for longer than max(``multiple`` x p99 of this attempt's recent step times,
``floor_seconds``). Saves, ledger heartbeats and a drill's deliberate pause suspend it: they are
the trainer working (or waiting by design), bounded by their own timeouts, not a hang.

When it fires, the training thread is blocked (often in C: a collective, a read), so it cannot
raise; the watchdog thread ends the process itself (:func:`end_hung_attempt`):

1. every thread's stack to ``attempt-<n>[.rank-<r>].stacks.txt`` (``faulthandler``), and the top
   frames of the training thread, the step and the phase it was in, into the last words;
2. distributed, it waits a little for the other ranks' watchdogs (a rank waiting on a stuck peer
   fires too) and tells, from their records, which rank the others waited for: the one furthest
   behind in the step (:func:`hang_story`);
3. the receipt: last words, the step timing on the ledger (rank 0), the attempt's end when the
   trainer owns it, the rank's outcome for the launcher, then ``os._exit(81)``.

The fault hook ``TRACKS_FAULT_HANG_AT_STEP`` (:class:`HangFault`) makes one rank hang on purpose.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pipeline import envvars
from pipeline.states import TerminationReason
from pipeline.trainer import exit_codes
from pipeline.trainer.attempt import Outcome, stacks_path, write_last_words
from pipeline.trainer.timing import BETWEEN, StepTimer

if TYPE_CHECKING:
    from pipeline.distributed import World
    from pipeline.trainer.attempt import AttemptHandle
    from pipeline.trainer.config import WatchdogConfig
    from pipeline.trainer.reporting import Reporter

# How many of the training thread's innermost frames the receipt names.
TOP_FRAMES = 6
# A fired rank waits at most this long for its peers' records before telling the story alone.
PEER_WAIT_SECONDS = 10.0
# What the ledger and the reporter may take before the process ends without them: a trainer
# cut off from its ledger must still die (the last words on disk carry the story).
RECEIPT_SECONDS = 15.0
REPORT_SECONDS = 2.0
_PHASE_WORDS = {
    "data": "data loading",
    "compute": "compute",
    "collective": "a collective",
    "save": "a checkpoint save",
    BETWEEN: "the loop",
}
_REPO = Path(__file__).resolve().parents[2]
_TIMES = "\u00d7"  # the multiplication sign, written so no reader mistakes it for an x


@dataclass(frozen=True)
class HangRecord:
    """What one rank's watchdog saw when it fired: the rank's own share of the hang story."""

    rank: int
    world_size: int
    step: int  # the step it was in (one past the last it finished)
    phase: str
    what: str
    mark: int  # phases entered in the step: equal steps, lower mark = further behind
    stalled_seconds: float
    threshold_seconds: float
    multiple: float
    floor_seconds: float
    p99_step_seconds: float | None
    steps_timed: int
    last_progress_at: float  # time.time() of the last finished step (or the end of a save)
    fired_at: float
    top_frames: tuple[str, ...] = ()
    stacks_file: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "top_frames": list(self.top_frames)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HangRecord:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["top_frames"] = tuple(known.get("top_frames") or ())
        return cls(**known)

    @property
    def where(self) -> str:
        """``data loading (loading the batch) at step 57``."""
        return f"{_PHASE_WORDS.get(self.phase, self.phase)} ({self.what}) at step {self.step}"

    @property
    def threshold_words(self) -> str:
        p99 = "no step timed" if self.p99_step_seconds is None else f"{self.p99_step_seconds:.3g} s"
        learnt = f"{self.multiple:g} {_TIMES} p99 {p99}"
        return (
            f"threshold max({learnt}, floor {self.floor_seconds:g} s) = "
            f"{self.threshold_seconds:.3g} s"
        )


@dataclass(frozen=True)
class HangStory:
    """Which ranks the others waited for, and the one sentence the receipt carries."""

    stuck: tuple[int, ...]
    waiting: tuple[int, ...]
    silent: tuple[int, ...]  # ranks that left no record in time
    sentence: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "stuck": list(self.stuck),
            "waiting": list(self.waiting),
            "silent": list(self.silent),
            "sentence": self.sentence,
        }


def _ranks_words(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    return f"Ranks {', '.join(str(r) for r in ranks[:-1])} and {ranks[-1]}"


def hang_story(
    records: list[HangRecord], world_size: int, ended: dict[int, str] | None = None
) -> HangStory:
    """The hang told from every rank's record: the rank furthest behind in the step is stuck.

    Ranks run the same phases in the same order, and a rank waits in a collective only for a
    peer that has not reached it: the one at the earliest (step, phase) is what the others wait
    for. Ranks level with each other are all named; when every rank waits at the same place in
    a collective, none is behind, and the sentence says the collective itself is the suspect.
    ``ended``: ranks that ended otherwise before their watchdog fired (rank: their reason).
    """
    records = sorted(records, key=lambda r: r.rank)
    ended = ended or {}
    behind = min((r.step, r.mark) for r in records)
    stuck = [r for r in records if (r.step, r.mark) == behind]
    waiting = [r for r in records if (r.step, r.mark) != behind]
    first = stuck[0]
    stacks = ", ".join(
        f"{r.stacks_file} (rank {r.rank})" if world_size > 1 else str(r.stacks_file)
        for r in records
        if r.stacks_file
    )
    frames = " ← ".join(first.top_frames[:5]) or "none recorded"
    together = len(stuck) == len(records) > 1
    if together and first.phase == "collective":
        head = (
            f"{_ranks_words([r.rank for r in stuck])} all waited in {first.where} for "
            f"{first.stalled_seconds:.1f} s ({first.threshold_words}): none was behind another, "
            "so the collective itself, or the network under it, is what hung"
        )
    else:
        verb = "all hung" if len(stuck) > 1 else "hung"
        head = (
            f"{_ranks_words([r.rank for r in stuck])} {verb} in {first.where} for "
            f"{first.stalled_seconds:.1f} s ({first.threshold_words})"
        )
    said = [f"{head}; top frames{'' if len(stuck) == 1 else f' of rank {first.rank}'}: {frames}."]
    for place in sorted({(r.step, r.mark) for r in waiting}):
        here = [r for r in waiting if (r.step, r.mark) == place]
        said.append(
            f"{_ranks_words([r.rank for r in here])} waited for it in {here[0].where} "
            f"({here[0].stalled_seconds:.1f} s without a finished step)."
        )
    for rank, reason in sorted(ended.items()):
        said.append(f"Rank {rank} ended {reason} before its watchdog fired.")
    heard = {r.rank for r in records} | set(ended)
    silent = [rank for rank in range(world_size) if rank not in heard]
    if silent:
        said.append(f"{_ranks_words(silent)} left no hang record in time.")
    if stacks:
        said.append(f"Every thread's stack: {stacks}.")
    return HangStory(
        stuck=tuple(r.rank for r in stuck),
        waiting=tuple(r.rank for r in waiting),
        silent=tuple(silent),
        sentence=" ".join(said),
    )


@dataclass(frozen=True)
class Stall:
    """The watchdog's observation: where the rank stood, and for how long it had not moved."""

    position: dict[str, Any]
    stalled_seconds: float
    threshold_seconds: float
    p99_step_seconds: float | None
    steps_timed: int
    last_progress_at: float
    fired_at: float


class Watchdog:
    """One rank's watchdog thread over its step timer; :meth:`arm` after the first step.

    ``on_hang`` runs on the watchdog's thread and ends the process; the training thread, should
    it move again meanwhile, stops at its next :meth:`check_in` and waits for that end.
    """

    def __init__(
        self,
        config: WatchdogConfig,
        timer: StepTimer,
        on_hang: Callable[[Stall], None],
        *,
        poll_seconds: float | None = None,
    ) -> None:
        self.config = config
        self._timer = timer
        self._on_hang = on_hang
        # Fine enough that the hang is seen within a tenth of the floor past its threshold.
        self._poll = poll_seconds or min(0.25, config.floor_seconds / 10)
        self._suspended = 0  # written by the training thread only
        self._resumed_at = 0.0
        self._fired = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._suspension = _Suspended(self)

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def arm(self) -> None:
        """Start watching (once; a disabled watchdog never starts)."""
        if not self.config.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="tracks-watchdog", daemon=True)
        self._thread.start()

    def threshold(self) -> tuple[float, float | None]:
        """(seconds without a finished step that make a hang, the p99 it was learnt from)."""
        p99 = self._timer.recent_p99()
        return max(self.config.multiple * (p99 or 0.0), self.config.floor_seconds), p99

    def suspended(self) -> _Suspended:
        """Work that is not a step and has limits of its own: a save, the ledger, a drill pause.

        Its time never counts as a stall: the clock restarts when it ends.
        """
        return self._suspension

    def check_in(self) -> None:
        """The training thread's touchpoint: once the watchdog fired, it waits for the end."""
        if self._fired.is_set():
            _wait_forever()

    def stop(self) -> None:
        """The loop ended: what follows (the final receipt) is not watched."""
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll):
            if self._suspended:
                continue
            since = max(self._timer.last_progress, self._resumed_at)
            stalled = time.monotonic() - since
            threshold, p99 = self.threshold()
            if stalled <= threshold or self._stopped.is_set():
                continue
            self._fired.set()
            position = self._timer.position
            stall = Stall(
                position=position.as_dict() if position else {},
                stalled_seconds=round(stalled, 3),
                threshold_seconds=round(threshold, 3),
                p99_step_seconds=None if p99 is None else round(p99, 6),
                steps_timed=self._timer.steps_timed,
                last_progress_at=time.time() - stalled,
                fired_at=time.time(),
            )
            try:
                self._on_hang(stall)
            except BaseException:
                traceback.print_exc()
            # on_hang ends the process; should it fail, the hang still ends it, exit 81.
            _exit(exit_codes.HUNG)


class _Suspended:
    """``with watchdog.suspended():`` a class, not a generator: it is entered at every step."""

    def __init__(self, watchdog: Watchdog) -> None:
        self._watchdog = watchdog

    def __enter__(self) -> None:
        self._watchdog._suspended += 1

    def __exit__(self, *_: object) -> None:
        watchdog = self._watchdog
        watchdog._resumed_at = time.monotonic()
        watchdog._suspended -= 1
        watchdog.check_in()


def _wait_forever() -> NoReturn:
    while True:
        threading.Event().wait()


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream: the process ends all the same.
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _bounded(what: Callable[[], None], seconds: float) -> None:
    """Run ``what`` on a helper thread for at most ``seconds``: the process ends regardless."""
    thread = threading.Thread(target=what, name="tracks-watchdog-receipt", daemon=True)
    thread.start()
    thread.join(seconds)


def top_frames(thread_id: int | None = None, count: int = TOP_FRAMES) -> tuple[str, ...]:
    """The innermost frames of a thread (default: the main thread), innermost first."""
    ident = thread_id if thread_id is not None else threading.main_thread().ident
    frame = sys._current_frames().get(ident or 0)
    if frame is None:
        return ()
    stack = traceback.extract_stack(frame)[-count:]
    return tuple(f"{f.name} ({_short_path(f.filename)}:{f.lineno})" for f in reversed(stack))


def _short_path(filename: str) -> str:
    path = Path(filename)
    parts = path.parts
    if "site-packages" in parts:  # an installed library, wherever its environment lives
        return "/".join(parts[parts.index("site-packages") + 1 :])
    if path.is_relative_to(_REPO):
        return str(path.relative_to(_REPO))
    return path.name


@dataclass(frozen=True)
class HangContext:
    """What ending a hung attempt needs from the trainer, read when the watchdog fires."""

    attempt: AttemptHandle
    world: World
    reporter: Reporter
    timer: StepTimer
    config: WatchdogConfig
    last_checkpoint: Callable[[], str | None]
    started: float  # time.monotonic() when the trainer process started its work
    gpu_devices: int  # accelerators this rank's receipt charges (0 on CPU)
    defer_end: bool  # distributed under the launcher: it closes a self-owned attempt
    # The trainer's other clocks (set-up, training loop, start-up split), as a normal end
    # would write them: the training thread that would have written them is stuck.
    clocks: Callable[[], dict[str, Any]] = dict


def end_hung_attempt(stall: Stall, ctx: HangContext) -> NoReturn:
    """Dump the stacks, tell the story, leave the receipt and end the process with exit 81."""
    attempt, world = ctx.attempt, ctx.world
    number = attempt.attempt_no or 0
    store, run_id = attempt.run_dir.parent, attempt.run_id
    stacks = stacks_path(store, run_id, number, rank=world.rank)
    frames = top_frames()
    _dump_stacks(stacks, world.rank, stall)
    position = stall.position
    record = HangRecord(
        rank=world.rank,
        world_size=world.world_size,
        step=int(position.get("step", 0)),
        phase=str(position.get("phase", BETWEEN)),
        what=str(position.get("what", "")),
        mark=int(position.get("mark", 0)),
        stalled_seconds=stall.stalled_seconds,
        threshold_seconds=stall.threshold_seconds,
        multiple=ctx.config.multiple,
        floor_seconds=ctx.config.floor_seconds,
        p99_step_seconds=stall.p99_step_seconds,
        steps_timed=stall.steps_timed,
        last_progress_at=round(stall.last_progress_at, 3),
        fired_at=round(stall.fired_at, 3),
        top_frames=frames,
        stacks_file=stacks.name,
    )
    steps = ctx.timer.summary()
    reached = record.step - 1 if record.step > 0 else None
    words = {"hang": record.as_dict(), "steps": steps}
    # Our own record first: a peer waiting for it must find it before we wait for theirs.
    story = hang_story([record], world.world_size)
    _words(ctx, store, number, _outcome(story, reached), {**words, "hang_story": story.as_dict()})
    peers: dict[int, dict[str, Any]] = {}
    if world.distributed:
        peers = _peer_words(store, run_id, number, world, ctx.config)
        records = [record] + [
            HangRecord.from_dict(w["hang"])
            for w in peers.values()
            if isinstance(w.get("hang"), dict)
        ]
        ended = {
            rank: str(w.get("reason"))
            for rank, w in peers.items()
            if not isinstance(w.get("hang"), dict)
        }
        story = hang_story(records, world.world_size, ended)
        outcome = _outcome(story, reached)
        _words(ctx, store, number, outcome, {**words, "hang_story": story.as_dict()})
    outcome = _outcome(story, reached)
    cpu_seconds = time.process_time()
    gpu_seconds = (time.monotonic() - ctx.started) * ctx.gpu_devices
    if world.leader and attempt.ledger is not None and attempt.attempt_no is not None:
        timings = {
            **_clocks(ctx),
            "steps": {
                str(world.rank): steps,
                **{
                    str(r): w["steps"] for r, w in peers.items() if isinstance(w.get("steps"), dict)
                },
            },
            "watchdog": {**record.as_dict(), "story": story.as_dict()},
            "trainer_process_seconds": round(time.monotonic() - ctx.started, 3),
        }
        _bounded(lambda: _ledger_receipt(ctx, outcome, timings, cpu_seconds, gpu_seconds),
                 RECEIPT_SECONDS)  # fmt: skip
    if world.distributed:
        _rank_outcome(ctx, record, story, reached, cpu_seconds, gpu_seconds)
    _bounded(lambda: _report(ctx, outcome, record, story), REPORT_SECONDS)
    _exit(exit_codes.HUNG)


def _clocks(ctx: HangContext) -> dict[str, Any]:
    try:
        return ctx.clocks()
    except Exception as exc:  # a receipt detail: the hang's own evidence matters more
        print(f"tracks watchdog: clocks unread: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {}


def _outcome(story: HangStory, reached: int | None) -> Outcome:
    return Outcome(TerminationReason.HUNG, exit_codes.HUNG, story.sentence, step=reached)


def _dump_stacks(path: Path, rank: int, stall: Stall) -> None:
    position = stall.position
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as out:
            out.write(
                f"Every thread of rank {rank} (pid {os.getpid()}) when its hang watchdog fired "
                f"at {datetime.now(UTC).isoformat()}: step {position.get('step')}, phase "
                f"{position.get('phase')} ({position.get('what')}), no step finished for "
                f"{stall.stalled_seconds:.1f} s (threshold {stall.threshold_seconds:.3g} s).\n\n"
            )
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
    except OSError as exc:  # the story still goes on: its words say the file is missing
        print(f"tracks watchdog: cannot write {path}: {exc}", file=sys.stderr)


def _words(
    ctx: HangContext, store: Path, number: int, outcome: Outcome, extra: dict[str, Any]
) -> None:
    from pipeline.trainer.attempt import last_words_path

    try:
        write_last_words(
            last_words_path(store, ctx.attempt.run_id, number, rank=ctx.world.rank),
            run_id=ctx.attempt.run_id,
            attempt_no=number,
            outcome=outcome,
            last_checkpoint=ctx.last_checkpoint(),
            extra=extra,
        )
    except OSError as exc:
        print(f"tracks watchdog: last words unwritten: {exc}", file=sys.stderr)


def _peer_words(
    store: Path, run_id: str, number: int, world: World, config: WatchdogConfig
) -> dict[int, dict[str, Any]]:
    """The other ranks' last words of this attempt, once all are there or the wait is up.

    Their watchdogs fire within a poll of ours (the same stall, the same floor); a peer that
    ended otherwise (its collective broke when a stuck rank left) counts as heard from.
    """
    from pipeline.reasons import read_last_words
    from pipeline.trainer.attempt import last_words_path

    deadline = time.monotonic() + min(max(config.floor_seconds / 2, 1.0), PEER_WAIT_SECONDS)
    found: dict[int, dict[str, Any]] = {}
    while True:
        for rank in range(world.world_size):
            if rank == world.rank or rank in found:
                continue
            said = read_last_words(last_words_path(store, run_id, number, rank=rank))
            if said and said.get("attempt_no") == number:
                found[rank] = said
        if len(found) == world.world_size - 1 or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _ledger_receipt(
    ctx: HangContext,
    outcome: Outcome,
    timings: dict[str, Any],
    cpu_seconds: float,
    gpu_seconds: float,
) -> None:
    attempt = ctx.attempt
    assert attempt.ledger is not None and attempt.attempt_no is not None
    try:
        if not ctx.defer_end:
            attempt.end(outcome, cpu_seconds=cpu_seconds, gpu_seconds=gpu_seconds)
        current = attempt.ledger.get_attempt(attempt.run_id, attempt.attempt_no).timings or {}
        # Merged: what others measured (start-up) stays; this rank's clocks add theirs.
        attempt.ledger.set_timings(attempt.run_id, attempt.attempt_no, {**current, **timings})
    except Exception as exc:  # the last words on disk still tell the story
        print(f"tracks watchdog: ledger unreachable: {type(exc).__name__}", file=sys.stderr)


def _rank_outcome(
    ctx: HangContext,
    record: HangRecord,
    story: HangStory,
    reached: int | None,
    cpu_seconds: float,
    gpu_seconds: float,
) -> None:
    from pipeline.distributed.launch import write_rank_outcome

    if record.rank in story.stuck or not story.stuck:
        said = f"rank {record.rank} hung in {record.where} for {record.stalled_seconds:.1f} s"
    else:
        said = (
            f"rank {record.rank} waited in {record.where} for {record.stalled_seconds:.1f} s, "
            f"for {_ranks_words(list(story.stuck)).lower()}, which hung"
        )
    try:
        write_rank_outcome(
            ctx.world.rank,
            exit_code=exit_codes.HUNG,
            reason=str(TerminationReason.HUNG),
            # Short: the launcher's summary quotes it beside the story the last words tell.
            detail=said,
            step=reached,
            attempt_no=ctx.attempt.attempt_no,
            deferred_end=ctx.defer_end,
            cpu_seconds=cpu_seconds,
            gpu_seconds=gpu_seconds,
        )
    except OSError as exc:
        print(f"tracks watchdog: outcome unwritten: {exc}", file=sys.stderr)


def _report(ctx: HangContext, outcome: Outcome, record: HangRecord, story: HangStory) -> None:
    try:
        ctx.reporter.event(
            "hung",
            {"hang": record.as_dict(), "story": story.as_dict(), "detail": outcome.detail},
            level="error",
        )
        ctx.reporter.event(
            "attempt_finished",
            {
                "run_id": ctx.attempt.run_id,
                "attempt_no": ctx.attempt.attempt_no,
                "reason": str(outcome.reason),
                "exit_code": outcome.exit_code,
                "detail": outcome.detail,
                "step": outcome.step,
                "last_checkpoint": ctx.last_checkpoint(),
            },
            level="warning",
        )
        ctx.reporter.close()
    except Exception as exc:  # a reader gone: the receipt is on disk and in the ledger
        print(f"tracks watchdog: not reported: {type(exc).__name__}: {exc}", file=sys.stderr)


@dataclass(frozen=True)
class HangFault:
    """``TRACKS_FAULT_HANG_AT_STEP=N[:rank=R][:in=data|collective]``: a hang on purpose.

    Rank ``R`` (default 0) stops for good in step ``N``: in its data loading (waiting on an
    event nobody sets), or, distributed, in a collective its peers never join (after the loss
    all-reduce every rank took, a receive from a peer that never sends). The process stays alive
    and its other threads run; only the watchdog ends it.
    """

    step: int
    rank: int = 0
    where: str = "data"

    @classmethod
    def from_env(cls, world_size: int) -> HangFault | None:
        """The hook as set, or None; a malformed one raises, naming the variable."""
        variable = envvars.TRACKS_FAULT_HANG_AT_STEP
        raw = variable.raw()
        if raw is None:
            return None
        head, *options = raw.split(":")
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("rank", "in") or key in fields:
                raise variable.error(
                    raw, f"has {option!r}; expected N[:rank=R][:in=data|collective]"
                )
            fields[key] = value
        try:
            fault = cls(int(head), int(fields.get("rank", "0")), fields.get("in", "data"))
        except ValueError:
            raise variable.error(raw, "expected N[:rank=R][:in=data|collective]") from None
        if fault.step < 1 or not 0 <= fault.rank < world_size:
            raise variable.error(raw, f"needs a step >= 1 and a rank below {world_size}")
        if fault.where not in ("data", "collective"):
            raise variable.error(raw, "in= must be data or collective")
        if fault.where == "collective" and world_size < 2:
            raise variable.error(raw, "a collective needs two ranks or more")
        return fault

    def hang_if_due(self, step: int, world: World, where: str) -> None:
        """Block for good when this is the chosen rank, step and place."""
        if (step, world.rank, where) != (self.step, self.rank, self.where):
            return
        print(
            f"{envvars.TRACKS_FAULT_HANG_AT_STEP.name}: rank {world.rank} hangs in {where} at "
            f"step {step}",
            file=sys.stderr,
            flush=True,
        )
        if where == "collective":
            _receive_what_never_comes(world)
        _wait_forever()


def _receive_what_never_comes(world: World) -> None:
    """A receive from a peer that never sends: blocked in the collective library, in C, until
    the training group's timeout (then it waits on, for good)."""
    import torch
    import torch.distributed as dist

    # Far above any collective's sequence number, which gloo also uses as its tag.
    tag = 1 << 30
    # The group's timeout, or the peer gone: still hung, by design.
    with contextlib.suppress(Exception):
        dist.recv(torch.zeros(1), src=(world.rank + 1) % world.world_size, tag=tag)
