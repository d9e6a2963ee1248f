"""One MLflow run per training run, across attempts: one value per step, on the global steps."""

from __future__ import annotations

import signal
from pathlib import Path

from mlflow import MlflowClient

from pipeline.tracking import RUN_TAG, TRAINING_EXPERIMENT
from pipeline.trainer import exit_codes
from tests.trainer_support import Trainer, write_config

MAX_STEPS = 60


def test_a_run_preempted_twice_has_one_value_per_step_in_one_mlflow_run(
    snapshot_dir: Path,
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"TRACKS_MLFLOW_URI": uri, "TRACKS_MLFLOW_ARTIFACTS": str(tmp_path / "artifacts")}
    config = write_config(tmp_path / "config", snapshot_dir, max_steps=MAX_STEPS,
                          checkpoint_every_steps=10, log_every_steps=1)  # fmt: skip
    store = tmp_path / "store"

    # 1: SIGKILL at step 25, five steps past the commit at 20: steps 21-25 are trained twice.
    first = Trainer(config, store, "r1", env={**env, "TRACKS_FAULT_SLEEP_AFTER_STEP": "30@25"})
    first.wait_for_step(25)
    first.process.send_signal(signal.SIGKILL)
    assert first.wait().returncode == -signal.SIGKILL
    # 2: SIGTERM at step 45: it commits there and exits 75.
    second = Trainer(config, store, "r1", env={**env, "TRACKS_FAULT_SLEEP_AFTER_STEP": "30@45"})
    second.wait_for_step(45)
    second.process.send_signal(signal.SIGTERM)
    assert second.wait().returncode == exit_codes.PREEMPTED
    # 3: to the end.
    assert Trainer(config, store, "r1", env=env).wait().returncode == exit_codes.SUCCEEDED

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(TRAINING_EXPERIMENT)
    [run] = client.search_runs([experiment.experiment_id])
    assert run.data.tags[RUN_TAG] == "r1"
    assert run.data.params["max_steps"] == str(MAX_STEPS)  # the resolved config as params
    assert run.info.status == "FINISHED"
    for metric in ("loss", "lr", "examples_per_second"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, metric)]
        assert sorted(steps) == list(range(1, MAX_STEPS + 1)), (metric, sorted(steps))
    commits = sorted(m.step for m in client.get_metric_history(run.info.run_id, "checkpoint.step"))
    assert commits == [10, 20, 30, 40, 45, 50, 60]
    # Each attempt left its story on the same run: where it restored, how it ended.
    tags = run.data.tags
    # 20 if its background commit landed before the kill, else 10: either way, no step twice.
    assert tags["tracks.attempt.2.restored_step"] in ("10", "20")
    assert tags["tracks.attempt.3.restored_step"] == "45"
    assert tags["tracks.attempt.2"] == "preempted" and tags["tracks.attempt.3"] == "succeeded"
