"""Loss spikes: a detector over the loss and the gradient norm, and the run's health record.

The detector keeps a rolling window of each judged metric (``spikes.window`` recent steps) and
calls a step a spike when its value lies more than ``spikes.zscore`` standard deviations above
the window's mean, or more than ``spikes.ratio`` times the mean (OLMo-core's SkipStepOptimizer
judges z > 6 over 128 steps; llm-foundry's KillLossSpike a loss >= 2x the mean of 100). Only
upward spikes count: a loss that falls faster than usual is good news. A non-finite gradient
norm is always a spike. A spike's values never enter the window, so one bad batch does not
widen the band the next one is judged by.

The window's sum and sum of squares are kept exactly, as integers (a finite float is an
integer times a power of two), and updated as a value joins and the oldest leaves: judging a
step costs the same whatever the window's size, and the mean and standard deviation are each
one correctly rounded division, so they depend on the window's values alone, never on the
order they came in. The same history gives the same verdict bit for bit, in every process and
on every rank (each rank judges the global loss and the gradient norm DDP already
synchronised). The windows are part of the checkpointed trainer state, so a resumed attempt
judges exactly as the uninterrupted one would have.

Judging runs after every backward, where the CPU's caches are cold and each Python line costs
several times its warm figure, so a clean step is judged by two comparisons (:class:`Bounds`):
every :data:`FOLD_STEPS` steps (32) the detector works out, for each metric, a value below which no
window the next steps can reach calls a spike, whatever values join it meanwhile (a bound
proved below, not a guess); a step below both bounds is clean, and its values wait in a list
until the next fold appends them. Any other step (near a bound, non-finite, or the list full)
folds first and is judged exactly. The verdicts are the exact rule's, step for step: the bounds
only decide when the exact rule need not run.

:class:`TrainingHealth` is what a checkpoint carries: the detector, its settings, and every
event so far (each spike: where, how far out, what was done, which batches were skipped, which
checkpoint it rolled back to). Its history is cumulative over the run's lineage: a resumed
attempt starts from the restored checkpoint's history; a rollback restores the detector's
window but never the history, which says what happened.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Any

from pipeline.trainer.config import SpikeConfig

SPIKE = "spike"
# Steps a fold's bounds serve before the next fold: more is less Python per step and looser
# bounds (at a window of 128 and z 6: 5.2 standard deviations above the mean for 32 steps).
FOLD_STEPS = 32
# What the bounds keep below the exact threshold, as a share of its scale (|mean| + z x std):
# far more than the float rounding of the exact rule's mean, deviation and z-score (about
# 1e-15 of it), so a value the rounding could tip over the threshold is judged exactly.
_SLACK = 1e-9
_LARGEST = sys.float_info.max


def json_number(value: float) -> float | str:
    """``value`` as JSON holds it: a finite float as it is, inf and nan as their names."""
    return value if math.isfinite(value) else repr(value)


@dataclass(frozen=True)
class Judgement:
    """One metric's value against its window: why a step is (or is not) a spike."""

    metric: str
    value: float
    mean: float
    std: float
    history: int  # values in the window
    zscore: float | None  # None where z-scores are not judged
    ratio: float | None  # None where ratios are not judged

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "value": json_number(self.value),
            "mean": json_number(self.mean),
            "std": json_number(self.std),
            "history": self.history,
            "zscore": None if self.zscore is None else json_number(self.zscore),
            "ratio": None if self.ratio is None else json_number(self.ratio),
        }


class _Window:
    """One metric's recent values, with their sum and sum of squares kept exactly.

    In fixed point: each value is ``numerator / 2**shift`` (``float.as_integer_ratio``), so
    scaled by ``2**scale``, the largest shift seen, every value is an integer. The scale only
    grows (and the sums are shifted with it); the figures derived from the sums are the same
    whatever it is. Values of one metric share their magnitude, so the integers stay near 64
    bits and the sums near 128.
    """

    __slots__ = ("_ratios", "_scale", "_squares", "_sum", "values")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self._ratios: deque[tuple[int, int]] = deque()  # (numerator, shift) of each value
        self._scale = 0
        self._sum = 0
        self._squares = 0

    def append(self, value: float) -> None:
        self.extend((value,))

    def extend(self, new: Iterable[float]) -> None:
        """Append each value in turn (the sums in locals meanwhile: a fold appends many)."""
        values, ratios, size = self.values, self._ratios, self.values.maxlen
        total, squares, scale = self._sum, self._squares, self._scale
        for value in new:
            if len(values) == size:
                numerator, shift = ratios.popleft()
                oldest = numerator << (scale - shift)
                total -= oldest
                squares -= oldest * oldest
            numerator, denominator = value.as_integer_ratio()  # denominator: a power of two
            shift = denominator.bit_length() - 1
            if shift > scale:
                grow, scale = shift - scale, shift
                total <<= grow
                squares <<= 2 * grow
            scaled = numerator << (scale - shift)
            values.append(value)
            ratios.append((numerator, shift))
            total += scaled
            squares += scaled * scaled
        self._sum, self._squares, self._scale = total, squares, scale

    def mean_std(self) -> tuple[float, float]:
        """The mean and the sample standard deviation (0.0 below two values), each from one
        correctly rounded division of exact integers."""
        return self._figures(len(self.values), self._sum, self._squares)

    def newest_mean_std(self, skip: int) -> tuple[float, float]:
        """:meth:`mean_std` of the values after the oldest ``skip``."""
        total, squares = self._sum, self._squares
        for numerator, shift in islice(self._ratios, skip):
            scaled = numerator << (self._scale - shift)
            total -= scaled
            squares -= scaled * scaled
        return self._figures(len(self.values) - skip, total, squares)

    def _figures(self, n: int, total: int, squares: int) -> tuple[float, float]:
        if n <= 0:
            return 0.0, 0.0
        mean = total / (n << self._scale)
        if n == 1:
            return mean, 0.0
        # n(n-1) * variance * 2**(2 scale) = n * sum(a*a) - sum(a)**2, exactly.
        try:
            variance = (n * squares - total * total) / ((n * (n - 1)) << (2 * self._scale))
        except OverflowError:  # values beyond 1e154: a spread no float holds
            variance = math.inf
        return mean, math.sqrt(variance)


@dataclass(frozen=True)
class Bounds:
    """What the next ``steps`` judgements of one metric need: any value in ``low..high`` is
    clean by the exact rule, whatever clean values join the window meanwhile."""

    low: float
    high: float
    steps: int

    @classmethod
    def of(cls, window: _Window, config: SpikeConfig, steps: int) -> Bounds:
        """The bounds for the next ``steps`` judgements against ``window`` (``steps`` 0, or a
        ``high`` of -inf: the exact rule judges every value).

        The k-th of them (k < steps) judges a window that holds the newest ``kept`` of today's
        values (F: ``n`` today, the oldest ``evicted`` perhaps gone) and ``free`` others, of
        any value: ``reach`` values at most. By the z-score, a value is clean up to the
        window's mean m plus z standard deviations s. With F's mean m_F and deviation s_F,
        d = m_F - m, and the free values' sum fixed by m, (reach - 1) s**2 >= (kept - 1)
        s_F**2 + kept*reach/free * d**2; the least m + z s over d is then m_F + s_F *
        sqrt((kept-1)/(reach-1)) * sqrt(z**2 - 1/b), b = kept*reach / (free*(reach-1)), which
        only falls as the window grows, so the largest reach bounds them all. By the ratio, a
        value is clean up to ``ratio`` times the mean, which the free values may pull down:
        the values that join here are at least ``low`` (0), the old ones at least their least.
        """
        n = len(window.values)
        if steps <= 0:
            return cls(-_LARGEST, -math.inf, 0)
        if n < config.min_history:  # not judged yet but for being finite
            return cls(-_LARGEST, _LARGEST, min(steps, config.min_history - n))
        size = window.values.maxlen or n
        steps = min(steps, max(size // 2, 1))  # half a window at most: F keeps the other half
        reach = min(size, n + steps - 1)
        evicted = n + steps - 1 - reach
        kept = n - evicted
        free = reach - kept
        mean, std = window.newest_mean_std(evicted)
        low, high = -_LARGEST, _LARGEST
        if config.zscore is not None:
            z = config.zscore
            spread = z * z - (free * (reach - 1) / (kept * reach) if free else 0.0)
            if spread <= 0:  # z too small to bound: the free values may set the threshold
                return cls(low, -math.inf, 0)
            floor = mean + std * math.sqrt((kept - 1) / (reach - 1)) * math.sqrt(spread)
            high = floor - _SLACK * (abs(mean) + z * std)
        if config.ratio is not None:
            low = 0.0
            least = min(0.0, *islice(window.values, evicted)) if evicted else 0.0
            # The mean of kept values at m_F and the rest at ``least``, for n' from n to reach.
            lowest_mean = min(least + kept * (mean - least) / count for count in (n, reach))
            ceiling = config.ratio * lowest_mean * (1 - _SLACK) if lowest_mean > 0 else 0.0
            high = min(high, ceiling)
        if not math.isfinite(high):  # a spread no float holds: judged exactly
            return cls(low, -math.inf, 0)
        return cls(low, high, steps)


class SpikeDetector:
    """Rolling windows of the judged metrics; :meth:`judge` is the whole decision.

    :meth:`clean` is its fast half: two comparisons against the bounds of the last fold
    (:class:`Bounds`), and the values wait in ``_pending`` until the next :meth:`fold`.
    ``fold_steps`` 0 judges every step exactly.
    """

    def __init__(self, config: SpikeConfig, *, fold_steps: int = FOLD_STEPS) -> None:
        self.config = config
        self._fold_steps = fold_steps
        self._windows: dict[str, _Window] = {
            name: _Window(config.window) for name in config.metric_names
        }
        self._pending: list[tuple[float, float]] = []  # (loss, grad_norm), judged clean
        self._room = 0  # steps the bounds below serve, from the last fold
        # Unjudged metrics pass any value (NaN aside, which takes the exact path).
        self._loss = self._norm = (-math.inf, math.inf)
        self.fold()

    def clean(self, loss: float, grad_norm: float) -> bool:
        """True where the bounds show the step clean: its values join the windows at the next
        fold. False: judge it with :meth:`judge`."""
        pending = self._pending
        if (
            len(pending) < self._room
            and self._loss[0] <= loss <= self._loss[1]
            and self._norm[0] <= grad_norm <= self._norm[1]
        ):
            pending.append((loss, grad_norm))
            return True
        return False

    def fold(self) -> None:
        """Append the values :meth:`clean` let through, and work out the next bounds."""
        self._append_pending()
        self._bound()

    def judge(self, values: Mapping[str, float]) -> Judgement | None:
        """The first judged metric (in ``spikes.metrics`` order) that spikes, or None.

        A clean step's values join the windows; a spike's do not.
        """
        self._append_pending()
        judgement = None
        for name, window in self._windows.items():
            judgement = self._judge(name, window, float(values[name]))
            if judgement is not None:
                break
        else:
            for name, window in self._windows.items():
                window.append(float(values[name]))
        self._bound()
        return judgement

    def _append_pending(self) -> None:
        pending, windows = self._pending, self._windows
        if pending:
            for column, name in enumerate(("loss", "grad_norm")):
                if name in windows:
                    windows[name].extend(float(row[column]) for row in pending)
            pending.clear()

    def _bound(self) -> None:
        """The bounds for the next steps, from the windows as they are (nothing pending)."""
        room = self._fold_steps
        for name, window in self._windows.items():
            bounds = Bounds.of(window, self.config, room)
            room = min(room, bounds.steps)
            if name == "loss":
                self._loss = (bounds.low, bounds.high)
            else:
                self._norm = (bounds.low, bounds.high)
        self._room = room

    def _judge(self, name: str, window: _Window, value: float) -> Judgement | None:
        """``value``'s judgement where it is a spike; None where it is not."""
        cfg = self.config
        n = len(window.values)
        if not math.isfinite(value):
            mean, std = window.mean_std()
            return Judgement(name, value, mean, std, n, math.inf, math.inf)
        if n < cfg.min_history:
            return None
        mean, std = window.mean_std()
        zscore = ratio = None
        if cfg.zscore is not None:
            # A flat window (std 0): any rise at all is infinitely many deviations out.
            zscore = (value - mean) / std if std > 0 else (math.inf if value > mean else 0.0)
        if cfg.ratio is not None:
            ratio = value / mean if mean > 0 else (math.inf if value > 0 else 0.0)
        spiked = (zscore is not None and cfg.zscore is not None and zscore > cfg.zscore) or (
            ratio is not None and cfg.ratio is not None and ratio > cfg.ratio
        )
        return Judgement(name, value, mean, std, n, zscore, ratio) if spiked else None

    def state_dict(self) -> dict[str, Any]:
        self.fold()
        return {name: list(window.values) for name, window in self._windows.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != set(self._windows):
            raise ValueError(
                f"spike detector windows {sorted(state)} in the checkpoint, "
                f"{sorted(self._windows)} configured"
            )
        for name, values in state.items():
            if not isinstance(values, list) or not all(
                isinstance(v, int | float) and math.isfinite(v) for v in values
            ):
                raise ValueError(f"spike detector window {name!r} is not a list of numbers")
            window = _Window(self.config.window)
            window.extend(float(value) for value in values)
            self._windows[name] = window
        self._pending.clear()
        self.fold()


@dataclass(frozen=True)
class Spike:
    """A step the detector judged a spike, and the action it calls for."""

    step: int
    batch: int  # the data cursor's number of the batch that step trained on (1-based)
    judgement: Judgement
    values: Mapping[str, float]
    action: str  # skip | rollback | stop
    number: int  # the run's spike count with this one
    why: str | None = None  # set where the action is not the configured one


@dataclass(frozen=True)
class HealthEvent:
    """One entry of the health timeline, as checkpoints, the ledger and explain carry it."""

    kind: str
    step: int
    attempt_no: int | None
    batch: int
    metric: str
    value: float | str
    mean: float | str
    zscore: float | str | None
    ratio: float | str | None
    values: dict[str, float | str]
    action: str
    # [first, last] batch numbers never trained on: the spiking batch for a skip, the range a
    # rollback dealt past; None for a stop.
    skipped_batches: list[int] | None = None
    rolled_back_to: dict[str, Any] | None = None  # {"step": …, "path": …}
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> HealthEvent:
        try:
            return cls(**dict(raw))
        except TypeError as exc:
            raise ValueError(f"health event {dict(raw)!r} does not load: {exc}") from exc


@dataclass
class TrainingHealth:
    """The detector, its settings and the event history: one part of the trainer state."""

    config: SpikeConfig
    detector: SpikeDetector = field(init=False)
    events: list[HealthEvent] = field(default_factory=list)
    # The verdict on the step just trained, left by train_step for the loop to act on.
    pending: Spike | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.detector = SpikeDetector(self.config)

    def take_pending(self) -> Spike | None:
        """The spike the last step was judged to be (None: clean), once."""
        spike, self.pending = self.pending, None
        return spike

    @property
    def spikes(self) -> int:
        return sum(1 for e in self.events if e.kind == SPIKE)

    def judge(self, *, step: int, batch: int, loss: float, grad_norm: float) -> Spike | None:
        """Judge one step (before its update is applied) by the exact rule; a :class:`Spike`
        or None. The trainer asks ``detector.clean`` first and comes here only when the bounds
        do not clear the step (train_step), so the fast path is tried once.

        The action is the configured one, except that the ``max_spikes``-th spike of the run
        stops it whatever the action.
        """
        if not self.config.enabled:
            return None
        values = {"loss": loss, "grad_norm": grad_norm}
        judgement = self.detector.judge(values)
        if judgement is None:
            return None
        number = self.spikes + 1
        action, why = self.config.action, None
        limit = self.config.max_spikes
        if limit is not None and number >= limit and action != "stop":
            action, why = "stop", f"spike {number} of the run reached spikes.max_spikes={limit}"
        return Spike(step, batch, judgement, values, action, number, why)

    def record(
        self,
        spike: Spike,
        *,
        attempt_no: int | None,
        action: str | None = None,
        skipped_batches: tuple[int, int] | None = None,
        rolled_back_to: Mapping[str, Any] | None = None,
        why: str | None = None,
    ) -> HealthEvent:
        """Append what was done about ``spike`` (``action``, ``why``: where it differs from
        the spike's own, e.g. a rollback that found no checkpoint to go back to)."""
        j = spike.judgement
        event = HealthEvent(
            kind=SPIKE,
            step=spike.step,
            attempt_no=attempt_no,
            batch=spike.batch,
            metric=j.metric,
            value=json_number(j.value),
            mean=json_number(j.mean),
            zscore=None if j.zscore is None else json_number(j.zscore),
            ratio=None if j.ratio is None else json_number(j.ratio),
            values={k: json_number(v) for k, v in spike.values.items()},
            action=action or spike.action,
            skipped_batches=list(skipped_batches) if skipped_batches else None,
            rolled_back_to=dict(rolled_back_to) if rolled_back_to else None,
            why=why or spike.why,
        )
        self.events.append(event)
        return event

    def clean_through(self) -> int | None:
        """The last step known clean before the most recent spike (None: no spike yet).

        Retention keeps the newest committed checkpoint at or before it: the one a rollback of
        that spike went (or would go) back to, which later checkpoints cannot push out.
        """
        spikes = [e for e in self.events if e.kind == SPIKE]
        if not spikes:
            return None
        last = spikes[-1]
        before = self.config.skip_batches_before if last.action == "rollback" else 0
        return max(0, last.step - 1 - before)

    @contextmanager
    def history_kept(self) -> Iterator[None]:
        """Restore a checkpoint inside: the detector's window goes back with it, the event
        history does not (it is what happened, the rollback included)."""
        history = list(self.events)
        try:
            yield
        finally:
            self.events = history

    def settings(self) -> dict[str, Any]:
        return asdict(self.config)

    def provenance(self) -> dict[str, Any]:
        """What a reader needs: the settings, every event and the totals (no window)."""
        return health_summary({"settings": self.settings(), "events": self._events_json()})

    def _events_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.events]

    def state_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings(),
            "window": self.detector.state_dict(),
            "events": self._events_json(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.detector.load_state_dict(state["window"])
        self.events = [HealthEvent.from_json(e) for e in state["events"]]


def health_summary(health: Mapping[str, Any]) -> dict[str, Any]:
    """``{"settings", "events"}`` (a checkpoint's or an attempt's) with the totals a gate or
    a reader asks for first: spikes, skipped updates, rollbacks, stops, skipped batch ranges."""
    events = [e for e in health.get("events") or [] if isinstance(e, Mapping)]
    spikes = [e for e in events if e.get("kind") == SPIKE]

    def count(action: str) -> int:
        return sum(1 for e in spikes if e.get("action") == action)

    return {
        "settings": dict(health.get("settings") or {}),
        "events": [dict(e) for e in events],
        "spikes": len(spikes),
        "skipped_updates": count("skip"),
        "rollbacks": count("rollback"),
        "stops": count("stop"),
        "skipped_batches": [list(e["skipped_batches"]) for e in spikes if e.get("skipped_batches")],
    }


def _number_words(value: Any, digits: int = 4) -> str:
    return f"{value:.{digits}g}" if isinstance(value, int | float) else str(value)


def spike_words(event: Mapping[str, Any]) -> str:
    """One event's measurement in words: ``loss 41.7 at step 61 (z 38.2, 4.1x the mean 0.214
    of 128 steps)``."""
    how = []
    if event.get("zscore") is not None:
        how.append(f"z {_number_words(event['zscore'], 3)}")
    if event.get("ratio") is not None:
        how.append(f"{_number_words(event['ratio'], 3)}x")
    how.append(f"mean {_number_words(event.get('mean'))}")
    return (
        f"{event.get('metric')} {_number_words(event.get('value'))} at step {event.get('step')} "
        f"(batch {event.get('batch')}; {', '.join(how)})"
    )
