"""A launcher that raises leaves a receipt that says so, not a signal nobody sent."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from definitions import build_definitions
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from sensors import materialize_snapshot

pytestmark = pytest.mark.slow


def test_a_launcher_that_raises_closes_the_attempt_as_user_code_error_naming_the_error(
    tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root)
    snapshot = snapshot_id_for(settings.landing_root)
    missing = tracks_home / "no-such-python"
    monkeypatch.setenv("TRACKS_TRAINER_PYTHON", str(missing))  # the deployment's setting
    with dg.DagsterInstance.get() as instance:
        result = materialize_snapshot(build_definitions(settings), instance, snapshot)
    assert not result.success
    [attempt] = Ledger.open(settings.ledger_url).list_attempts()
    # Not "preempted by SIGHUP": no exit code or signal was ever seen.
    assert attempt.termination_reason == "user_code_error", attempt.termination_detail
    assert attempt.exit_code is None and attempt.signal is None
    assert "FileNotFoundError" in attempt.termination_detail
    assert str(missing) in attempt.termination_detail
    assert attempt.retry_decision["action"] == "stop"


def test_run_config_cannot_choose_the_trainers_program(tracks_home: Path) -> None:
    """The program started with the ledger's credentials is the deployment's choice."""
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root)
    snapshot = snapshot_id_for(settings.landing_root)
    run_config = {"resources": {"trainer": {"config": {"python_executable": "/tmp/evil"}}}}
    with dg.DagsterInstance.get() as instance, pytest.raises(dg.DagsterInvalidConfigError):
        materialize_snapshot(build_definitions(settings), instance, snapshot, run_config=run_config)
    assert Ledger.open(settings.ledger_url).list_attempts() == []
