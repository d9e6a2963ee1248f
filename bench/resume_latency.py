"""Preemption → the resumed attempt's first training step, through a live ``dagster dev``.

Starts ``dagster dev`` (webserver + daemon) on loopback with the default sensor settings,
launches training, SIGKILLs the trainer after a checkpoint is committed, and measures until the
resumed attempt has trained its first step. The trainer heartbeats after every step here
(``TRACKS_HEARTBEAT_SECONDS``), so the ledger says when that step ended, whatever the code
under test: the first heartbeat past the restored step. Also measured: the start-up heartbeat
(written after the restore, before the loop: this benchmark's "first step" until 2026-11-27,
which missed what ran between it and the step, such as MLflow's start), and, from trainers that
record it, the start-up split on the receipt (``timings.startup``). Median of --repeats.

``continued`` says who opened the resumed attempt: ``in place`` (the Dagster run that ran the
killed attempt, which continues the run itself: no sensor tick, no new Dagster run, so
``kill_to_attempt_closed_s`` to ``kill_to_next_attempt_begun_s`` is the step's own work), or a
new Dagster run of the resume sensor's (``--no-continue-in-run``, or a checkout from before).

    .venv/bin/python bench/resume_latency.py --repeats 5

To compare two versions of the code on one loaded machine, run this file against each in turn
(``PYTHONPATH=<checkout> python <this file> --label …``, several rounds) and compare medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# The checkout under test: this file's, unless PYTHONPATH names another (a before/after pair).
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import envvars, launch_facts
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.settings import AutomationSettings
from tests.dagster_dev import DagsterDev, launch_graph, trainer_pids, wait_for

TRAINING = {"max_steps": 400, "checkpoint_every_steps": 100}
# The ``via`` of an attempt continued in place; a checkout from before that knows no such thing.
IN_RUN_VIA = getattr(launch_facts, "IN_RUN_VIA", "in_run:")
STARTUP_PARTS = ("process_start", "imports", "ledger", "data", "restore", "first_step", "total")
# Generous: on a 2-core machine shared with test suites a start-up can take a minute.
WAIT_SECONDS = 600
# Issue 29: preemption to the first resumed step, median, on this 2-vCPU machine.
TARGET_SECONDS = 8.0


def one_drill(
    server: DagsterDev, ledger: Ledger, snapshot: str, seed: int, extra: dict[str, Any]
) -> dict[str, Any]:
    dagster_run = launch_graph(server, snapshot, {"train": {**TRAINING, "seed": seed}, **extra})

    def ready() -> str | None:
        for attempt in ledger.list_attempts(limit=20):
            if attempt.dagster_run_id == dagster_run:
                latest = ledger.latest_committed_checkpoint(attempt.run_id)
                if latest and latest.step >= 200 and trainer_pids(attempt.run_id):
                    return attempt.run_id
        return None

    run_id = wait_for(ready, WAIT_SECONDS, "a committed checkpoint")
    killed_at = datetime.now(UTC)
    for pid in trainer_pids(run_id):
        os.kill(pid, signal.SIGKILL)

    seen: dict[str, datetime] = {}

    def first_step() -> datetime | None:
        # Polled often: a heartbeat per step overwrites the start-up one within a step or two.
        attempts = ledger.attempts(run_id)
        if len(attempts) < 2 or attempts[1].last_step is None:
            return None
        second = attempts[1]
        restored = second.restored_step or 0
        if second.last_step == restored:
            seen.setdefault("startup_heartbeat", second.heartbeat_at)
            return None
        return second.heartbeat_at if second.last_step > restored else None

    first_step_at = wait_for(first_step, WAIT_SECONDS, "the resumed attempt's first step", 0.02)
    wait_for(lambda: ledger.attempts(run_id)[1].ended_at, WAIT_SECONDS, "the resumed end", 0.5)
    first, second = ledger.attempts(run_id)[:2]
    # Who opened attempt 2: the Dagster run that ran attempt 1, continuing in place (no sensor
    # tick, no run launch: "closed" to "begun" is the step's own work), or the resume sensor's
    # new Dagster run.
    via = str((second.launched_by or {}).get("via") or "")
    row: dict[str, Any] = {
        "continued": "in place" if via.startswith(IN_RUN_VIA) else f"new Dagster run ({via})",
        "kill_to_first_step_s": (first_step_at - killed_at).total_seconds(),
        "kill_to_startup_heartbeat_s": (
            (seen["startup_heartbeat"] - killed_at).total_seconds()
            if "startup_heartbeat" in seen
            else None
        ),
        "kill_to_attempt_closed_s": (first.ended_at - killed_at).total_seconds(),
        "kill_to_next_attempt_begun_s": (second.started_at - killed_at).total_seconds(),
        # The trainer's share: from the orchestrator's begin (the process starts right after).
        "begun_to_first_step_s": (first_step_at - second.started_at).total_seconds(),
    }
    startup = (second.timings or {}).get("startup") or {}
    row |= {f"startup.{key}": startup[key] for key in STARTUP_PARTS if key in startup}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="", help="printed with the results (which code)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument(
        "--no-continue-in-run",
        action="store_true",
        help="launch with continue_in_run: false, so the resume sensor continues each run",
    )
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="tracks-resume-bench-")) / "tracks"
    (home / "dagster").mkdir(parents=True)
    (home / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    write_digits_landing(home / "landing")
    snapshot = snapshot_id_for(home / "landing")
    env = {
        envvars.TRACKS_HOME.name: str(home),
        envvars.DAGSTER_HOME.name: str(home / "dagster"),
        envvars.TRACKS_AUTOMATION.name: "off",
        # Hold the trainer at step 250 so the kill lands mid-run, after step 200 committed.
        envvars.TRACKS_FAULT_SLEEP_AFTER_STEP.name: "5@250",
        # A heartbeat after every step: the ledger then says when the first resumed one ended.
        envvars.TRACKS_HEARTBEAT_SECONDS.name: "0.001",
    }
    server = DagsterDev(env=env, log_path=home / "dagster-dev.log")
    rows = []
    try:
        server.wait_until_loaded(timeout=WAIT_SECONDS)
        ledger = Ledger.open(f"sqlite:///{home / 'ledger.db'}")
        for i in range(args.repeats):
            extra = {"continue_in_run": False} if args.no_continue_in_run else {}
            row = one_drill(server, ledger, snapshot, seed=100 + i, extra=extra)
            rows.append(row)
            figures = ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in row.items()
                if v is not None
            )
            print(f"drill {i + 1}: {figures}", flush=True)
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "rows": rows}, indent=1))

    settings = AutomationSettings.from_env()
    print()
    interval = settings.resume_interval_seconds
    print(
        f"{args.label or 'this code'}: {os.cpu_count()} cores; resume sensor interval {interval} s"
    )
    continued = statistics.multimode(r["continued"] for r in rows)
    print(
        f"{'continued':<30} "
        + ", ".join(f"{how} x{sum(r['continued'] == how for r in rows)}" for how in continued)
    )
    for key in rows[0]:
        values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        if not values:
            continue
        middle = statistics.median(values)
        print(f"{key:<30} median {middle:6.1f} s  (min {min(values):.1f}, max {max(values):.1f})")
    median = statistics.median(r["kill_to_first_step_s"] for r in rows)
    verdict = "met" if median <= TARGET_SECONDS else "MISSED"
    print(
        f"target (issue 29): preemption -> first step <= {TARGET_SECONDS:.0f} s: {verdict} "
        f"({median:.1f} s)"
    )


if __name__ == "__main__":
    main()
