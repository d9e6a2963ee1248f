"""The Kubernetes Pipes client against a real HTTP Kubernetes API on loopback (kmock), and the
pure pod-ending rules it relies on.

kmock's ``KubernetesEmulator`` stores what is POSTed, PATCHed and DELETEd and serves it back; no
controller runs in it. The tests play the controllers through the same API: each time the client
sleeps between polls, the next scripted step creates or moves a pod (``Cluster``). The client
runs inside a real ``dg.materialize`` in a worker thread (it is synchronous, and the mock server
lives on the test's event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import dagster as dg
import kmock
import pytest
from dagster._core.errors import DagsterExecutionInterruptedError

from pipeline.kube import endings
from pipeline.kube.spec import Backend, TrainerSpec
from pipeline.states import TerminationReason
from resources.kube_pipes import KubeApis, KubeTrainerExit, TrainJobPipesClient
from tests.kube_support import (
    EVICTED,
    IMAGE,
    NS,
    Cluster,
    api_pod,
    kube_apis,
    requests_of,
    running,
    scheduled,
    terminated,
    verdict,
    waiting,
)

R = TerminationReason


def _spec(nnodes: int = 2) -> TrainerSpec:
    return TrainerSpec(
        name="tr-demo-a1",
        namespace=NS,
        image=IMAGE,
        args=("--run-id", "demo", "--attempt", "1"),
        nnodes=nnodes,
        nproc_per_node=2,
        checkpoint_pvc="tracks-checkpoints",
    )


@pytest.fixture
def apis(kmock: kmock.KubernetesEmulator) -> KubeApis:
    return kube_apis(kmock)


async def _materialize(
    cluster: Cluster, *, clock: Callable[[], float] | None = None, **client_kwargs: Any
) -> tuple[dg.ExecuteInProcessResult, KubeTrainerExit | None]:
    outcomes: list[KubeTrainerExit] = []
    client = TrainJobPipesClient(
        apis=cluster.apis,
        poll_interval=0.0,
        sleeper=cluster.sleep,
        **({"clock": clock} if clock else {}),
        **client_kwargs,
    )

    @dg.asset
    # Unannotated: dagster checks the hint, and this module's annotations are strings.
    def trained_model(context) -> dg.MaterializeResult:
        invocation, outcome = client.run(
            context=context, spec=cluster.spec, backend=cluster.backend, extras={"attempt": 1}
        )
        outcomes.append(outcome)
        return invocation.get_materialize_result()

    result = await asyncio.to_thread(dg.materialize, [trained_model], raise_on_error=False)
    return result, (outcomes[0] if outcomes else None)


# -- the client ----------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", list(Backend))
async def test_success_reaches_dagster_from_rank0_only(
    kmock: kmock.KubernetesEmulator, apis: KubeApis, backend: Backend
) -> None:
    spec = _spec()
    cluster = Cluster(apis, spec, backend)
    # The API server gives a created Job its uid; the client makes that Job own the Service.
    kmock[f"post /apis/batch/v1/namespaces/{NS}/jobs"] << (
        lambda request: {**request.data, "metadata": {**request.data["metadata"], "uid": "uid-7"}}
    )
    done = terminated(0, "Completed", verdict("succeeded", 0, "final checkpoint at step 20"))
    cluster.then(lambda: cluster.create_pods(waiting())).then(
        lambda: cluster.move_rank0(phase="Running", state=running())
    ).then(lambda: cluster.move_rank0(phase="Succeeded", state=done))

    result, outcome = await _materialize(cluster)

    assert result.success
    assert outcome is not None and outcome.succeeded
    assert (outcome.reason, outcome.returncode) == (R.SUCCEEDED, 0)
    assert outcome.pod_name == cluster.rank0 and outcome.node_name == "gpu-node-7"
    assert outcome.termination_message == {
        "reason": "succeeded",
        "detail": "final checkpoint at step 20",
        "exit_code": 0,
        "rank": 0,
    }
    # Rank 0's messages reached Dagster; rank 1's did not.
    assert outcome.custom_messages == [{"event": "step", "step": 10}]
    [materialization] = result.asset_materializations_for_node("trained_model")
    assert materialization.metadata["final_loss"].value == 0.125
    # The trainer container got the Pipes bootstrap variables through the rendered manifest.
    [created] = [r for r in requests_of(kmock, "POST") if r.data.get("kind") != "Pod"][-1:]
    if backend == Backend.TRAINJOB:
        env = created.data["spec"]["trainer"]["env"]
    elif backend == Backend.JOBSET:
        job = created.data["spec"]["replicatedJobs"][0]["template"]["spec"]
        env = job["template"]["spec"]["containers"][0]["env"]
    else:
        env = created.data["spec"]["template"]["spec"]["containers"][0]["env"]
    names = {e["name"] for e in env}
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES"} <= names
    # Rank 0 was looked up by label, as a real API server needs.
    gets = requests_of(kmock, "GET")
    lists = [r for r in gets if str(r.url).endswith("/pods") or "pods?" in str(r.url)]
    assert (
        lists and "batch.kubernetes.io/job-completion-index=0" in lists[0].params["labelSelector"]
    )
    if backend == Backend.INDEXED_JOB:
        service = kmock.objects["v1/services", NS, spec.name]
        [owner] = service["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", spec.name, "uid-7")
    # A finished attempt leaves its objects for the post-mortem (delete_on_completion=False).
    assert not requests_of(kmock, "DELETE")


@pytest.mark.asyncio
async def test_rank0_exit_75_is_preempted(kmock: kmock.KubernetesEmulator, apis: KubeApis) -> None:
    cluster = Cluster(apis, _spec(), Backend.TRAINJOB)
    said = verdict("preempted", 75, "SIGTERM at step 1200; checkpoint step 1200 committed")
    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        lambda: cluster.move_rank0(phase="Failed", state=terminated(75, "Error", said))
    )

    result, outcome = await _materialize(cluster)

    assert result.success  # the asset decides what a preemption means; the client reports it
    assert outcome is not None and not outcome.succeeded
    assert (outcome.reason, outcome.returncode) == (R.PREEMPTED, 75)
    assert "step 1200" in outcome.detail


@pytest.mark.asyncio
async def test_eviction_is_preempted(kmock: kmock.KubernetesEmulator, apis: KubeApis) -> None:
    cluster = Cluster(apis, _spec(), Backend.INDEXED_JOB)
    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        lambda: cluster.move_rank0(**EVICTED)
    )

    result, outcome = await _materialize(cluster)

    assert result.success
    assert outcome is not None
    assert (outcome.reason, outcome.returncode) == (R.PREEMPTED, 1)
    assert "TerminationByKubelet" in outcome.detail


@pytest.mark.asyncio
async def test_oomkilled_is_oom(kmock: kmock.KubernetesEmulator, apis: KubeApis) -> None:
    cluster = Cluster(apis, _spec(), Backend.TRAINJOB)
    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        lambda: cluster.move_rank0(phase="Failed", state=terminated(137, "OOMKilled"))
    )

    result, outcome = await _materialize(cluster)

    assert result.success and outcome is not None
    assert (outcome.reason, outcome.returncode, outcome.signal_name) == (R.OOM, 137, "SIGKILL")
    assert "OOMKilled" in outcome.detail and "16Gi" in outcome.detail


@pytest.mark.asyncio
async def test_terminated_run_suspends_the_trainjob(
    kmock: kmock.KubernetesEmulator, apis: KubeApis
) -> None:
    cluster = Cluster(apis, _spec(), Backend.TRAINJOB)

    def terminate_run() -> None:
        raise DagsterExecutionInterruptedError()

    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(terminate_run)

    result, outcome = await _materialize(cluster)

    assert not result.success and outcome is None
    [failure] = result.get_step_failure_events()
    assert failure.step_failure_data.error.cls_name == "DagsterExecutionInterruptedError"
    [patch] = requests_of(kmock, "PATCH")[-1:]
    assert str(patch.url).endswith(
        f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs/tr-demo-a1"
    )
    assert patch.data == {"spec": {"suspend": True}}
    stored = kmock.objects["trainer.kubeflow.org/v1alpha1/trainjobs", NS, "tr-demo-a1"]
    assert stored["spec"]["suspend"] is True


@pytest.mark.asyncio
async def test_terminated_run_deletes_the_job_and_a_404_does_not_mask_it(
    kmock: kmock.KubernetesEmulator, apis: KubeApis
) -> None:
    cluster = Cluster(apis, _spec(), Backend.INDEXED_JOB)

    def job_gone_then_terminate() -> None:
        # Someone (a TTL, a person) deleted the Job already: cleanup meets a 404.
        apis.batch.delete_namespaced_job("tr-demo-a1", NS)
        raise DagsterExecutionInterruptedError()

    cluster.then(lambda: cluster.create_pods(running(), phase="Running")).then(
        job_gone_then_terminate
    )

    result, _ = await _materialize(cluster)

    [failure] = result.get_step_failure_events()
    assert failure.step_failure_data.error.cls_name == "DagsterExecutionInterruptedError"
    deletes = [r for r in requests_of(kmock, "DELETE") if "/jobs/" in str(r.url)]
    assert deletes[-1].params.get("propagationPolicy") == "Foreground"
    # The Service went too, so no headless Service outlives its Job.
    assert any("/services/tr-demo-a1" in str(r.url) for r in requests_of(kmock, "DELETE"))


@pytest.mark.asyncio
async def test_rank0_that_never_starts_is_given_up_and_suspended(
    kmock: kmock.KubernetesEmulator, apis: KubeApis
) -> None:
    cluster = Cluster(apis, _spec(), Backend.TRAINJOB)
    cluster.then(lambda: cluster.create_pods(waiting()))
    ticks = iter(range(0, 10_000, 600))

    result, outcome = await _materialize(
        cluster, clock=lambda: float(next(ticks)), pod_start_timeout=1800.0
    )

    assert result.success and outcome is not None
    assert outcome.reason == R.INFRA_TRANSIENT and outcome.returncode is None
    assert "did not start within 1800s" in outcome.detail and "ContainerCreating" in outcome.detail
    assert requests_of(kmock, "PATCH")[-1].data == {"spec": {"suspend": True}}
    # Never bound to a node: half an hour queued held no accelerator, and none is charged.
    assert outcome.observed().accelerator_wall_seconds == 0.0


def test_accelerators_are_held_from_scheduling_to_the_containers_end() -> None:
    pod = api_pod(
        "p",
        _LABELS,
        phase="Failed",
        state=terminated(75),  # finishedAt 00:10:00
        conditions=[scheduled("2026-01-01T00:04:00Z")],
    )
    ending = endings.classify_pod(pod)
    assert ending.scheduled_at is not None and ending.finished_at is not None
    exit_ = KubeTrainerExit(
        returncode=75,
        signal_name=None,
        scheduled_at=ending.scheduled_at,
        finished_at=ending.finished_at,
        ran=True,
    )
    assert exit_.accelerator_wall_seconds() == 360.0
    assert exit_.placement()["scheduled_at"] == "2026-01-01T00:04:00+00:00"
    # Still running (stopped, or lost): held until now.
    later = ending.scheduled_at.replace(minute=5)
    assert replace(exit_, finished_at=None).accelerator_wall_seconds(later) == 60.0
    # Ran, but the scheduling time is unknown: not evidence of zero; wall time is charged.
    assert replace(exit_, scheduled_at=None).accelerator_wall_seconds() is None
    # A timestamp that is not RFC 3339 is no evidence either.
    garbled = api_pod("p", _LABELS, phase="Failed", state=terminated(1),
                      conditions=[scheduled("yesterday")])  # fmt: skip
    assert endings.scheduled_at(garbled) is None


# -- pod endings, directly ---------------------------------------------------------------------

_LABELS = {"job-name": "j"}


def test_plain_text_termination_message_is_kept_redacted() -> None:
    pod = api_pod(
        "p",
        _LABELS,
        phase="Failed",
        state=terminated(1, "Error", "Traceback ... postgresql://tracks:hunter2@db/ledger"),
    )
    ending = endings.classify_pod(pod)
    assert ending.message.words is None
    assert ending.message.text is not None and "hunter2" not in ending.message.text
    assert ending.reason == R.USER_CODE_ERROR


def test_oomkilled_worker_under_torchrun_exit_1_is_oom() -> None:
    # The kernel killed a worker; torchrun's agent then exited 1 (ChildFailedError).
    pod = api_pod("p", _LABELS, phase="Failed", state=terminated(1, "OOMKilled"))
    ending = endings.classify_pod(pod)
    assert (ending.reason, ending.exit_code, ending.oom_killed) == (R.OOM, 1, True)


def test_launcher_verdict_refines_torchrun_exit_1() -> None:
    said = verdict("oom", 1, "torch.OutOfMemoryError on rank 3 at step 40")
    ending = endings.classify_pod(
        api_pod("p", _LABELS, phase="Failed", state=terminated(1, "Error", said))
    )
    assert ending.reason == R.OOM and "rank 3" in ending.termination.detail


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ('{"reason": "preempted", "rank": 0}', {"reason": "preempted", "rank": 0}),
        ('{"reason": {"nested": 1}, "rank": 0}', {"rank": 0}),  # non-scalars are dropped
        ("[1, 2]", None),
        ("", None),
        (None, None),
    ],
)
def test_termination_message_parsing_is_defensive(message: str | None, expected: Any) -> None:
    assert endings.parse_termination_message(message).words == expected


def test_sigterm_without_last_words_is_preempted_and_clean_exit_beats_disruption() -> None:
    killed = endings.classify_pod(api_pod("p", _LABELS, phase="Failed", state=terminated(143)))
    assert (killed.reason, killed.evidence.signal_name) == (R.PREEMPTED, "SIGTERM")
    finished = api_pod(
        "p",
        _LABELS,
        phase="Succeeded",
        state=terminated(0, "Completed"),
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
        ],
    )
    assert endings.classify_pod(finished).reason == R.SUCCEEDED


def test_pod_that_failed_before_running_is_infra_transient() -> None:
    pod = api_pod("p", _LABELS, phase="Failed", state=waiting(), reason="UnexpectedAdmissionError")
    assert not endings.has_started(pod) or endings.is_finished(pod)
    ending = endings.classify_pod(pod)
    assert (
        ending.reason == R.INFRA_TRANSIENT
        and "UnexpectedAdmissionError" in ending.termination.detail
    )


def test_running_pod_is_not_finished_and_workload_failure_reads_conditions() -> None:
    assert not endings.is_finished(api_pod("p", _LABELS, phase="Running", state=running()))
    failed = {
        "status": {
            "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]
        }
    }
    assert endings.workload_failure(failed) == "DeadlineExceeded"
    assert endings.ending_without_pod("TrainJob", "t", "DeadlineExceeded").reason == R.TIMEOUT
    assert (
        endings.workload_failure(
            {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
        )
        is None
    )
