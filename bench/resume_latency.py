"""Preemption → first training step of the next attempt, through a live ``dagster dev``.

Starts ``dagster dev`` (webserver + daemon) on loopback with the default sensor settings,
launches training, SIGKILLs the trainer after a checkpoint is committed, and measures until the
resumed attempt has restored its checkpoint and reports its first step (its forced start-up
heartbeat in the ledger, written right before the first step runs). Median of --repeats.

    .venv/bin/python bench/resume_latency.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import envvars
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.settings import AutomationSettings
from tests.dagster_dev import DagsterDev, launch_graph, trainer_pids, wait_for

TRAINING = {"max_steps": 400, "checkpoint_every_steps": 100}


def one_drill(server: DagsterDev, ledger: Ledger, snapshot: str, seed: int) -> dict[str, float]:
    dagster_run = launch_graph(server, snapshot, {**TRAINING, "seed": seed})

    def ready() -> str | None:
        for attempt in ledger.list_attempts(limit=20):
            if attempt.dagster_run_id == dagster_run:
                latest = ledger.latest_committed_checkpoint(attempt.run_id)
                if latest and latest.step >= 200 and trainer_pids(attempt.run_id):
                    return attempt.run_id
        return None

    run_id = wait_for(ready, 180, "a committed checkpoint")
    killed_at = datetime.now(UTC)
    for pid in trainer_pids(run_id):
        os.kill(pid, signal.SIGKILL)

    def resumed_heartbeat() -> datetime | None:
        attempts = ledger.attempts(run_id)
        if len(attempts) >= 2 and attempts[1].last_step is not None:
            return attempts[1].heartbeat_at
        return None

    first_step_at = wait_for(resumed_heartbeat, 180, "the resumed attempt's first step", 0.1)
    second = ledger.attempts(run_id)[1]
    first = ledger.attempts(run_id)[0]
    wait_for(lambda: ledger.attempts(run_id)[1].ended_at, 180, "the resumed attempt to end", 0.5)
    return {
        "kill_to_first_step_s": (first_step_at - killed_at).total_seconds(),
        "kill_to_attempt_closed_s": (first.ended_at - killed_at).total_seconds(),
        "kill_to_next_attempt_begun_s": (second.started_at - killed_at).total_seconds(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
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
    }
    server = DagsterDev(env=env, log_path=home / "dagster-dev.log")
    rows = []
    try:
        server.wait_until_loaded()
        ledger = Ledger.open(f"sqlite:///{home / 'ledger.db'}")
        for i in range(args.repeats):
            row = one_drill(server, ledger, snapshot, seed=100 + i)
            rows.append(row)
            print(
                f"drill {i + 1}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True
            )
    finally:
        server.stop()

    settings = AutomationSettings.from_env()
    print()
    interval = settings.resume_interval_seconds
    print(f"machine: {os.cpu_count()} cores; resume sensor interval {interval} s")
    for key in rows[0]:
        values = [r[key] for r in rows]
        middle = statistics.median(values)
        print(f"{key:<30} median {middle:6.1f} s  (min {min(values):.1f}, max {max(values):.1f})")
    median = statistics.median(r["kill_to_first_step_s"] for r in rows)
    verdict = "met" if median <= 45 else "MISSED"
    print(f"target: preemption -> first step <= 45 s: {verdict} ({median:.1f} s)")


if __name__ == "__main__":
    main()
