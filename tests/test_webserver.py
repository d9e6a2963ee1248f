"""The UI path: a real ``dagster dev`` on loopback loads the code location and runs the graph."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from tests.dagster_dev import (
    ADD_PARTITION,
    FAST_RUN_QUEUE,
    LAUNCH_RUN,
    REPO_ROOT,
    REPOSITORY,
    DagsterDev,
)

pytestmark = pytest.mark.slow

ASSETS = [
    "data_snapshot",
    "training_attempt",
    "committed_checkpoint",
    "evaluation",
    "promoted_model",
]
CHECKS = ["schema_contract", "data_quality", "drift_vs_previous"]


def test_definitions_validate_for_the_workspace(tracks_home: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_fresh_clone_serves_the_graph_with_nothing_exported(tmp_path: Path) -> None:
    """As every Dagster README teaches: `dagster dev -w workspace.yaml` in the repository root."""
    import os

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    bare = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    validate = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
        cwd=clone, env=bare, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert "ignored" not in validate.stderr and "TRACKS_DAGSTER_PG_URL" not in validate.stderr
    server = DagsterDev(env=bare, log_path=tmp_path / "dagster-dev.log", cwd=clone, clean=True)
    try:
        server.wait_until_loaded()
        nodes = server.graphql("{ assetNodes { assetKey { path } } }")["assetNodes"]
        assert {n["assetKey"]["path"][-1] for n in nodes} >= set(ASSETS)
    finally:
        server.stop()
    # Everything it wrote lies under the ignored .tracks/ folder.
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True
    )
    assert status.stdout == "", status.stdout


# The launch the Materialize button makes, with the trainer as two ranks under torchrun:
# choosing the backend in the run config is all that changes. (The browser test makes the same
# launch through the dialog with the default, one-process backend.)
TORCHRUN = {"resources": {"trainer": {"config": {"backend": "torchrun", "nproc_per_node": 2}}}}


def test_materialize_button_runs_the_whole_graph_in_dagster_dev(tracks_home: Path) -> None:
    write_digits_landing(tracks_home / "landing")
    snapshot = snapshot_id_for(tracks_home / "landing")
    (tracks_home / "dagster" / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\n" + FAST_RUN_QUEUE
    )
    server = DagsterDev(
        env={
            "TRACKS_HOME": str(tracks_home),
            "DAGSTER_HOME": str(tracks_home / "dagster"),
            "TRACKS_AUTOMATION": "off",  # this test presses the button itself
        },
        log_path=tracks_home / "dagster-dev.log",
    )
    try:
        server.wait_until_loaded()
        added = server.graphql(
            ADD_PARTITION, {"repo": REPOSITORY, "name": "snapshots", "key": snapshot}
        )["addDynamicPartition"]
        assert added["__typename"] == "AddDynamicPartitionSuccess", added
        params = {
            "selector": {
                **REPOSITORY,
                "pipelineName": "__ASSET_JOB",
                "assetSelection": [{"path": [name]} for name in ASSETS],
                "assetCheckSelection": [
                    {"assetKey": {"path": ["data_snapshot"]}, "name": check} for check in CHECKS
                ],
            },
            "runConfigData": {
                "ops": {"training_attempt": {"config": {"train": {"max_steps": 300}}}},
                **TORCHRUN,
            },
            "executionMetadata": {"tags": [{"key": "dagster/partition", "value": snapshot}]},
        }
        launched = server.graphql(LAUNCH_RUN, {"params": params})["launchPipelineExecution"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]
        status = server.wait_for_run(run_id, timeout=420)
        assert status == "SUCCESS", server.log_tail()
    finally:
        server.stop()

    ledger = Ledger.open(f"sqlite:///{tracks_home / 'ledger.db'}")
    [run] = ledger.find_runs(snapshot_id=snapshot)
    [attempt] = ledger.attempts(run.run_id)
    assert attempt.dagster_run_id == run_id
    assert attempt.termination_reason == "succeeded"
    assert attempt.placement["world_size"] == 2 and attempt.placement["ranks_per_node"] == 2
    assert ledger.promotions(run_id=run.run_id)[0].decision == "promoted"
