"""One training config: the trainer's ``TrainConfig``, whole, is ``training_attempt``'s run config.

Reproduced on main before the change: the run config restated 11 of TrainConfig's fields by
hand, so ``device``, ``lr_schedule``, ``log_every_steps``, ``async_save``, ``keep_best_k``,
``probe_size`` and the rest could not be set for a new run from the launchpad, and a run given
GPUs on the Kubernetes backend trained with device "cpu".
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import dagster as dg
import kmock
import pytest
import yaml

from definitions import build_definitions
from pipeline.data.gate import BLOCKING_CHECKS as CHECKS
from pipeline.data.gate import CheckVerdict, record_verdict
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from pipeline.states import TerminationReason
from pipeline.trainer.config import TrainConfig, field_docs
from tests.dagster_dev import REPO_ROOT
from tests.kube_support import IMAGE, NS, requests_of
from tests.receipt_support import make_snapshot, seed_ended_run, train_alone


@pytest.fixture
def settings(tracks_home: Path) -> TracksSettings:
    return TracksSettings.from_env()


def _train_section(settings: TracksSettings) -> dg.Shape:
    """``ops.training_attempt.config.train`` of the job's run-config schema: what the launchpad
    renders and checks a launch against."""
    job = build_definitions(settings).resolve_implicit_global_asset_job_def()
    ops = job.run_config_schema.config_type.fields["ops"].config_type
    attempt = ops.fields["training_attempt"].config_type.fields["config"].config_type
    return attempt.fields["train"].config_type


def _every_field(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, owning dataclass, field name) for every field of ``cls``, recursively."""
    found = []
    for spec in dataclasses.fields(cls):
        found.append((f"{prefix}{spec.name}", cls, spec.name))
        if isinstance(spec.default_factory, type) and dataclasses.is_dataclass(
            spec.default_factory
        ):
            found += _every_field(spec.default_factory, f"{prefix}{spec.name}.")
    return found


def test_the_launchpad_offers_every_trainer_field_but_snapshot_dir_with_its_docstring(
    settings: TracksSettings,
) -> None:
    section = _train_section(settings)
    keys = _every_field(TrainConfig)
    assert len(keys) > 25  # the nested sections were walked
    for key, cls, name in keys:
        if key == "snapshot_dir":
            assert "snapshot_dir" not in section.fields  # the partition decides it
            continue
        shape = section
        *parents, _ = key.split(".")
        for parent in parents:
            shape = shape.fields[parent].config_type
        assert name in shape.fields, f"train.{key} cannot be set from run config"
        offered = shape.fields[name]
        # Optional with no Dagster default: a key left out takes TrainConfig's default.
        assert not offered.is_required and not offered.default_provided, key
        doc = field_docs(cls)[name]
        assert doc and offered.description.startswith(doc), (key, offered.description)


def test_snapshot_dir_in_run_config_is_refused_naming_the_key(settings: TracksSettings) -> None:
    job = build_definitions(settings).resolve_implicit_global_asset_job_def()
    train = {"max_steps": 5, "snapshot_dir": "/tmp/elsewhere"}
    with pytest.raises(dg.DagsterInvalidConfigError, match="snapshot_dir"):
        dg.validate_run_config(job, {"ops": {"training_attempt": {"config": {"train": train}}}})


def _doc_run_configs() -> list[dict[str, Any]]:
    """Every run config docs/configuration.md shows (its ```yaml blocks that start at ops:)."""
    doc = (REPO_ROOT / "docs" / "configuration.md").read_text()
    blocks = [part.split("```", 1)[0] for part in doc.split("```yaml\n")[1:]]
    return [yaml.safe_load(block) for block in blocks if block.startswith("ops:")]


def test_the_run_configs_the_docs_show_are_valid_and_the_detectors_example_says_its_defaults(
    settings: TracksSettings,
) -> None:
    job = build_definitions(settings).resolve_implicit_global_asset_job_def()
    configs = _doc_run_configs()
    assert len(configs) >= 2, "the docs' run configs were not found"
    for config in configs:
        assert dg.validate_run_config(job, config)
    [detectors] = [
        c for c in configs if "spikes" in c["ops"]["training_attempt"]["config"]["train"]
    ]
    train = detectors["ops"]["training_attempt"]["config"]["train"]
    # The example names every key of both sections, each at its default but the two it changes.
    defaults = TrainConfig(snapshot_dir=Path("/unused"))
    for section, changed in (("spikes", {"action", "ratio"}), ("watchdog", set())):
        default = dataclasses.asdict(getattr(defaults, section))
        shown = train[section]
        assert set(shown) | {"enabled"} == set(default), section
        assert {k for k, v in shown.items() if v != default[k]} == changed, section


# Non-default values of fields the hand-written run config lacked (and of a nested section).
SET = {
    "max_steps": 4,
    "checkpoint_every_steps": 2,
    "model": {"channels": 8, "hidden": 32},
    "device": "cuda",
    "lr_schedule": {"kind": "step", "step_size": 2, "gamma": 0.9},
    "log_every_steps": 1,
    "async_save": False,
    "keep_best_k": 2,
    "probe_size": 4,
    "best_mode": "max",
    "best_metric": "eval_accuracy",
}


@pytest.mark.slow
def test_fields_the_old_run_config_lacked_reach_the_attempts_config_snapshot(
    settings: TracksSettings,
) -> None:
    import torch

    snapshot = make_snapshot(settings)
    with dg.DagsterInstance.get() as instance:
        result = train_alone(settings, instance, snapshot.snapshot_id, {"train": SET})
    ledger = Ledger.open(settings.ledger_url)
    [attempt] = ledger.list_attempts()
    recorded = attempt.config_snapshot
    for key, value in SET.items():
        if isinstance(value, dict):
            assert {k: recorded[key][k] for k in value} == value, key
        else:
            assert recorded[key] == value, key
    assert recorded["momentum"] == TrainConfig.momentum  # left out: TrainConfig's own default
    if not torch.cuda.is_available():
        # The trainer was asked for CUDA on a machine without it, and says so.
        assert not result.success and attempt.termination_reason == "user_code_error"
        assert "device" in attempt.termination_detail, attempt.termination_detail


@pytest.mark.slow
def test_a_continued_run_takes_its_last_config_and_changes_what_train_sets(
    settings: TracksSettings,
) -> None:
    snapshot = make_snapshot(settings)
    ledger = Ledger.open(settings.ledger_url)
    run_id = "digits-cnn-continued"
    first = seed_ended_run(
        ledger, snapshot, run_id, TerminationReason.PREEMPTED, dagster_run_id="dr-1"
    ).config_snapshot
    changes = {"max_steps": 6, "log_every_steps": 3, "model": {"dropout": 0.25}}
    with dg.DagsterInstance.get() as instance:
        result = train_alone(
            settings, instance, snapshot.snapshot_id, {"run_id": run_id, "train": changes}
        )
    assert result.success
    second = ledger.get_attempt(run_id, 2).config_snapshot
    assert (second["max_steps"], second["log_every_steps"]) == (6, 3)
    assert second["model"] == {**first["model"], "dropout": 0.25}
    assert {k: v for k, v in second.items() if k not in changes} == {
        k: v for k, v in first.items() if k not in changes
    }


# -- the device follows the placement ------------------------------------------------------


@pytest.mark.asyncio
async def test_a_kubernetes_run_given_gpus_trains_on_cuda_unless_run_config_says_otherwise(
    tracks_home: Path, kmock: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TrainJob is refused (403) once posted: what was posted, and the config file its
    arguments name, are what the cluster would have run. The op config sets nothing."""
    from assets.partitions import snapshot_partitions
    from assets.training import training_attempt
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot
    from resources import LedgerResource, MlflowResource, StorageResource, TrainerLauncherResource
    from resources.kube_pipes import TrainJobPipesClient
    from tests.kube_support import kube_apis

    write_digits_landing(tracks_home / "landing")
    snapshot = create_snapshot(tracks_home / "landing", tracks_home / "snapshots")
    # The data checks are tested elsewhere; here they only have to have passed.
    passed = [CheckVerdict(check=c, blocking=True, passed=True, summary="") for c in CHECKS]
    record_verdict(snapshot, passed, snapshot_root=tracks_home / "snapshots")
    refusal = {"kind": "Status", "message": "trainjobs is forbidden"}
    kmock[f"post /apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"] << 403 << refusal
    apis = kube_apis(kmock)
    monkeypatch.setattr(
        TrainerLauncherResource, "kube_client", lambda self: TrainJobPipesClient(apis=apis)
    )
    ledger_url = f"sqlite:///{tracks_home / 'ledger.db'}"
    trainer = {
        "backend": "kubernetes", "image": IMAGE, "namespace": NS, "gpus": 1,
        "checkpoint_pvc": "tracks-home", "checkpoint_mount_path": str(tracks_home),
    }  # fmt: skip

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(snapshot_partitions.name, [snapshot.snapshot_id])

    def launch(ops: dict[str, Any]) -> dict[str, Any]:
        """Materialize with ``ops`` as training_attempt's config; the trainer config file the
        posted TrainJob's arguments name."""
        dg.materialize(
            [training_attempt],
            instance=instance,
            partition_key=snapshot.snapshot_id,
            resources={
                "ledger": LedgerResource(url=ledger_url),
                "storage": StorageResource(
                    landing_root=str(tracks_home / "landing"),
                    snapshot_root=str(tracks_home / "snapshots"),
                    checkpoint_root=str(tracks_home / "checkpoints"),
                    work_root=str(tracks_home / "work"),
                ),
                "mlflow": MlflowResource(
                    tracking_uri=f"sqlite:///{tracks_home / 'mlflow.db'}",
                    artifact_root=str(tracks_home / "mlartifacts"),
                ),
                "trainer": TrainerLauncherResource(),
            },
            run_config={
                "ops": {"training_attempt": {"config": ops}} if ops else {},
                "resources": {"trainer": {"config": trainer}},
            },
            raise_on_error=False,
        )
        posted = [r.data for r in requests_of(kmock, "POST") if r.data.get("kind") == "TrainJob"]
        spec = posted[-1]["spec"]["trainer"]
        assert spec["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "1"
        args = spec["args"]
        return yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())

    # Synchronous Dagster in a thread: the mock API server runs on this test's event loop.
    assert (await asyncio.to_thread(launch, {}))["device"] == "cuda"
    # An explicit device wins over the placement.
    explicit = await asyncio.to_thread(launch, {"train": {"device": "cpu"}})
    assert explicit["device"] == "cpu"
    recorded = [a.config_snapshot["device"] for a in Ledger.open(ledger_url).list_attempts()]
    assert sorted(recorded) == ["cpu", "cuda"]
