"""An evaluator that crashes is retried on its own budget; the training is never re-run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import dagster as dg
import pytest

from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.definitions import build_definitions
from pipeline.evaluation import EVALUATORS
from pipeline.evaluation.evaluators import HoldoutAccuracy
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from sensors import materialize_snapshot

pytestmark = pytest.mark.slow


class FlakyEvaluator(HoldoutAccuracy):
    """Crashes on its first call in this process, like an evaluator hitting a dead judge."""

    name: ClassVar[str] = "flaky_holdout"
    required: ClassVar[bool] = False
    calls: ClassVar[int] = 0

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        if type(self).calls == 1:
            raise ConnectionError("judge endpoint reset the connection")
        return super().evaluate(*args, **kwargs)


def test_evaluator_crash_retries_the_evaluator_not_the_training(
    tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(EVALUATORS, FlakyEvaluator.name, FlakyEvaluator())
    # No waiting in a test: the first evaluator_crash retry comes at once.
    policy = "evaluator_crash: {max_attempts: 2, backoff: {initial_seconds: 0}}"
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root)
    snapshot = snapshot_id_for(settings.landing_root)
    run_config = {
        "ops": {"training_attempt": {"config": {"max_steps": 300, "retry_policy": policy}}}
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
        e for e in ledger.evaluations_for_run(run.run_id) if e.evaluator_name == "flaky_holdout"
    ]
    assert [(e.status, e.termination_reason) for e in flaky] == [
        ("failed", "evaluator_crash"),
        ("complete", None),
    ]
    assert "ConnectionError" in flaky[0].detail
    # The other evaluators completed once each: the retry skipped them.
    others = [
        e for e in ledger.evaluations_for_run(run.run_id) if e.evaluator_name != "flaky_holdout"
    ]
    assert sorted(e.evaluator_name for e in others) == ["holdout_accuracy", "noise_robustness"]
