"""The stop a signal asks for: SIGTERM and SIGINT set a flag, and the trainer acts on it.

Light on purpose (no torch): ``python -m pipeline.trainer`` installs it before it imports
anything heavy, so a signal that lands during start-up is a stop, never a death.
"""

from __future__ import annotations

import signal
from typing import Any


class StopRequest:
    """SIGTERM and SIGINT only set this flag: the loop finishes its step, saves, and exits.

    Distributed, the ranks act on the stop they agreed on at a step (``from_peer`` when another
    rank's signal decided it), never on a flag that one of them set after that agreement.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        # Distributed: another rank got the signal; this one stops at the same step.
        self.from_peer = False

    @property
    def requested(self) -> bool:
        return self.signal_name is not None or self.from_peer

    @property
    def cause(self) -> str:
        return self.signal_name or "a stop another rank received"

    def install(self) -> None:
        """Handle SIGTERM and SIGINT from now on (the main thread only, as Python requires)."""
        # Dagster Pipes forwards a run's termination as SIGINT, schedulers send SIGTERM.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
