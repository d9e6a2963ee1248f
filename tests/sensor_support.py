"""Evaluating the resume sensor once, as Dagster's daemon would, against a real ledger."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from pipeline.ledger import Ledger
from resources import LedgerResource, StorageResource
from sensors.resume import resume_after_preemption

SNAPSHOT = "digits-00000000000000aa"


class LoggedLines(logging.Handler):
    """The messages a sensor logged, to check what it said about a run it did not launch."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def resume_tick(
    ledger: Ledger,
    *,
    partitions: tuple[str, ...] = (SNAPSHOT,),
    root: Path | None = None,
    dagster_runs: Sequence[dg.DagsterRun] = (),
    logged: list[str] | None = None,
) -> dg.SensorResult | dg.SkipReason:
    root = root or Path(ledger.url.removeprefix("sqlite:///")).parent / "tracks"
    storage = StorageResource(
        landing_root=str(root / "landing"), snapshot_root=str(root / "snapshots"),
        checkpoint_root=str(root / "checkpoints"), work_root=str(root / "work"),
    )  # fmt: skip
    with dg.instance_for_test() as instance:
        # Runs launched through Dagster train on a snapshot that is a partition already.
        instance.add_dynamic_partitions("snapshots", list(partitions))
        for run in dagster_runs:  # the Dagster runs that ran earlier attempts
            instance.add_run(run)
        # Entered and left inside the instance's block: a context left to the garbage collector
        # exits the instance late and puts its state storage back for whichever test runs next.
        with dg.build_sensor_context(
            instance=instance,
            resources={"ledger": LedgerResource(url=ledger.url), "storage": storage},
        ) as context:
            lines = LoggedLines()
            context.log.addHandler(lines)
            try:
                return resume_after_preemption(context)
            finally:
                context.log.removeHandler(lines)
                if logged is not None:
                    logged.extend(lines.lines)
