"""One MLflow run per training run, across attempts: live, one value per step, on the global
steps; the dataset and checkpoint it came from; the model promoted into it; and a retrained run
whose weights are the champion's registers nothing new."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.models import get_model_info

from pipeline.data.snapshot import open_snapshot
from pipeline.evaluation import run_evaluation
from pipeline.mlflow_setup import EXPERIMENT_KIND_TAG, MACHINE_LEARNING_KIND
from pipeline.promotion import QualityGate, promote
from pipeline.serving.champion import load_champion
from pipeline.settings import TracksSettings
from pipeline.states import PromotionDecision
from pipeline.tracking import (
    CHECKPOINT_PATH_TAG,
    CHECKPOINT_SHA_TAG,
    RUN_TAG,
    TRAINING_EXPERIMENT,
    training_run_of,
)
from pipeline.trainer import exit_codes
from tests.evaluation_support import manifest_sha256, open_ledger, record_committed
from tests.trainer_support import Trainer, write_config

MAX_STEPS = 60


@dataclass(frozen=True)
class Trained:
    """Run r1 preempted twice (SIGKILL at 25, SIGTERM at 45) and run r2 trained straight
    through, same config and snapshot, both tracked in one MLflow store."""

    uri: str
    tmp: Path
    store: Path
    snapshot_dir: Path
    live_loss_steps: list[int]  # MLflow's loss steps while attempt 1 slept at step 25
    live_commit_steps: list[int]  # and its checkpoint.step steps then


def _wait_for_step(trainer: Trainer, step: int) -> None:
    # Generous: on a loaded machine a trainer's start-up alone has taken a minute.
    trainer.wait_until(
        lambda: step in {e["step"] for e in trainer.events() if e["event"] == "step"}, 240
    )


def _steps(client: MlflowClient, mlflow_run_id: str, metric: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(mlflow_run_id, metric))


@pytest.fixture(scope="module")
def trained(snapshot_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    tmp = tmp_path_factory.mktemp("mlflow-training")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    env = {"TRACKS_MLFLOW_URI": uri, "TRACKS_MLFLOW_ARTIFACTS": str(tmp / "artifacts")}
    config = write_config(tmp / "config", snapshot_dir, max_steps=MAX_STEPS,
                          checkpoint_every_steps=10, log_every_steps=1)  # fmt: skip
    store = tmp / "store"
    client = MlflowClient(tracking_uri=uri)
    client.search_experiments()  # the store's tables, made before two processes race for them

    # 1: SIGKILL at step 25, five steps past the commit at 20: steps 21-25 are trained twice.
    first = Trainer(config, store, "r1", env={**env, "TRACKS_FAULT_SLEEP_AFTER_STEP": "90@25"})
    _wait_for_step(first, 25)
    # While it sleeps after step 25, MLflow already has step 25: logged live, not at a commit.
    live: list[int] = []
    deadline = time.monotonic() + 25
    while 25 not in live and time.monotonic() < deadline:
        time.sleep(0.2)
        mlflow_run = training_run_of(client, "r1")
        live = _steps(client, mlflow_run, "loss") if mlflow_run else []
    commits = _steps(client, mlflow_run, "checkpoint.step") if mlflow_run else []
    first.process.send_signal(signal.SIGKILL)
    assert first.wait().returncode == -signal.SIGKILL
    straight = Trainer(config, store, "r2", env=env)  # beside r1's attempts, on the same store
    # 2: SIGTERM at step 45: it commits there and exits 75.
    second = Trainer(config, store, "r1", env={**env, "TRACKS_FAULT_SLEEP_AFTER_STEP": "90@45"})
    _wait_for_step(second, 45)
    second.process.send_signal(signal.SIGTERM)
    assert second.wait().returncode == exit_codes.PREEMPTED
    # 3: to the end.
    assert Trainer(config, store, "r1", env=env).wait(300).returncode == exit_codes.SUCCEEDED
    assert straight.wait(300).returncode == exit_codes.SUCCEEDED
    return Trained(uri, tmp, store, snapshot_dir, live, commits)


def test_a_run_preempted_twice_has_one_value_per_step_in_one_live_mlflow_run(
    trained: Trained,
) -> None:
    # Live: step 25 reached MLflow while the attempt trained, before a checkpoint covered it.
    assert 25 in trained.live_loss_steps, trained.live_loss_steps
    assert max(trained.live_commit_steps, default=0) <= 20, trained.live_commit_steps

    client = MlflowClient(tracking_uri=trained.uri)
    experiment = client.get_experiment_by_name(TRAINING_EXPERIMENT)
    # MLflow's UI opens the experiment on its runs table, not the GenAI traces view.
    assert experiment.tags[EXPERIMENT_KIND_TAG] == MACHINE_LEARNING_KIND
    [run] = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_TAG}`='r1'")
    assert run.data.params["max_steps"] == str(MAX_STEPS)  # the resolved config as params
    assert run.info.status == "FINISHED"
    for metric in ("loss", "lr", "examples_per_second"):
        steps = _steps(client, run.info.run_id, metric)
        assert steps == list(range(1, MAX_STEPS + 1)), (metric, steps)
    commits = _steps(client, run.info.run_id, "checkpoint.step")
    assert commits == [10, 20, 30, 40, 45, 50, 60]
    # Each attempt left its story on the same run: where it restored, how it ended.
    tags = run.data.tags
    # 20 if its background commit landed before the kill, else 10: either way, no step twice.
    assert tags["tracks.attempt.2.restored_step"] in ("10", "20")
    assert tags["tracks.attempt.3.restored_step"] == "45"
    assert tags["tracks.attempt.2"] == "preempted" and tags["tracks.attempt.3"] == "succeeded"
    assert not [key for key in tags if key.startswith("tracks.rollback.")]  # resumes only
    # The link to its newest checkpoint, and the data it trained on (a reference, no copy).
    final = trained.store / "r1" / "step-0000000060-a03"
    assert tags[CHECKPOINT_PATH_TAG] == str(final)
    assert tags[CHECKPOINT_SHA_TAG] == manifest_sha256(final)
    snapshot = open_snapshot(trained.snapshot_dir)
    [dataset_input] = run.inputs.dataset_inputs
    dataset = dataset_input.dataset
    assert dataset.name == snapshot.snapshot_id
    assert snapshot.manifest_sha256.startswith(dataset.digest)
    assert snapshot.manifest_sha256 in dataset.profile
    assert trained.snapshot_dir.resolve().as_uri() in dataset.source
    assert tags["tracks.snapshot_manifest_sha256"] == snapshot.manifest_sha256


def test_the_model_is_logged_into_its_training_run_and_identical_weights_register_nothing(
    trained: Trained,
) -> None:
    """r2 never stopped; r1 was killed and resumed twice: bit-exact resume makes their final
    weights the same bytes, so r2's promotion after r1's is recorded unchanged."""
    tmp = trained.tmp
    settings = TracksSettings(
        home=tmp, ledger_url=f"sqlite:///{tmp / 'ledger.db'}", mlflow_tracking_uri=trained.uri,
        mlflow_artifact_root=tmp / "artifacts", landing_root=tmp / "landing",
        snapshot_root=trained.snapshot_dir.parent, checkpoint_root=trained.store,
        work_root=tmp / "work",
    )  # fmt: skip
    snapshot = open_snapshot(trained.snapshot_dir)
    ledger = open_ledger(tmp / "ledger.db", snapshot.snapshot_id, "r1", "r2")
    finals = {"r1": (3, trained.store / "r1" / "step-0000000060-a03"),
              "r2": (1, trained.store / "r2" / "step-0000000060-a01")}  # fmt: skip
    records = {}
    for run_id, (attempt_no, checkpoint) in finals.items():
        record_committed(ledger, checkpoint, snapshot.snapshot_id)  # as a ledger would hold
        for evaluator in ("holdout_accuracy", "noise_robustness"):
            run_evaluation(checkpoint_dir=checkpoint, snapshot=snapshot, ledger=ledger,
                           settings=settings, evaluator=evaluator, run_id=run_id,
                           attempt_no=attempt_no)  # fmt: skip
        records[run_id] = promote(
            ledger=ledger, settings=settings, run_id=run_id, attempt_no=attempt_no,
            checkpoint_dir=checkpoint, snapshot_id=snapshot.snapshot_id,
            model_name="digits-tracked", gate=QualityGate(min_metrics={}),
        )  # fmt: skip

    crowned, again = records["r1"], records["r2"]
    assert crowned.decision == PromotionDecision.PROMOTED, crowned.reason
    client = MlflowClient(tracking_uri=trained.uri, registry_uri=trained.uri)
    version = client.get_model_version("digits-tracked", crowned.model_version)
    training = training_run_of(client, "r1")
    # The version's source run is r1's training run, where the model was logged as "model".
    assert version.run_id == training
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert (logged.source_run_id, logged.name, logged.status) == (training, "model", "READY")
    info = get_model_info(f"models:/{logged.model_id}")
    assert info.signature is not None and info.saved_input_example_info is not None
    assert len(info.signature.inputs.input_names()) == 64
    served = load_champion(settings, ledger, "digits-tracked")  # every byte verified
    assert served.checkpoint_manifest_sha256 == manifest_sha256(finals["r1"][1])

    # Bit-exact: the preempted run and the straight one trained the same weights.
    assert again.decision == PromotionDecision.UNCHANGED, again.reason
    assert again.reason.startswith("Identical to the champion (version 1, run r1)")
    versions = client.search_model_versions("name='digits-tracked'")
    assert [str(v.version) for v in versions] == ["1"]
