"""A trainer's start-up, split: from its process's birth to the end of its first step.

A preempted run is back once its next attempt has trained a step; everything before that is
start-up, and the receipt's ``timings.startup`` says where it went, in seconds:

- ``process_start``: from the kernel starting the process to ``main()`` (the interpreter, its
  site packages, ``pipeline.trainer``'s own light modules);
- ``imports``: from ``main()`` to the training function: torch and the loop's modules;
- ``ledger``: opening the ledger, and the attempt's writes before its first step (its begin,
  where it resumed from, its placement);
- ``data``: loading the snapshot's tensors (the gate's verdict, the read, the checks), on a
  thread of its own while, with several ranks, the training thread waits for the others to
  join;
- ``restore``: restoring the newest committed checkpoint, then asking the ledger whether a
  newer one was committed meanwhile;
- ``first_step``: the first training step (the first of a process pays some of torch's lazy
  set-up);
- ``total``: from the kernel starting the process to the end of the first step.

The parts add up to less than ``total``: what is left has no key of its own: building the model
and optimizer (torch's own optimizers import ``torch._dynamo`` when they are made, seconds of
CPU; Tracks' do not: ``pipeline/trainer/optimizers.py``), joining the other ranks beyond the
data's load, events, the tracker's start.
``run_training`` called in-process (tests, notebooks) has no ``main()``: ``process_start`` and
``imports`` are left out, and ``total`` counts from ``run_training``. Where the process's start
time cannot be read (no ``/proc``), ``process_start`` is left out and ``total`` counts from
``main()``. A key is written only for what was measured.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")

# The parts, in the order the receipt and ``tracks explain`` show them.
PARTS = ("process_start", "imports", "ledger", "data", "restore", "first_step")


def process_age() -> float | None:
    """Seconds since the kernel started this process; None where ``/proc`` cannot tell.

    ``/proc/self/stat`` gives the start in clock ticks since boot (field 22), ``/proc/uptime``
    the seconds since boot: both count from the same boot, inside a container too, to 10 ms.
    """
    try:
        with open("/proc/self/stat") as stat:
            # The command name (field 2) may hold spaces and parentheses: count after its ")".
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
    return max(since_boot - started, 0.0)


class StartupClock:
    """The start-up's marks and parts on the monotonic clock; :meth:`split` is the receipt's.

    ``main()`` makes one with :meth:`at_main`; ``run_training`` makes its own when it has none.
    The training thread adds the parts it measures (:meth:`part`); the data thread's time comes
    from its :class:`Beside` (:meth:`add`).
    """

    def __init__(self, *, main_at: float | None = None, age_at_main: float | None = None) -> None:
        self._main_at = main_at
        self._age_at_main = age_at_main
        self._entered: float | None = None
        self._parts: dict[str, float] = {}
        self._first_step_ended: float | None = None

    @classmethod
    def at_main(cls) -> StartupClock:
        """A clock started now, in ``main()``, with the process's age at this moment."""
        return cls(main_at=time.monotonic(), age_at_main=process_age())

    def entered(self) -> None:
        """``run_training`` begins: the imports are over."""
        if self._entered is None:
            self._entered = time.monotonic()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Count the block's wall time into part ``name`` (parts add up across blocks)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - began)

    def add(self, name: str, seconds: float) -> None:
        self._parts[name] = self._parts.get(name, 0.0) + seconds

    def stepped(self) -> None:
        """A training step ended; the first one ends the start-up (later calls change nothing)."""
        if self._first_step_ended is None:
            self._first_step_ended = time.monotonic()

    def split(self, loop_started: float | None) -> dict[str, float]:
        """The receipt's ``timings.startup`` (see the module): only what was measured.

        ``loop_started``: when the training loop began (the first step's start); without a
        finished first step there is neither ``first_step`` nor ``total``.
        """
        out: dict[str, float] = {}
        if self._main_at is not None and self._age_at_main is not None:
            out["process_start"] = self._age_at_main
        if self._main_at is not None and self._entered is not None:
            out["imports"] = self._entered - self._main_at
        for name in ("ledger", "data", "restore"):
            if name in self._parts:
                out[name] = self._parts[name]
        ended = self._first_step_ended
        if ended is not None and loop_started is not None:
            out["first_step"] = ended - loop_started
            origin = self._main_at if self._main_at is not None else self._entered
            if origin is not None:
                out["total"] = ended - origin + out.get("process_start", 0.0)
        return {key: round(max(value, 0.0), 3) for key, value in out.items()}


class Beside(Generic[T]):
    """``work()`` on a daemon thread of its own; :meth:`result` waits and returns or raises.

    Daemon: an attempt that ends before it needs the result (a stop during start-up, a config
    error) does not wait for the work to finish; whatever it was doing is abandoned with the
    process. ``seconds`` is the work's wall time once it has ended.
    """

    def __init__(self, work: Callable[[], T], *, name: str) -> None:
        self.seconds: float | None = None
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        began = time.monotonic()
        try:
            self._value = work()
        except BaseException as exc:  # handed to the thread that waits for the result
            self._error = exc
        finally:
            self.seconds = time.monotonic() - began

    def result(self) -> T:
        """The work's value, once it is done; what it raised is raised here, traceback kept."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def done_value(self) -> T | None:
        """The value if the work already ended well, else None; never waits."""
        if self._thread.is_alive() or self._error is not None:
            return None
        return self._value
