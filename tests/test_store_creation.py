"""Processes that start together on a fresh home each find the ledger and MLflow's store whole.

A Dagster run worker, the daemon's sensor and a trainer's tracker thread open a new ledger and a
new ``mlflow.db`` at the same moment on a fresh home; each used to create the tables itself and
the second failed with "table ... already exists" (the preemption drill, 2026-11-27), and a
trainer killed while MLflow created its tables left a store no process could open again.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.dagster_dev import REPO_ROOT

OPEN_LEDGER = """
import sys
from pipeline.ledger import Ledger
Ledger.open(sys.argv[1]).dispose()
"""

OPEN_MLFLOW = """
import sys
from mlflow import MlflowClient
from pipeline.mlflow_setup import store_ready
store_ready(sys.argv[1])
client = MlflowClient(tracking_uri=sys.argv[1], registry_uri=sys.argv[1])
client.search_experiments(max_results=1)
client.search_registered_models(max_results=1)
"""


def _together(script: str, url: str, processes: int = 4) -> None:
    started = [
        subprocess.Popen(
            [sys.executable, "-c", script, url],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(processes)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in started]
    for process, output in zip(started, outputs, strict=True):
        assert process.returncode == 0, output[-2000:]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_processes_opening_a_new_ledger_together_all_find_it_migrated(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
    else:
        make_db: Callable[[], str] = request.getfixturevalue("make_pg_database")
        url = make_db()
    _together(OPEN_LEDGER, url)
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            versions = conn.execute(sa.text("SELECT version_num FROM tracks_ledger_version"))
            assert len(versions.all()) == 1
    finally:
        engine.dispose()


def test_processes_opening_a_new_mlflow_store_together_all_find_it_whole(tmp_path: Path) -> None:
    database = tmp_path / "mlflow.db"
    _together(OPEN_MLFLOW, f"sqlite:///{database}")
    assert database.exists()
    # Created whole in a staging file and renamed: nothing of the staging is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]
