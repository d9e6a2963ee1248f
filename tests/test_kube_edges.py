"""Edges of the Kubernetes config: where the claim is mounted, how much a node asks for, and a
rank 0 the scheduler cannot place.

Each case was reproduced on the code before the fix: a checkpoint_mount_path of ``/``, ``/etc``,
``/usr/lib/python3.11/site-packages`` or the service-account token folder rendered as given;
``cpu: "5000"``, ``memory: 40Ti`` or 100 GPUs per node were accepted; and a pod the scheduler
called Unschedulable was waited on for the whole hour-long start timeout, its reason said only
then. The cluster is kmock's emulator played by ``tests/kube_support.Cluster``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import dagster as dg
import kmock
import pytest

from pipeline.kube.spec import Backend, InvalidTrainerSpecError, NodeResources, TrainerSpec
from pipeline.states import TerminationReason
from resources.kube_pipes import KubeApis, KubeTrainerExit, TrainJobPipesClient
from resources.launcher import TrainerConfigError, TrainerLauncherResource
from tests.kube_support import (
    IMAGE,
    NS,
    Cluster,
    kube_apis,
    requests_of,
    running,
    terminated,
    verdict,
    waiting,
)

PVC = "tracks-checkpoints"
SCHEDULER_SAYS = (
    "0/12 nodes are available: 4 Insufficient nvidia.com/gpu, 8 node(s) had untolerated taint "
    "{pool: cpu}. preemption: 0/12 nodes are available: 12 No preemption victims found."
)


def _spec(**changes: Any) -> TrainerSpec:
    fields: dict[str, Any] = {
        "name": "tr-demo-a1",
        "namespace": NS,
        "image": IMAGE,
        "nnodes": 2,
        "nproc_per_node": 2,
        "checkpoint_pvc": PVC,
        **changes,
    }
    return TrainerSpec(**fields)


def _launcher(**changes: Any) -> TrainerLauncherResource:
    config: dict[str, Any] = {
        "backend": "kubernetes",
        "image": IMAGE,
        "namespace": NS,
        "nnodes": 2,
        "nproc_per_node": 4,
        "gpus": 4,
        "checkpoint_pvc": PVC,
        "checkpoint_mount_path": "/mnt/tracks",
        **changes,
    }
    return TrainerLauncherResource(**config)


# -- where the claim is mounted ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("/", "'/'"),
        ("//", "'/'"),
        ("/etc", "/etc (a system folder)"),
        ("//etc/./", "/etc (a system folder)"),
        ("/usr/local/lib/python3.11", "/usr (a system folder)"),
        ("/usr/lib/python3/dist-packages", "dist-packages"),
        ("/home/tracks/.venv/lib/python3.11/site-packages", "site-packages"),
        ("/opt", "/opt/conda (conda's Python prefix)"),
        ("/opt/conda/lib", "/opt/conda (conda's Python prefix)"),
        ("/opt/tracks", "/opt/tracks (the image's code folder)"),
        ("/var", "/var/run/secrets (the service-account token folder)"),
        ("/var/lib", "/var (a system folder)"),
        ("/var/run/secrets/kubernetes.io/serviceaccount", "service-account token folder"),
        ("/run/secrets/kubernetes.io/serviceaccount", "service-account token folder"),
        ("/dev/shm", "/dev (a system folder)"),
        ("/proc/self", "/proc (a system folder)"),
        ("/root", "/root (a system folder)"),
    ],
)
def test_a_mount_over_the_system_python_or_token_folders_is_refused_naming_the_field(
    path: str, named: str
) -> None:
    with pytest.raises(InvalidTrainerSpecError) as refused:
        _spec(checkpoint_mount_path=path)
    assert refused.value.field == "checkpoint_mount_path"
    assert "TrainerSpec.checkpoint_mount_path" in str(refused.value)
    assert named in str(refused.value)
    with pytest.raises(TrainerConfigError) as config_refused:
        _launcher(checkpoint_mount_path=path).world()
    assert config_refused.value.field == "checkpoint_mount_path"
    assert "resources.trainer.config.checkpoint_mount_path" in str(config_refused.value)


def test_an_absolute_interpreters_prefix_is_refused_and_folders_of_their_own_are_not() -> None:
    with pytest.raises(InvalidTrainerSpecError, match=r"/opt/venv \(the prefix of") as refused:
        _spec(python="/opt/venv/bin/python", checkpoint_mount_path="/opt/venv/checkpoints")
    assert refused.value.field == "checkpoint_mount_path"
    # The image's own TRACKS_HOME (deploy/Dockerfile) is under /var but hides nothing.
    for path in ("/checkpoints", "/mnt/tracks", "/srv/tracks", "/var/lib/tracks", "/tmp/ckpt"):
        spec = _spec(python="/opt/venv/bin/python", checkpoint_mount_path=path)
        assert spec.checkpoint_mount_path == path


# -- how much a node asks for --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field", "bound"),
    [
        ({"cpu": "5000"}, "cpu", "at most 512 cores"),
        ({"cpu": "600000m"}, "cpu", "at most 512 cores"),
        ({"cpu": "0"}, "cpu", "more than 0"),
        ({"memory": "40Ti"}, "memory", "from 128Mi to 4Ti"),
        ({"memory": "5e12"}, "memory", "from 128Mi to 4Ti"),
        ({"memory": "1Mi"}, "memory", "from 128Mi to 4Ti"),
        ({"gpus": 100}, "gpus", "from 0 to 16"),
    ],
)
def test_a_node_asking_past_the_bounds_is_refused_stating_them(
    changes: dict[str, Any], field: str, bound: str
) -> None:
    with pytest.raises(InvalidTrainerSpecError) as refused:
        NodeResources(**changes)
    assert refused.value.field == f"resources.{field}" and bound in str(refused.value)
    with pytest.raises(TrainerConfigError) as config_refused:
        _launcher(**changes).world()
    assert config_refused.value.field == field
    assert f"resources.trainer.config.{field}" in str(config_refused.value)
    assert bound in str(config_refused.value)


def test_ranks_per_node_are_bounded_as_the_run_config_bounds_them() -> None:
    with pytest.raises(InvalidTrainerSpecError, match="from 1 to 64") as refused:
        _spec(nproc_per_node=65)
    assert refused.value.field == "nproc_per_node"
    assert _spec(nproc_per_node=64, nnodes=1024).nproc_per_node == 64


# -- a rank 0 the scheduler cannot place -----------------------------------------------------------


def _unschedulable() -> dict[str, Any]:
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": SCHEDULER_SAYS,
        "lastTransitionTime": "2026-01-01T00:00:01Z",
    }
    return {"phase": "Pending", "state": waiting(), "conditions": [condition]}


async def _run(
    cluster: Cluster, ticks: list[float], **client_kwargs: Any
) -> tuple[dg.ExecuteInProcessResult, KubeTrainerExit | None]:
    outcomes: list[KubeTrainerExit] = []
    clock = iter(ticks)
    client = TrainJobPipesClient(
        apis=cluster.apis,
        poll_interval=0.0,
        sleeper=cluster.sleep,
        clock=lambda: float(next(clock)),
        **client_kwargs,
    )

    @dg.asset
    # Unannotated: dagster checks the hint, and this module's annotations are strings.
    def trained_model(context) -> dg.MaterializeResult:
        invocation, outcome = client.run(context=context, spec=cluster.spec, extras={})
        outcomes.append(outcome)
        return invocation.get_materialize_result()

    result = await asyncio.to_thread(dg.materialize, [trained_model], raise_on_error=False)
    return result, (outcomes[0] if outcomes else None)


@pytest.fixture
def apis(kmock: kmock.KubernetesEmulator) -> KubeApis:
    return kube_apis(kmock)


@pytest.mark.asyncio
async def test_an_unschedulable_rank0_ends_the_attempt_within_minutes_quoting_the_scheduler(
    kmock: kmock.KubernetesEmulator, apis: KubeApis
) -> None:
    cluster = Cluster(apis, _spec(), Backend.TRAINJOB)
    cluster.then(lambda: cluster.create_pods(waiting()))
    for _ in range(40):
        cluster.then(lambda: cluster.move_rank0(**_unschedulable()))
    # A minute per poll; the default start timeout (an hour) would take 60 of them.
    result, outcome = await _run(cluster, [60.0 * i for i in range(100)])

    assert result.success and outcome is not None
    assert outcome.reason == TerminationReason.INFRA_TRANSIENT and outcome.returncode is None
    assert f'saying "{SCHEDULER_SAYS.rstrip(".")}"' in outcome.detail
    assert "could not be scheduled" in outcome.detail and "for 300s" in outcome.detail
    assert "did not start within" not in outcome.detail
    assert cluster.sleeps <= 8, outcome.detail  # five minutes of one-minute polls, not sixty
    assert requests_of(kmock, "PATCH")[-1].data == {"spec": {"suspend": True}}
    assert outcome.observed().accelerator_wall_seconds == 0.0  # never bound: no GPU held


@pytest.mark.asyncio
async def test_a_rank0_placed_before_its_unschedulable_timeout_runs_on(
    kmock: kmock.KubernetesEmulator, apis: KubeApis
) -> None:
    cluster = Cluster(apis, _spec(), Backend.TRAINJOB)
    done = terminated(0, "Completed", verdict("succeeded", 0, "final checkpoint at step 20"))
    cluster.then(lambda: cluster.create_pods(waiting()))
    for _ in range(6):  # six minutes unschedulable: an autoscaler adding a node
        cluster.then(lambda: cluster.move_rank0(**_unschedulable()))
    cluster.then(lambda: cluster.move_rank0(phase="Running", state=running()))
    cluster.then(lambda: cluster.move_rank0(phase="Succeeded", state=done))

    result, outcome = await _run(
        cluster, [60.0 * i for i in range(100)], unschedulable_timeout=600.0
    )

    assert result.success and outcome is not None and outcome.succeeded, outcome


def test_the_unschedulable_timeout_is_run_config_and_must_be_positive() -> None:
    assert _launcher(unschedulable_timeout_seconds=120.0).kube_client().unschedulable_timeout == 120
    with pytest.raises(TrainerConfigError) as refused:
        _launcher(unschedulable_timeout_seconds=0.0).world()
    assert refused.value.field == "unschedulable_timeout_seconds"
    assert "resources.trainer.config.unschedulable_timeout_seconds" in str(refused.value)
