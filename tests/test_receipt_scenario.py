"""A scripted scenario on a real run, and the page ``tracks explain`` writes about it.

Real trainer processes, real signals, a real ledger: the run is preempted twice (SIGTERM, then
SIGKILL), runs out of memory on a smaller node, is refused a retry with the same config, is
retried with a smaller batch and succeeds, is evaluated and promoted. A second run on drifted
data stops on bad input without spending accelerator time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.attempts import (
    AttemptRefusedError,
    FinishedAttempt,
    PreparedAttempt,
    finish_attempt,
    prepare_attempt,
)
from pipeline.data.landing import Drift, write_digits_landing
from pipeline.data.snapshot import Snapshot, create_snapshot
from pipeline.evaluation import EVALUATORS, run_evaluation
from pipeline.explain import explain
from pipeline.ledger import Ledger
from pipeline.promotion import promote
from pipeline.settings import TracksSettings
from pipeline.trainer.config import TrainConfig
from tests.dagster_dev import REPO_ROOT, wait_for

pytestmark = pytest.mark.slow

# A "smaller node": the trainer's fault hook raises torch.OutOfMemoryError above this batch.
SMALL_NODE = {"TRACKS_FAULT_OOM_ABOVE_BATCH": "48"}


def _config(snapshot: Snapshot, **changes: object) -> TrainConfig:
    raw = {
        "seed": 3, "max_steps": 300, "checkpoint_every_steps": 50, "batch_size": 64,
        "learning_rate": 0.003, "optimizer": "adam", "keep_last_k": 10,
        "model": {"channels": 8, "hidden": 32}, "snapshot_dir": str(snapshot.path),
    }  # fmt: skip
    raw.update(changes)
    return TrainConfig.from_dict(raw, source="scenario")


def _attempt(
    ledger: Ledger,
    settings: TracksSettings,
    prepared: PreparedAttempt,
    *,
    env: dict[str, str] | None = None,
    kill: signal.Signals | None = None,
    kill_after_step: int = 0,
) -> FinishedAttempt:
    # A heartbeat every step, so the receipt knows exactly the step each attempt reached.
    extra = {"TRACKS_HEARTBEAT_SECONDS": "0", **(env or {})}
    if kill is not None:
        # Hold the trainer just after the commit we wait for, so the signal lands mid-run.
        extra["TRACKS_FAULT_SLEEP_AFTER_STEP"] = f"30@{kill_after_step + 5}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.trainer",
         *prepared.trainer_args(settings.checkpoint_root)],
        cwd=REPO_ROOT, env={**os.environ, **prepared.trainer_env(ledger.url), **extra},
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    if kill is not None:
        run_id = prepared.run.run_id

        def committed() -> bool:
            latest = ledger.latest_committed_checkpoint(run_id)
            return latest is not None and latest.step >= kill_after_step

        wait_for(committed, 120, f"a commit at step {kill_after_step}")
        time.sleep(0.3)  # inside the pause after step kill_after_step + 5
        process.send_signal(kill)
    returncode = process.wait(timeout=180)
    return finish_attempt(
        ledger,
        prepared,
        store=settings.checkpoint_root,
        returncode=returncode,
        signal_name=signal.Signals(-returncode).name if returncode < 0 else None,
    )


def test_scripted_scenario_leaves_a_ledger_that_explain_tells_completely(tracks_home: Path) -> None:
    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    ledger = Ledger.open(settings.ledger_url)
    write_digits_landing(settings.landing_root)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    config = _config(snapshot)

    def next_attempt(
        run_id: str | None, cfg: TrainConfig = config, launched_by: dict | None = None
    ) -> PreparedAttempt:
        return prepare_attempt(
            ledger, snapshot=snapshot, train_config=cfg, work_root=settings.work_root,
            run_id=run_id, owner="ada", purpose="tuning", launched_by=launched_by,
        )  # fmt: skip

    # 1-2: preempted twice, first politely (SIGTERM), then not (SIGKILL).
    first = _attempt(ledger, settings, next_attempt(None), kill=signal.SIGTERM, kill_after_step=50)
    run_id = first.attempt.run_id
    second = _attempt(
        ledger, settings, next_attempt(run_id), kill=signal.SIGKILL, kill_after_step=100
    )
    # 3: moved to a smaller node, where batch 64 runs out of memory.
    third = _attempt(ledger, settings, next_attempt(run_id), env=SMALL_NODE)
    # 4: the same config again is refused before anything starts.
    with pytest.raises(AttemptRefusedError, match="oom"):
        next_attempt(run_id)
    # 5: a smaller batch is a memory-relevant change: retried, and it finishes.
    smaller = _config(snapshot, batch_size=32)
    # A person relaunches it after the stop, by hand: the receipt says who, and which rule let it.
    person = {"via": "cli", "user": "ada"}
    fourth = _attempt(ledger, settings, next_attempt(run_id, smaller, person), env=SMALL_NODE)

    assert [f.termination.reason for f in (first, second, third, fourth)] == [
        "preempted", "preempted", "oom", "succeeded",
    ]  # fmt: skip
    assert [f.decision.action for f in (first, second, third, fourth)] == [
        "resume", "resume", "stop", "none",
    ]  # fmt: skip
    assert "SIGTERM" in first.termination.detail and "SIGKILL" in second.termination.detail
    # Evidence, not expectation: the signal each attempt received, the step it reached (past
    # its last commit when killed), the step it restored.
    assert first.attempt.signal == "SIGTERM" and second.attempt.signal == "SIGKILL"
    assert second.attempt.restored_step == 55
    assert second.attempt.last_step == 105, second.attempt.last_step
    assert (
        fourth.attempt.launched_by["via"] == "cli" and fourth.attempt.launched_by["user"] == "ada"
    )
    admission = fourth.attempt.admission
    assert admission["after_attempt"] == 3 and admission["after_decision"] == "stop"
    assert any("batch_size: 64 → 32" in c for c in admission["config_changes"])
    # Each clock named: the trainer's own, inside the receipt's span.
    timings = fourth.attempt.timings
    assert 0 < timings["setup_seconds"] < timings["trainer_process_seconds"]
    assert 0 < timings["training_seconds"] < timings["trainer_process_seconds"]
    assert Path(second.attempt.resumed_from_checkpoint).name == "step-0000000055-a01"

    final = ledger.latest_committed_checkpoint(run_id)
    assert final is not None and final.step == 300 and final.attempt_no == 4
    evaluations = [
        run_evaluation(
            checkpoint_dir=Path(final.path),
            snapshot=snapshot,
            ledger=ledger,
            settings=settings,
            evaluator=evaluator,
            run_id=run_id,
            attempt_no=4,
        )
        for evaluator in EVALUATORS.values()
    ]
    promotion = promote(
        ledger=ledger, settings=settings, run_id=run_id, attempt_no=4,
        checkpoint_dir=Path(final.path), snapshot_id=snapshot.snapshot_id,
    )  # fmt: skip

    # A second run on drifted data: bad input, stopped at once, no accelerator time.
    drifted_landing = settings.home / "drifted"
    write_digits_landing(drifted_landing, drift=Drift.RENAMED_COLUMN)
    drifted = create_snapshot(drifted_landing, settings.snapshot_root)
    bad = _attempt(
        ledger,
        settings,
        prepare_attempt(
            ledger,
            snapshot=drifted,
            train_config=_config(drifted),
            work_root=settings.work_root,
        ),
    )
    assert bad.termination.reason == "bad_input" and bad.decision.action == "stop"
    assert bad.attempt.gpu_seconds == 0.0
    assert "label" in bad.termination.detail

    page = explain(ledger, run_id)
    sections = [line for line in page.splitlines() if line.startswith("## ")]
    for heading in (
        "## What was tried", "## Data snapshot", "## Where it ran", "## Checkpoint lineage",
        "## Attempts and retries", "## Evaluation", "## Promotion",
    ):  # fmt: skip
        assert heading in sections, (heading, sections)

    def section(title: str) -> str:
        start = page.index(title)
        end = page.find("\n## ", start + 1)
        return page[start : end if end > 0 else None]

    tried = section("## What was tried")
    assert "batch_size" in tried and "64" in tried and "32" in tried
    assert snapshot.snapshot_id in section("## Data snapshot")
    assert snapshot.manifest_sha256[:12] in section("## Data snapshot")
    where = section("## Where it ran")
    assert "cpu" in where and "torch" in where
    lineage = section("## Checkpoint lineage")
    assert "| 300 | 4 | committed |" in lineage
    assert Path(second.attempt.resumed_from_checkpoint).name in lineage
    # The smaller batch is another trajectory: attempt 4 started fresh, and says so.
    assert fourth.attempt.resumed_from_checkpoint is None
    assert "Attempt 4 started fresh" in lineage
    retries = section("## Attempts and retries")
    for words in ("preempted", "oom", "succeeded", "resume", "stop", "left"):
        assert words in retries, words
    assert "SIGKILL" in retries and "SIGTERM" in retries
    second_line = next(line for line in retries.splitlines() if "Attempt 2 —" in line)
    assert "reached step 105, restored step 55, last commit at step 100" in second_line
    assert "**5 step(s) lost**" in second_line
    fourth_line = next(line for line in retries.splitlines() if "Attempt 4 —" in line)
    assert "Launched by **cli** (user ada)" in fourth_line
    assert "after attempt 3 ended with **stop**" in fourth_line
    assert "relaunched with a changed config (batch_size: 64 → 32)" in fourth_line
    evaluation = section("## Evaluation")
    for record in evaluations:
        assert record.evaluation_id in evaluation
    assert promotion.decision in section("## Promotion")

    drift_page = explain(ledger, bad.attempt.run_id)
    assert "bad_input" in drift_page and "label" in drift_page
