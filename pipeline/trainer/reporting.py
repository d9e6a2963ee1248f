"""How the trainer tells the world what it is doing: Dagster Pipes when launched by Dagster,
else one JSON line per event on stdout.

Both speak the same events: ``step`` (per logging interval) and ``checkpoint_committed`` are
the messages an orchestrator consumes; everything else is a log line. Under Pipes the trainer
never reports an asset materialization: the orchestrator does, from these messages.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Protocol

from pipeline import redact

STEP = "step"
CHECKPOINT_COMMITTED = "checkpoint_committed"


class Reporter(Protocol):
    def step(self, fields: dict[str, Any]) -> None:
        """One logging interval: step, loss, lr, examples_per_second, epoch."""

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
    """Custom messages for steps and commits, ``context.log`` for the rest."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def step(self, fields: dict[str, Any]) -> None:
        self._context.report_custom_message({"event": STEP, **fields})

    def checkpoint_committed(self, fields: dict[str, Any]) -> None:
        self._context.report_custom_message({"event": CHECKPOINT_COMMITTED, **fields})
        self._context.log.info(
            f"checkpoint committed at step {fields.get('step')}: {fields.get('path')}"
        )

    def event(self, name: str, fields: dict[str, Any], level: str = "info") -> None:
        log = getattr(self._context.log, level if level in ("warning", "error") else "info")
        log(f"{name}: {json.dumps(redacted(fields), default=str, sort_keys=True)}")

    def close(self) -> None:
        self._context.close()


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

        return PipesReporter(open_dagster_pipes())
    return StdoutReporter()
