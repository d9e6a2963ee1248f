"""``backend: kubernetes`` for the trainer launcher: the training asset runs on a cluster.

The real ``training_attempt`` is materialized with the trainer resource configured for
Kubernetes, against kmock (a real HTTP Kubernetes API on loopback, see ``tests/kube_support.py``)
whose pods the test moves as a kubelet would. What is asserted is what a person reads later: the
ledger's attempt row (termination reason, detail, placement) and the manifest the API server
received (the attempt's arguments, a ``secretKeyRef`` instead of the ledger URL's password).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import kmock
import pytest
import sqlalchemy as sa

from assets.partitions import snapshot_partitions
from assets.training import training_attempt
from pipeline.checkpoint import layout
from pipeline.data.gate import BLOCKING_CHECKS, CheckVerdict, record_verdict
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import Snapshot, create_snapshot
from pipeline.kube.spec import Backend, trainer_name
from pipeline.ledger import AttemptRecord, Ledger
from pipeline.states import TerminationReason
from resources import LedgerResource, MlflowResource, StorageResource, TrainerLauncherResource
from resources.kube_pipes import KubeApis, TrainJobPipesClient
from resources.launcher import TrainerBackend, TrainerConfigError
from tests.kube_support import (
    EVICTED,
    IMAGE,
    NS,
    RANK0_SUFFIX,
    Cluster,
    kube_apis,
    requests_of,
    running,
    scheduled,
    terminated,
    verdict,
)

R = TerminationReason
PASSWORD = "hunter2-k8s"
PVC = "tracks-home"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    """One checked snapshot for the module: the gate's verdict recorded, not recomputed."""
    root = tmp_path_factory.mktemp("data")
    write_digits_landing(root / "landing")
    snap = create_snapshot(root / "landing", root / "snapshots")
    # The data checks are tested elsewhere; here they only have to have passed.
    verdicts = [
        CheckVerdict(check=c, blocking=True, passed=True, summary="ok") for c in BLOCKING_CHECKS
    ]
    record_verdict(snap, verdicts, snapshot_root=root / "snapshots")
    return snap


@pytest.fixture
def apis(kmock: kmock.KubernetesEmulator) -> KubeApis:
    return kube_apis(kmock)


def _kube_config(home: Path, **changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "backend": "kubernetes",
        "image": IMAGE,
        "namespace": NS,
        "nnodes": 2,
        "nproc_per_node": 4,
        "gpus": 4,
        "memory": "16Gi",
        "checkpoint_pvc": PVC,
        # The step's TRACKS_HOME is where both the step pod and the trainer pods mount the claim.
        "checkpoint_mount_path": str(home),
        "service_account": "tracks-trainer",
    }
    return {**config, **changes}


async def _materialize(
    home: Path,
    snapshot: Snapshot,
    ledger_url: str,
    trainer_config: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    client: Callable[[], TrainJobPipesClient] | None = None,
) -> dg.ExecuteInProcessResult:
    """``training_attempt`` for ``snapshot``, its trainer resource configured by run config."""

    def kube_client(self: TrainerLauncherResource) -> TrainJobPipesClient:
        if client is None:
            raise AssertionError("no Kubernetes API may be called in this test")
        return client()

    # The one seam: the resource's client, with the mock API and the scripted kubelet's clock.
    monkeypatch.setattr(TrainerLauncherResource, "kube_client", kube_client)
    resources = {
        "ledger": LedgerResource(url=ledger_url),
        "storage": StorageResource(
            landing_root=str(home / "landing"),
            snapshot_root=str(snapshot.path.parent),
            checkpoint_root=str(home / "checkpoints"),
            work_root=str(home / "work"),
        ),
        "mlflow": MlflowResource(
            tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "mlartifacts")
        ),
        "trainer": TrainerLauncherResource(),
    }
    run_config = {
        # One attempt's receipt per test: a preempted one fails its step, never continued in
        # place (the scripted cluster plays one workload).
        "ops": {
            "training_attempt": {"config": {"train": {"max_steps": 20}, "continue_in_run": False}}
        },
        "resources": {"trainer": {"config": trainer_config}},
    }
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(snapshot_partitions.name, [snapshot.snapshot_id])
    # Synchronous Dagster in a thread: the mock API server runs on this test's event loop.
    return await asyncio.to_thread(
        dg.materialize,
        [training_attempt],
        instance=instance,
        partition_key=snapshot.snapshot_id,
        resources=resources,
        run_config=run_config,
        raise_on_error=False,
    )


def _client(cluster: Cluster) -> Callable[[], TrainJobPipesClient]:
    return lambda: TrainJobPipesClient(apis=cluster.apis, poll_interval=0.0, sleeper=cluster.sleep)


def _only_attempt(ledger_url: str, snapshot: Snapshot) -> AttemptRecord:
    ledger = Ledger.open(ledger_url)
    [run] = ledger.find_runs(snapshot_id=snapshot.snapshot_id)
    [attempt] = ledger.attempts(run.run_id)
    return attempt


def _failure(result: dg.ExecuteInProcessResult) -> str:
    [failure] = result.get_step_failure_events()
    return failure.step_failure_data.error.message


def _created(server: kmock.KubernetesEmulator, kind: str) -> dict[str, Any]:
    [created] = [r.data for r in requests_of(server, "POST") if r.data.get("kind") == kind]
    return created


# -- run config, refused before an attempt opens ----------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"image": "registry.example/tracks:latest"}, "image"),
        ({"image": None}, "image"),
        ({"namespace": "Train_NS"}, "namespace"),
        ({"workload": "trainjobs"}, "workload"),
        ({"cpu": "four"}, "cpu"),
        ({"gpus": -1}, "gpus"),
        ({"nnodes": 0}, "nnodes"),
        ({"checkpoint_pvc": None}, "checkpoint_pvc"),
        ({"checkpoint_mount_path": "checkpoints"}, "checkpoint_mount_path"),
        ({"service_account": "Trainer!"}, "service_account"),
        ({"secret_env": {"TRACKS_LEDGER_URL": {"secret": "Ledger_Secret", "key": "url"}}},
         "secret_env"),
        ({"secret_env": {"TRACKS_LEDGER_URL": {"secret": "tracks-ledger", "key": "db/url"}}},
         "secret_env"),
        ({"termination_grace_seconds": 0.0}, "termination_grace_seconds"),
        ({"poll_interval_seconds": 0.0}, "poll_interval_seconds"),
        ({"backend": "torchrun", "nnodes": 2}, "nnodes"),
    ],
)  # fmt: skip
def test_a_bad_kubernetes_field_is_refused_naming_it(
    tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    config = _kube_config(tmp_path, **changes)
    with pytest.raises(TrainerConfigError) as refused:
        TrainerLauncherResource(**config).world()
    assert refused.value.field == field
    assert f"resources.trainer.config.{field}" in str(refused.value)


def test_an_inline_credential_is_refused_naming_the_variable_never_the_value(
    tmp_path: Path,
) -> None:
    env = {"TRACKS_LEDGER_URL": f"postgresql://tracks:{PASSWORD}@db:5432/ledger"}
    with pytest.raises(TrainerConfigError) as refused:
        TrainerLauncherResource(**_kube_config(tmp_path)).world(env)
    said = str(refused.value)
    assert refused.value.field == "secret_env"
    assert "TRACKS_LEDGER_URL" in said and "resources.trainer.config.secret_env" in said
    assert PASSWORD not in said and "db:5432" not in said
    # With a Secret named for it, the same environment is fine: 2 nodes x 4 ranks.
    ref = {"TRACKS_LEDGER_URL": {"secret": "tracks-ledger", "key": "url"}}
    resource = TrainerLauncherResource(**_kube_config(tmp_path, secret_env=ref))
    assert resource.world(env) == (TrainerBackend.KUBERNETES, 8)


@pytest.mark.asyncio
async def test_a_bad_field_in_run_config_fails_the_step_before_any_attempt_row(
    tracks_home: Path, snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger_url = f"sqlite:///{tracks_home / 'ledger.db'}"
    config = _kube_config(tracks_home, namespace="Train_NS")

    result = await _materialize(tracks_home, snapshot, ledger_url, config, monkeypatch)

    assert not result.success
    assert "resources.trainer.config.namespace" in _failure(result)
    assert Ledger.open(ledger_url).list_attempts() == []


# -- an attempt on the cluster, closed with what the cluster saw ------------------------------


@pytest.mark.asyncio
@pytest.mark.postgres
async def test_rank0_exit_75_is_a_preempted_attempt_and_the_trainjob_holds_no_password(
    tracks_home: Path,
    snapshot: Snapshot,
    make_pg_database: Callable[[], str],
    kmock: kmock.KubernetesEmulator,
    apis: KubeApis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A ledger URL with a password (the local server trusts loopback, so it still connects).
    ledger_url = (
        sa.engine.make_url(make_pg_database())
        .set(password=PASSWORD)
        .render_as_string(hide_password=False)
    )
    secret = {"TRACKS_LEDGER_URL": {"secret": "tracks-ledger", "key": "url"}}
    cluster = Cluster(apis, None, Backend.TRAINJOB)
    said = verdict("preempted", 75, "SIGTERM at step 1200; checkpoint step 1200 committed")
    bound = [scheduled("2026-01-01T00:02:00Z")]  # and the container ended at 00:10:00
    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        lambda: cluster.move_rank0(
            phase="Failed", state=terminated(75, "Error", said), conditions=bound
        )
    )

    result = await _materialize(
        tracks_home,
        snapshot,
        ledger_url,
        _kube_config(tracks_home, secret_env=secret),
        monkeypatch,
        _client(cluster),
    )

    assert not result.success  # a preempted attempt fails its step; the resume sensor goes on
    attempt = _only_attempt(ledger_url, snapshot)
    assert (attempt.termination_reason, attempt.exit_code) == ("preempted", 75)
    assert "SIGTERM at step 1200" in attempt.termination_detail  # the launcher's own words
    assert (attempt.retry_decision or {}).get("action") == "resume"
    name = trainer_name(attempt.run_id, 1, 2)
    placement = attempt.placement or {}
    assert placement["launcher"] == "kubernetes"
    assert (placement["pod"], placement["node"]) == (f"{name}{RANK0_SUFFIX}", "gpu-node-7")
    assert (placement["namespace"], placement["workload"]) == (NS, f"TrainJob/{name}")
    assert placement["image_digest"] == IMAGE.rsplit("@", 1)[1]
    assert (placement["accelerator_type"], placement["accelerator_count"]) == (
        "nvidia.com/gpu",
        8,
    )
    # 8 GPUs held from the pod's scheduling to the container's end (8 minutes), whatever the
    # step waited before; not the step pod's none.
    assert attempt.gpu_seconds == 8 * 480.0
    assert placement["scheduled_at"] == "2026-01-01T00:02:00+00:00"

    trainjob = _created(kmock, "TrainJob")
    assert trainjob["metadata"]["name"] == name
    trainer = trainjob["spec"]["trainer"]
    work = Path(tracks_home / "work")
    config_path = layout.run_dir(work, attempt.run_id) / f"config-{attempt.config_sha256[:12]}.yaml"
    assert trainer["args"] == [
        "--config", str(config_path),
        "--run-id", attempt.run_id,
        "--store", str(tracks_home / "checkpoints"),
        "--attempt-no", "1",
        "--fencing-token", str(attempt.fencing_token),
    ]  # fmt: skip
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"
    env = {e["name"]: e for e in trainer["env"]}
    assert env["TRACKS_LEDGER_URL"] == {
        "name": "TRACKS_LEDGER_URL",
        "valueFrom": {"secretKeyRef": {"name": "tracks-ledger", "key": "url"}},
    }
    assert env["TRACKS_MLFLOW_URI"]["value"].startswith("sqlite:///")
    [patch] = trainjob["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]
    pod_spec = pod["spec"]["template"]["spec"]
    assert pod_spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": PVC}
    assert pod_spec["serviceAccountName"] == "tracks-trainer"
    # Nothing the API server received holds the password, or even the ledger's address.
    sent = json.dumps([r.data for r in requests_of(kmock, "POST")])
    assert PASSWORD not in sent
    assert sa.engine.make_url(ledger_url).database not in sent


@pytest.mark.asyncio
async def test_an_evicted_pod_is_a_preempted_attempt_that_names_the_eviction(
    tracks_home: Path,
    snapshot: Snapshot,
    kmock: kmock.KubernetesEmulator,
    apis: KubeApis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger_url = f"sqlite:///{tracks_home / 'ledger.db'}"
    cluster = Cluster(apis, None, Backend.INDEXED_JOB)
    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        lambda: cluster.move_rank0(**EVICTED)
    )
    config = _kube_config(tracks_home, workload="indexed_job")

    result = await _materialize(
        tracks_home, snapshot, ledger_url, config, monkeypatch, _client(cluster)
    )

    assert not result.success
    attempt = _only_attempt(ledger_url, snapshot)
    # torchrun exited 1 on SIGTERM; only the pod status says the platform took it away.
    assert (attempt.termination_reason, attempt.exit_code) == ("preempted", 1)
    detail = attempt.termination_detail
    assert "TerminationByKubelet" in detail and "low on resource: memory" in detail
    assert "No checkpoint was committed" in detail
    assert (attempt.placement or {})["workload"] == f"Job/{trainer_name(attempt.run_id, 1, 2)}"
    assert "preempted" in _failure(result)
    # An inline SQLite URL has nothing to hide: it is passed as a value.
    job = _created(kmock, "Job")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TRACKS_LEDGER_URL"]["value"] == ledger_url


@pytest.mark.asyncio
async def test_a_graceful_save_on_eviction_keeps_the_launchers_words_and_names_the_eviction(
    tracks_home: Path,
    snapshot: Snapshot,
    apis: KubeApis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger_url = f"sqlite:///{tracks_home / 'ledger.db'}"
    cluster = Cluster(apis, None, Backend.TRAINJOB)
    said = verdict("preempted", 75, "SIGTERM at step 40; checkpoint step 40 committed")
    saved = {**EVICTED, "state": terminated(75, "Error", said)}
    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        lambda: cluster.move_rank0(**saved)
    )

    result = await _materialize(
        tracks_home, snapshot, ledger_url, _kube_config(tracks_home), monkeypatch, _client(cluster)
    )

    assert not result.success
    attempt = _only_attempt(ledger_url, snapshot)
    assert (attempt.termination_reason, attempt.exit_code) == ("preempted", 75)
    detail = attempt.termination_detail
    assert "SIGTERM at step 40" in detail and "TerminationByKubelet" in detail


@pytest.mark.asyncio
async def test_an_oomkilled_container_is_an_oom_attempt_though_torchrun_exited_1(
    tracks_home: Path,
    snapshot: Snapshot,
    apis: KubeApis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger_url = f"sqlite:///{tracks_home / 'ledger.db'}"
    cluster = Cluster(apis, None, Backend.JOBSET)
    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        lambda: cluster.move_rank0(phase="Failed", state=terminated(1, "OOMKilled"))
    )
    config = _kube_config(tracks_home, workload="jobset")

    result = await _materialize(
        tracks_home, snapshot, ledger_url, config, monkeypatch, _client(cluster)
    )

    assert not result.success
    attempt = _only_attempt(ledger_url, snapshot)
    assert (attempt.termination_reason, attempt.exit_code) == ("oom", 1)
    assert "OOMKilled" in attempt.termination_detail and "16Gi" in attempt.termination_detail
    # The same config would be killed again: the policy stops rather than retry it unchanged.
    assert (attempt.retry_decision or {}).get("action") == "stop"


@pytest.mark.asyncio
async def test_a_workload_the_api_refuses_closes_the_attempt_naming_the_refusal(
    tracks_home: Path,
    snapshot: Snapshot,
    kmock: kmock.KubernetesEmulator,
    apis: KubeApis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger_url = f"sqlite:///{tracks_home / 'ledger.db'}"
    refusal = {"kind": "Status", "message": 'trainjobs is forbidden: User "tracks" cannot create'}
    kmock[f"post /apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"] << 403 << refusal
    cluster = Cluster(apis, None, Backend.TRAINJOB)

    result = await _materialize(
        tracks_home, snapshot, ledger_url, _kube_config(tracks_home), monkeypatch, _client(cluster)
    )

    assert not result.success
    attempt = _only_attempt(ledger_url, snapshot)
    assert attempt.termination_reason == "user_code_error" and attempt.exit_code is None
    assert "403" in attempt.termination_detail and "forbidden" in attempt.termination_detail
    assert "not launched" in attempt.termination_detail


@pytest.mark.asyncio
async def test_storage_outside_the_shared_volume_is_refused_before_any_workload(
    tracks_home: Path, snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger_url = f"sqlite:///{tracks_home / 'ledger.db'}"
    config = _kube_config(tracks_home, checkpoint_mount_path="/mnt/tracks")

    result = await _materialize(tracks_home, snapshot, ledger_url, config, monkeypatch)

    assert not result.success
    attempt = _only_attempt(ledger_url, snapshot)
    assert attempt.termination_reason == "user_code_error"
    assert "checkpoint_mount_path is /mnt/tracks" in attempt.termination_detail
    assert str(tracks_home / "work") in attempt.termination_detail


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0, 0.0, 3601.0])
def test_a_grace_period_that_cannot_end_in_a_final_save_is_refused_on_every_backend(
    grace: float,
) -> None:
    """NaN or inf never escalates to SIGKILL; 0 or less kills before the final save."""
    for backend in ("local", "torchrun"):
        resource = TrainerLauncherResource(backend=backend, termination_grace_seconds=grace)
        with pytest.raises(TrainerConfigError) as refused:
            resource.world()
        assert refused.value.field == "termination_grace_seconds"
