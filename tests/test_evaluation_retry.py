"""An evaluator that crashes is retried on its own budget; the training is never re-run."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from definitions import build_definitions
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.evaluation.run import FAULT_EVALUATOR_CRASH
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from sensors import materialize_snapshot

pytestmark = pytest.mark.slow


def test_evaluator_crash_retries_the_evaluator_not_the_training(
    tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The drill hook: holdout_accuracy crashes the first time it sees this checkpoint.
    monkeypatch.setenv(FAULT_EVALUATOR_CRASH, "holdout_accuracy:1")
    # No waiting in a test: the first evaluator_crash retry comes at once.
    policy = "evaluator_crash: {max_attempts: 2, backoff: {initial_seconds: 0}}"
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root)
    snapshot = snapshot_id_for(settings.landing_root)
    run_config = {
        "ops": {
            "training_attempt": {"config": {"train": {"max_steps": 300}, "retry_policy": policy}}
        }
    }
    with dg.DagsterInstance.get() as instance:
        result = materialize_snapshot(
            build_definitions(settings), instance, snapshot, run_config=run_config
        )
    assert result.success

    ledger = Ledger.open(settings.ledger_url)
    [run] = ledger.find_runs(snapshot_id=snapshot)
    assert len(ledger.attempts(run.run_id)) == 1  # training ran once
    flaky = [
        e for e in ledger.evaluations_for_run(run.run_id) if e.evaluator_name == "holdout_accuracy"
    ]
    assert [(e.status, e.termination_reason) for e in flaky] == [
        ("failed", "evaluator_crash"),
        ("complete", None),
    ]
    assert "InjectedEvaluatorCrash" in flaky[0].detail
    # The other evaluator completed once: the retry skipped it.
    others = [
        e for e in ledger.evaluations_for_run(run.run_id) if e.evaluator_name != "holdout_accuracy"
    ]
    assert [e.evaluator_name for e in others] == ["noise_robustness"]
