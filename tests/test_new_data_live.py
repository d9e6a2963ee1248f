"""New landing data in a live ``dagster dev``: a snapshot partition and a run, or a failed check.

The new-data sensor is on (``TRACKS_AUTOMATION=on``) with a short interval. A clean file leads to
a trained run on its snapshot; adding a drifted file makes a new snapshot whose blocking check
fails, and no training starts on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.data.landing import Drift, write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from tests.dagster_dev import FAST_RUN_QUEUE, DagsterDev, wait_for

pytestmark = pytest.mark.slow

RUNS = """
{ runsOrError { ... on Runs { results { runId status tags { key value } } } } }
"""
CHECKS = """
query($key: AssetKeyInput!, $name: String!) {
  assetCheckExecutions(assetKey: $key, checkName: $name, limit: 10) {
    runId status
  }
}
"""


@pytest.fixture
def live(tracks_home: Path) -> Iterator[DagsterDev]:
    (tracks_home / "dagster" / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\n" + FAST_RUN_QUEUE
    )
    env = {
        "TRACKS_HOME": str(tracks_home),
        "DAGSTER_HOME": str(tracks_home / "dagster"),
        "TRACKS_AUTOMATION": "on",
        "TRACKS_NEW_SNAPSHOT_INTERVAL": "2",
        "TRACKS_LANDING_SETTLE": "1",
    }
    server = DagsterDev(env=env, log_path=tracks_home / "dagster-dev.log")
    try:
        server.wait_until_loaded()
        yield server
    finally:
        server.stop()


def _sensor_runs(server: DagsterDev) -> dict[str, str]:
    """Dagster runs the new-data sensor launched: partition -> status."""
    runs = server.graphql(RUNS)["runsOrError"]["results"]
    found = {}
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["tags"]}
        if tags.get("tracks/trigger") == "new_snapshot":
            found[tags["dagster/partition"]] = run["status"]
    return found


def _finished(server: DagsterDev, snapshot: str) -> str | None:
    status = _sensor_runs(server).get(snapshot)
    return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None


def test_new_landing_file_trains_and_a_drifted_one_stops_at_its_check(
    live: DagsterDev, tracks_home: Path
) -> None:
    landing = tracks_home / "landing"
    write_digits_landing(landing)
    clean = snapshot_id_for(landing)
    assert wait_for(lambda: _finished(live, clean), 300, "the clean snapshot's run", 2.0) == (
        "SUCCESS"
    ), live.log_tail()
    ledger = Ledger.open(f"sqlite:///{tracks_home / 'ledger.db'}")
    [run] = ledger.find_runs(snapshot_id=clean)
    assert ledger.attempts(run.run_id)[-1].termination_reason == "succeeded"

    time.sleep(1.5)  # a distinct mtime for the new file
    write_digits_landing(landing, drift=Drift.LABEL_OUT_OF_RANGE, file_name="more.parquet")
    drifted = snapshot_id_for(landing)
    assert drifted != clean
    assert wait_for(lambda: _finished(live, drifted), 180, "the drifted snapshot's run", 2.0) == (
        "FAILURE"
    )
    checks = live.graphql(CHECKS, {"key": {"path": ["data_snapshot"]}, "name": "schema_contract"})
    assert "FAILED" in {c["status"] for c in checks["assetCheckExecutions"]}
    assert ledger.find_runs(snapshot_id=drifted) == []  # no training on drifted data
    assert os.path.isdir(tracks_home / "snapshots" / drifted)  # the snapshot itself is kept
