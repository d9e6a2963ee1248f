"""The trainer in-process (``run_training``) and what it reports: Pipes messages or JSON lines."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster_pipes import encode_param

from pipeline.trainer import TrainConfig, exit_codes, run_training
from pipeline.trainer.reporting import PipesReporter, StdoutReporter

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def small_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    root = tmp_path_factory.mktemp("reporting")
    write_digits_landing(root / "landing")
    snapshot = create_snapshot(root / "landing", root / "snapshots")
    path = root / "train.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "seed": 1, "max_steps": 20, "checkpoint_every_steps": 10, "batch_size": 32,
                "learning_rate": 0.01, "optimizer": "sgd", "lr_schedule": {"kind": "step",
                "step_size": 5, "gamma": 0.5}, "model": {"channels": 4, "hidden": 16},
                "snapshot_dir": str(snapshot.path), "log_every_steps": 5,
            }
        )
    )  # fmt: skip
    return path


class RecordingReporter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def step(self, fields: dict[str, Any]) -> None:
        self.calls.append(("step", fields))

    def checkpoint_committed(self, fields: dict[str, Any]) -> None:
        self.calls.append(("checkpoint_committed", fields))

    def event(self, name: str, fields: dict[str, Any], level: str = "info") -> None:
        self.calls.append((name, fields))

    def close(self) -> None:
        self.calls.append(("close", {}))


def test_run_training_in_process_reports_steps_and_commits(
    small_config: Path, tmp_path: Path
) -> None:
    reporter = RecordingReporter()
    code = run_training(small_config, run_id="inproc", store=tmp_path, reporter=reporter)
    assert code == exit_codes.SUCCEEDED
    names = [name for name, _ in reporter.calls]
    assert names.count("step") == 4 and names.count("checkpoint_committed") == 2
    assert names[0] == "attempt_started" and names[-2:] == ["attempt_finished", "close"]
    step = next(fields for name, fields in reporter.calls if name == "step")
    assert {"step", "loss", "lr", "examples_per_second", "epoch"} <= set(step)
    periodic, final = [fields for name, fields in reporter.calls if name == "checkpoint_committed"]
    assert {"path", "step", "manifest_sha256", "metrics"} <= set(periodic)
    # An async save reports what it cost the loop; the final save is synchronous, all stall.
    assert 0 <= periodic["stall_seconds"] < 5 and "stall_seconds" not in final


def test_wall_clock_limit_saves_and_exits_timeout(small_config: Path, tmp_path: Path) -> None:
    config = TrainConfig.from_dict({**TrainConfig.load(small_config).to_dict(),
                                    "max_wall_seconds": 8.0})  # fmt: skip
    reporter = RecordingReporter()
    with pytest.MonkeyPatch.context() as patch:
        # The limit counts set-up too (imports, data): 8 s leaves room on a loaded machine,
        # and the 10 s pause after step 3 makes sure it is reached there.
        patch.setenv("TRACKS_FAULT_SLEEP_AFTER_STEP", "10@3")
        code = run_training(config, run_id="slow", store=tmp_path, reporter=reporter)
    assert code == exit_codes.TIMEOUT
    (commit,) = [fields for name, fields in reporter.calls if name == "checkpoint_committed"]
    assert commit["step"] == 3
    words = json.loads((tmp_path / "slow" / "attempt-1.last_words.json").read_text())
    assert words["reason"] == "timeout" and words["step"] == 3
    # The next attempt (same config: the limit is part of the run) resumes and finishes.
    reporter = RecordingReporter()
    assert run_training(config, run_id="slow", store=tmp_path, reporter=reporter) == 0
    started = next(fields for name, fields in reporter.calls if name == "attempt_started")
    assert started["step"] == 3 and started["attempt_no"] == 2


def test_stdout_reporter_writes_one_json_line_per_event_and_survives_a_closed_reader() -> None:
    stream = io.StringIO()
    reporter = StdoutReporter(stream)
    reporter.step({"step": 1, "loss": 2.5})
    reporter.event("attempt_started", {"attempt_no": 1})
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines == [
        {"event": "step", "step": 1, "loss": 2.5},
        {"event": "attempt_started", "level": "info", "attempt_no": 1},
    ]
    stream.close()  # the parent went away: writing must not kill training
    reporter.step({"step": 2, "loss": 2.4})
    reporter.close()


def test_pipes_reporter_sends_custom_messages_and_logs_never_a_materialization() -> None:
    class FakeLog:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def info(self, message: str) -> None:
            self.lines.append(message)

        warning = error = info

    class FakeContext:
        def __init__(self) -> None:
            self.log = FakeLog()
            self.messages: list[Any] = []
            self.closed = False

        def report_custom_message(self, payload: Any) -> None:
            self.messages.append(payload)

        def report_asset_materialization(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the orchestrator reports the materialization, not the trainer")

        def close(self) -> None:
            self.closed = True

    context = FakeContext()
    reporter = PipesReporter(context)
    reporter.step({"step": 10, "loss": 1.0, "examples_per_second": 100.0})
    reporter.checkpoint_committed({"step": 10, "path": "/x", "manifest_sha256": "ab"})
    reporter.event("attempt_finished", {"reason": "succeeded"})
    reporter.close()
    assert [m["event"] for m in context.messages] == ["step", "checkpoint_committed"]
    assert any("attempt_finished" in line for line in context.log.lines)
    assert context.closed


def test_trainer_under_dagster_pipes_reports_custom_messages_and_no_materialization(
    small_config: Path, tmp_path: Path
) -> None:
    messages = tmp_path / "messages.jsonl"
    context = {
        "asset_keys": ["training_attempt"], "code_version_by_asset_key": None,
        "provenance_by_asset_key": None, "partition_key": None, "partition_key_range": None,
        "partition_time_window": None, "run_id": "dagster-run-1", "job_name": "train",
        "retry_number": 0, "extras": {},
    }  # fmt: skip
    env = {
        **os.environ,
        "DAGSTER_PIPES_CONTEXT": encode_param({"data": context}),
        "DAGSTER_PIPES_MESSAGES": encode_param({"path": str(messages)}),
    }
    command = [sys.executable, "-m", "pipeline.trainer", "--config", str(small_config),
               "--run-id", "piped", "--store", str(tmp_path / "store")]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    sent = [json.loads(line) for line in messages.read_text().splitlines()]
    methods = [m["method"] for m in sent]
    assert methods[0] == "opened" and methods[-1] == "closed"
    assert "report_asset_materialization" not in methods
    custom = [m["params"]["payload"] for m in sent if m["method"] == "report_custom_message"]
    assert [c["step"] for c in custom if c["event"] == "step"] == [5, 10, 15, 20]
    commits = [c for c in custom if c["event"] == "checkpoint_committed"]
    assert [c["step"] for c in commits] == [10, 20]
    assert all(c["path"] and len(c["manifest_sha256"]) == 64 for c in commits)
    assert any(m["method"] == "log" for m in sent)
    assert sent[-1]["params"] == {}  # closed without an exception
