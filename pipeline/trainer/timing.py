"""Where each step's time goes, per rank: data loading, compute, collectives, the spike
detector, the save's stall.

The training loop wraps each part of a step in :meth:`StepTimer.phase`; the timer keeps every
step's split (the newest :data:`KEPT_STEPS`), the means of the window since the last step
message, the median and p99 of the attempt for the receipt, and where the rank is right now
(:class:`Position`) for the hang watchdog, which reads it from its own thread.

The phases, in the order a step runs them:

- ``data``: drawing the batch from the data cursor and indexing the tensors;
- ``compute``: forward, backward and the optimizer step; among ranks, backward starts the
  gradients' all-reduces bucket by bucket, overlapped with it;
- ``collective``: the wait for the gradients' all-reduces after backward (what they did not
  overlap), the loss all-reduce and the ranks' agreement on when to stop;
- ``health``: the loss-spike detector's work, between backward and the update: the gradient
  norm and the verdict (none with ``spikes.enabled: false``); carved out of ``compute``
  (:meth:`StepTimer.carve`), so the position the watchdog reads stays in ``compute`` meanwhile;
- ``save``: the loop's time in a checkpoint save (a synchronous save whole, an async save's
  staging copy): reported as ``save_stall``.

``total`` is the step's wall time from its batch to the end of its save, minus a drill's
deliberate pause (:meth:`StepTimer.paused`); what it holds beyond the five parts is the loop's
bookkeeping (logging, the heartbeat).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

# The phases a position can name; "health" is carved out of compute (StepTimer.carve).
PHASES = ("data", "compute", "collective", "save")
# One step's record, in this order: each phase's seconds (save as save_stall) and the total.
FIELDS = ("data", "compute", "collective", "health", "save_stall", "total")
# The steps whose split is kept for the receipt's summary (6 floats each).
KEPT_STEPS = 100_000
# The recent steps whose time teaches the watchdog what a normal step takes.
RECENT_STEPS = 512
# Between two phases: logging, heartbeat, the loop's own decisions.
BETWEEN = "between"


class Position(NamedTuple):
    """Where a rank is in its training: read by the watchdog when the rank stops moving.

    ``mark`` counts the phases entered in this step (and the returns between them): every rank
    runs the same sequence of phases, so at the same step a lower mark is further behind. A
    tuple, not a dataclass: one is made at every phase of every step.
    """

    step: int  # the step being trained (one past the last finished one)
    phase: str  # one of PHASES, or BETWEEN
    what: str  # the phase in words: "loading the batch", "averaging the loss" …
    mark: int

    def as_dict(self) -> dict[str, Any]:
        return self._asdict()


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (sorted or not); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


class StepTimer:
    """One rank's step timing. Called from the training thread; read from the watchdog's.

    The watchdog reads ``position``, ``last_progress`` and the recent step times: single
    attribute reads and a ``tuple()`` of a deque, each atomic under the GIL, so no lock is
    taken on the training thread's path.
    """

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self._clock = clock
        self._steps: deque[tuple[float, ...]] = deque(maxlen=KEPT_STEPS)
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._window: list[tuple[float, ...]] = []
        self._parts = dict.fromkeys(FIELDS, 0.0)
        self._started: float | None = None
        self._phase = BETWEEN
        self._phase_began = 0.0
        self._paused = 0.0
        self.position: Position | None = None
        self.last_progress = time.monotonic()  # when the last step finished (the watchdog's)
        self.steps_timed = 0

    def begin(self, step: int) -> None:
        """Step ``step`` starts (its batch is next)."""
        self._parts = dict.fromkeys(FIELDS, 0.0)
        self._paused = 0.0
        self._started = self._phase_began = self._clock()
        self._phase = BETWEEN
        self.position = Position(step, BETWEEN, "starting the step", 0)

    def switch(self, name: str, what: str) -> None:
        """The step moves on to phase ``name`` (:data:`BETWEEN`: between the timed parts).

        One call between two parts of the step, so the loop's code keeps its shape.
        """
        now = self._clock()
        if self._phase != BETWEEN:
            self._parts["save_stall" if self._phase == "save" else self._phase] += (
                now - self._phase_began
            )
        self._phase, self._phase_began = name, now
        at = self.position
        if at is not None:
            self.position = Position(at.step, name, what, at.mark + 1)

    def clock(self) -> float:
        """This timer's clock, for :meth:`carve`."""
        return self._clock()

    def carve(self, name: str, began: float) -> None:
        """Count the time since ``began`` (read from :meth:`clock` inside the current phase) as
        phase ``name``'s instead of the current phase's, leaving the position as it is.

        For the spike detector's verdict, a few tens of microseconds after every backward:
        measured side by side, the two switches that put it in a phase of its own cost a third
        of what the whole detector costs (each makes a :class:`Position`, and right after
        backward every object touched is a cache miss); this is two clock reads and two additions.
        """
        seconds = self._clock() - began
        self._parts[name] += seconds
        self._phase_began += seconds

    @contextmanager
    def phase(self, name: str, what: str) -> Iterator[None]:
        """Time one part of the step and say, while it runs, that the rank is in it."""
        self.switch(name, what)
        try:
            yield
        finally:
            self.switch(BETWEEN, "between the parts of the step")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A drill's deliberate pause: not part of the step's time."""
        began = self._clock()
        try:
            yield
        finally:
            self._paused += self._clock() - began

    def end(self) -> None:
        """The step finished: record its split; this is the watchdog's sign of progress."""
        if self._started is None:
            return
        if self._phase != BETWEEN:
            self.switch(BETWEEN, "finishing the step")
        self._parts["total"] = max(self._clock() - self._started - self._paused, 0.0)
        record = tuple(self._parts[f] for f in FIELDS)
        self._steps.append(record)
        self._window.append(record)
        # The watchdog learns from steps without a save: a save is not what a step takes.
        self._recent.append(self._parts["total"] - self._parts["save_stall"])
        self.steps_timed += 1
        self._started = None
        self.last_progress = time.monotonic()

    def last_total(self) -> float | None:
        """The total seconds of the last finished step (None before the first)."""
        return self._steps[-1][-1] if self._steps else None

    def recent_p99(self) -> float | None:
        """p99 of the recent steps' time without their saves; None before the first step."""
        recent = list(tuple(self._recent))
        return percentile(recent, 0.99) if recent else None

    def window_means(self) -> dict[str, float]:
        """Each field's mean over the steps finished since the last call (the step message's)."""
        window, self._window = self._window, []
        if not window:
            return {}
        return {
            field: round(sum(step[i] for step in window) / len(window), 6)
            for i, field in enumerate(FIELDS)
        }

    def summary(self) -> dict[str, Any]:
        """The receipt's figures: ``steps`` timed, and each field's median and p99 (seconds)."""
        steps = list(tuple(self._steps))
        if not steps:
            return {}
        out: dict[str, Any] = {"steps": len(steps)}
        for i, field in enumerate(FIELDS):
            values = [step[i] for step in steps]
            out[field] = {
                "median": round(percentile(values, 0.5), 6),
                "p99": round(percentile(values, 0.99), 6),
            }
        return out
