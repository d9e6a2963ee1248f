"""How the trainer tells the world what it is doing: Dagster Pipes when launched by Dagster,
else one JSON line per event on stdout.

Both speak the same events: ``step`` (per logging interval) and ``checkpoint_committed`` are
the messages an orchestrator consumes; everything else is a log line. Under Pipes the trainer
never reports an asset materialization: the orchestrator does, from these messages.

Under Pipes each logging interval is also a line a person reads on the Dagster run page while
the trainer runs (:func:`progress_line`): Dagster's Pipes message readers hand every ``log``
message to ``context.log`` as they read it, from a thread, whereas custom messages are read
by the asset only after the trainer exits.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

from pipeline import envvars, redact

STEP = "step"
CHECKPOINT_COMMITTED = "checkpoint_committed"


class Reporter(Protocol):
    def step(self, fields: dict[str, Any]) -> None:
        """One logging interval: step, max_steps, loss, lr, examples_per_second, epoch."""

    def checkpoint_committed(self, fields: dict[str, Any]) -> None:
        """A checkpoint commit: path, step, manifest_sha256, attempt_no, metrics."""

    def event(self, name: str, fields: dict[str, Any], level: str = "info") -> None:
        """Anything else worth a line: attempt started, resumed, stopping, finished …"""

    def close(self) -> None: ...


class StdoutReporter:
    """``{"event": "step", ...}`` lines on stdout, flushed at once (a parent may be reading)."""

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream or sys.stdout
        self._broken = False

    def _emit(self, payload: dict[str, Any]) -> None:
        if self._broken:
            return
        try:
            self._stream.write(json.dumps(payload, default=str) + "\n")
            self._stream.flush()
        except (BrokenPipeError, ValueError):
            # Whoever read our stdout went away; training and checkpoints carry on without it.
            self._broken = True

    def step(self, fields: dict[str, Any]) -> None:
        self._emit({"event": STEP, **fields})

    def checkpoint_committed(self, fields: dict[str, Any]) -> None:
        self._emit({"event": CHECKPOINT_COMMITTED, **fields})

    def event(self, name: str, fields: dict[str, Any], level: str = "info") -> None:
        self._emit({"event": name, "level": level, **redacted(fields)})

    def close(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                self._broken = True


class PipesReporter:
    """Custom messages for steps and commits, ``context.log`` for the rest.

    Each step also logs :func:`progress_line` at INFO, at most once per ``min_interval``
    seconds (``TRACKS_PROGRESS_SECONDS``) besides the first and the final step: a fast trainer
    logging every few steps would otherwise write an event a few times a second into Dagster's
    event log for as long as it trains. Every step still goes out as a custom message.
    """

    def __init__(
        self,
        context: Any,
        *,
        min_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._context = context
        self._clock = clock
        self._progress = Progress(clock=clock)
        self._min_interval = min_interval
        self._last_line: float | None = None

    def step(self, fields: dict[str, Any]) -> None:
        eta = self._progress.observe(fields)
        now = self._clock()
        final = _final_step(fields)
        if self._last_line is None or final or now - self._last_line >= self._min_interval:
            self._last_line = now
            # The line goes before the custom message: on Kubernetes, dagster-k8s hands a pod
            # log line to Dagster only once the next line has arrived, so the line written
            # first is the one the run page shows at once.
            self._context.log.info(progress_line(fields, eta))
        self._context.report_custom_message({"event": STEP, **fields})

    def checkpoint_committed(self, fields: dict[str, Any]) -> None:
        # Log line first, for the same reason as in step().
        self._context.log.info(
            f"checkpoint committed at step {fields.get('step')}: {fields.get('path')}"
        )
        self._context.report_custom_message({"event": CHECKPOINT_COMMITTED, **fields})

    def event(self, name: str, fields: dict[str, Any], level: str = "info") -> None:
        log = getattr(self._context.log, level if level in ("warning", "error") else "info")
        log(f"{name}: {json.dumps(redacted(fields), default=str, sort_keys=True)}")

    def close(self) -> None:
        self._context.close()


class Progress:
    """Steps per second over the last few reports, by this process's own clock: the ETA.

    Measured between reports, never from the start of the process, so start-up, data loading
    and a restore do not count as training time; the first report of an attempt has no rate
    yet. The window is the last ``window`` reports, so a change of speed (another job on the
    node, a checkpoint save) shows within a few intervals.
    """

    def __init__(self, window: int = 8, clock: Callable[[], float] = time.monotonic) -> None:
        self._points: deque[tuple[float, int]] = deque(maxlen=window)
        self._clock = clock

    def observe(self, fields: Mapping[str, Any]) -> float | None:
        """Record this report; seconds left until ``max_steps`` at the recent rate, or None
        when there is no rate yet (the first report) or no ``max_steps`` to reach."""
        step = fields.get("step")
        if not isinstance(step, int):
            return None
        now = self._clock()
        if self._points and step <= self._points[-1][1]:
            self._points.clear()  # a step that went back is another count: start again
        self._points.append((now, step))
        max_steps = fields.get("max_steps")
        if not isinstance(max_steps, int):
            return None
        if step >= max_steps:
            return 0.0
        (first_time, first_step), (last_time, last_step) = self._points[0], self._points[-1]
        if last_step <= first_step or last_time <= first_time:
            return None
        rate = (last_step - first_step) / (last_time - first_time)
        return (max_steps - step) / rate


def progress_line(fields: Mapping[str, Any], eta_seconds: float | None) -> str:
    """One logging interval for a person: ``step 120/400 (30%) · loss 0.5312 · 812 ex/s ·
    ETA 0:00:41``. A field the report lacks is left out; no ETA yet reads ``ETA —``."""
    step, max_steps = fields.get("step"), fields.get("max_steps")
    parts = [f"step {step}"]
    if isinstance(step, int) and isinstance(max_steps, int) and max_steps > 0:
        parts = [f"step {step}/{max_steps} ({100 * step // max_steps}%)"]
    loss = fields.get("loss")
    if isinstance(loss, int | float):
        parts.append(f"loss {loss:.4f}")
    rate = fields.get("examples_per_second")
    if isinstance(rate, int | float) and math.isfinite(rate):
        parts.append(f"{rate:.0f} ex/s")
    if eta_seconds is None or not math.isfinite(eta_seconds):
        parts.append("ETA —")
    else:
        parts.append(f"ETA {timedelta(seconds=round(max(eta_seconds, 0.0)))}")
    return " · ".join(parts)


def _final_step(fields: Mapping[str, Any]) -> bool:
    step, max_steps = fields.get("step"), fields.get("max_steps")
    return isinstance(step, int) and isinstance(max_steps, int) and step >= max_steps


def redacted(value: Any) -> Any:
    """``value`` with every string in it redacted: an event's fields carry error messages and
    tracebacks, which may quote a URL with its password."""
    if isinstance(value, str):
        return redact.text(value)
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(item) for item in value]
    return value


def running_under_pipes() -> bool:
    """True when Dagster launched this process through Pipes (its params are in the env)."""
    try:
        from dagster_pipes import PipesEnvVarParamsLoader
    except ImportError:
        return False
    return PipesEnvVarParamsLoader().is_dagster_pipes_process()


def make_reporter() -> Reporter:
    """The Pipes reporter under Dagster Pipes, else stdout JSON lines."""
    if running_under_pipes():
        from dagster_pipes import open_dagster_pipes

        return PipesReporter(
            open_dagster_pipes(), min_interval=envvars.TRACKS_PROGRESS_SECONDS.get()
        )
    return StdoutReporter()
