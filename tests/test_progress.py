"""Live training progress: a line per logging interval on the Dagster run page, while it trains.

A real trainer process under a real Dagster run (``TrainerPipesClient``, in-process
``dg.materialize``); the Pipes context of the Kubernetes backend written to a real file and read
back through dagster-k8s's own pod-log parser; the code location loading without a warning.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import dagster as dg
from dagster_pipes import (
    DAGSTER_PIPES_CONTEXT_ENV_VAR,
    DAGSTER_PIPES_MESSAGES_ENV_VAR,
    PipesContext,
    PipesDefaultContextLoader,
    PipesDefaultMessageWriter,
    PipesMappingParamsLoader,
    encode_param,
)

from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import create_snapshot
from pipeline.trainer.reporting import PipesReporter, progress_line
from resources.launcher import TrainerPipesClient
from tests.trainer_support import REPO, write_config

LINE = re.compile(r"^step (\d+)/(\d+) \((\d+)%\) · loss \d+\.\d{4} · \d+ ex/s · ETA (.+)$")
SLEEP = 0.4  # seconds the trainer pauses after each step
MAX_STEPS = 6


def _eta_seconds(text: str) -> float | None:
    if text == "—":
        return None
    hours, minutes, seconds = (int(part) for part in text.split(":"))
    return timedelta(hours=hours, minutes=minutes, seconds=seconds).total_seconds()


def test_progress_lines_reach_the_run_while_the_trainer_runs(tracks_home: Path) -> None:
    write_digits_landing(tracks_home / "landing")
    snapshot = create_snapshot(tracks_home / "landing", tracks_home / "snapshots")
    config = write_config(
        tracks_home / "config",
        snapshot.path,
        max_steps=MAX_STEPS,
        checkpoint_every_steps=MAX_STEPS,
        model={"channels": 4, "hidden": 16},
    )
    store = tracks_home / "checkpoints"

    @dg.asset
    def trained(context) -> dg.MaterializeResult:  # type: ignore[no-untyped-def]
        client = TrainerPipesClient(
            termination_grace_seconds=30,
            env={
                "TRACKS_FAULT_SLEEP_AFTER_STEP": str(SLEEP),
                "TRACKS_PROGRESS_SECONDS": "0",  # every interval: the throttle has its own test
            },
        )
        command = [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
                   "--run-id", "progress", "--store", str(store)]  # fmt: skip
        _, ended = client.run(context=context, command=command, cwd=str(REPO))
        commits = [m for m in ended.custom_messages if m.get("event") == "checkpoint_committed"]
        return dg.MaterializeResult(
            metadata={"returncode": ended.returncode, "final": commits[-1]["path"]}
        )

    with dg.instance_for_test() as instance:
        result = dg.materialize([trained], instance=instance)
        assert result.success
        metadata = result.asset_materializations_for_node("trained")[0].metadata
        assert metadata["returncode"].value == 0
        logs = instance.all_logs(result.run_id)
    # The final checkpoint is committed after the last step and before the trainer exits.
    committed_at = (Path(metadata["final"].value) / "MANIFEST.json").stat().st_mtime
    progress = [
        (entry.timestamp, LINE.match(entry.user_message))
        for entry in logs
        if entry.dagster_event is None and LINE.match(entry.user_message)
    ]
    steps = [int(match.group(1)) for _, match in progress]
    assert len(steps) >= 3 and steps == sorted(set(steps)), steps
    assert all(at < committed_at for at, _ in progress), (progress, committed_at)
    assert all(int(match.group(2)) == MAX_STEPS for _, match in progress)
    etas = [_eta_seconds(match.group(4)) for _, match in progress]
    assert etas[0] is None  # no rate before a second report
    for step, eta in zip(steps[1:], etas[1:], strict=True):
        # Every step took at least SLEEP seconds, so the rate measured between reports can
        # promise no earlier finish than that (the ETA is rounded to whole seconds).
        assert eta is not None and eta >= (MAX_STEPS - step) * SLEEP - 0.5, (step, eta)
    assert etas[-1] == 0.0


def test_progress_line_reads_like_the_run_page_shows_it() -> None:
    fields = {"step": 120, "max_steps": 400, "loss": 0.53124, "examples_per_second": 812.4}
    assert (
        progress_line(fields, 41.2) == "step 120/400 (30%) · loss 0.5312 · 812 ex/s · ETA 0:00:41"
    )
    assert progress_line(fields, None).endswith("· ETA —")
    assert progress_line({"step": 7, "loss": 1.0}, None) == "step 7 · loss 1.0000 · ETA —"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pipes_context(messages: Path) -> PipesContext:
    """A real Pipes context whose messages go to ``messages``, one JSON line each."""
    data = {
        "asset_keys": ["trained"], "code_version_by_asset_key": None,
        "provenance_by_asset_key": None, "partition_key": None, "partition_key_range": None,
        "partition_time_window": None, "run_id": "r", "job_name": None, "retry_number": 0,
        "extras": {},
    }  # fmt: skip
    params = {
        DAGSTER_PIPES_CONTEXT_ENV_VAR: encode_param({"data": data}),
        DAGSTER_PIPES_MESSAGES_ENV_VAR: encode_param({"path": str(messages)}),
    }
    return PipesContext(
        PipesMappingParamsLoader(params), PipesDefaultContextLoader(), PipesDefaultMessageWriter()
    )


def test_kubernetes_pod_log_reader_hands_over_each_progress_line_at_once(tmp_path: Path) -> None:
    """dagster-k8s releases a pod log line only when the next one arrives: the progress line
    must not be the last of its interval, or the run page lags a whole interval behind."""
    from dagster_k8s.pipes import _process_log_stream

    messages = tmp_path / "messages.jsonl"
    clock = _Clock()
    reporter = PipesReporter(_pipes_context(messages), min_interval=10.0, clock=clock)
    chunks: list[bytes] = []  # what the kubelet serves for each report, timestamped per line
    seen = 0
    for step in range(1, 31):
        clock.now = float(step)
        reporter.step({"step": step, "max_steps": 30, "loss": 1.0 / step, "examples_per_second": 9})
        lines = messages.read_text().splitlines()
        chunk = "".join(f"2026-01-01T00:00:{seen + i:02d}.000000000Z {line}\n"
                        for i, line in enumerate(lines[seen:]))  # fmt: skip
        seen = len(lines)
        chunks.append(chunk.encode())
    pulled = 0

    def stream() -> Iterator[bytes]:
        nonlocal pulled
        for chunk in chunks:
            pulled += 1
            yield chunk

    released: list[tuple[int, dict[str, Any]]] = []
    for item in _process_log_stream(stream()):
        released.append((pulled, json.loads(item.log)))
    logged = [
        (at, message["params"]["message"]) for at, message in released if message["method"] == "log"
    ]
    # Throttled to one line per 10 s of the trainer's clock, besides the first and the final.
    assert [int(LINE.match(text).group(1)) for _, text in logged] == [1, 11, 21, 30]
    # Each line is handed to Dagster while its own interval's chunk is the newest one read.
    assert [at for at, _ in logged] == [1, 11, 21, 30]


def test_the_code_location_loads_without_a_warning(tracks_home: Path) -> None:
    loaded = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import definitions"],
        cwd=REPO, env={**os.environ, "PYTHONWARNINGS": ""}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    assert "Warning" not in loaded.stderr, loaded.stderr
