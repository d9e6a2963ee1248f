"""Bad data stops at the blocking checks: no training attempt starts, the error names the column."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from definitions import build_definitions
from pipeline.data.landing import Drift, write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from sensors import materialize_snapshot
from tests.dagster_dev import check_evaluations

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("drift", "failed_check", "expected_words"),
    [
        (Drift.RENAMED_COLUMN, "schema_contract", ["label", "digit"]),
        (Drift.LABEL_OUT_OF_RANGE, "schema_contract", ["label"]),
    ],
)
def test_bad_snapshot_stops_at_blocking_check_before_training(
    tracks_home: Path, drift: Drift, failed_check: str, expected_words: list[str]
) -> None:
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root, drift=drift)
    snapshot = snapshot_id_for(settings.landing_root)

    with dg.DagsterInstance.get() as instance:
        result = materialize_snapshot(build_definitions(settings), instance, snapshot)
    assert not result.success

    evaluations = check_evaluations(result)
    failed = evaluations[failed_check]
    assert not failed.passed
    summary = failed.metadata["summary"].value
    for word in expected_words:
        assert word in summary, summary
    failures = failed.metadata["failures"].value
    assert any(f["column"] in expected_words and f["rule"] for f in failures), failures

    # The snapshot itself is recorded; nothing downstream ran.
    materialized = {e.asset_key.path[-1] for e in result.all_events if e.is_step_materialization}
    assert materialized == {"data_snapshot"}
    started = {e.step_key for e in result.all_events if e.event_type_value == "STEP_START"}
    assert started == {"data_snapshot"}
    ledger = Ledger.open(settings.ledger_url)
    assert ledger.find_runs(snapshot_id=snapshot) == []
    assert ledger.list_attempts() == []
