"""Shared by the Kubernetes tests: pods as the API server serves them, and a scripted cluster.

kmock's ``KubernetesEmulator`` stores what is POSTed, PATCHed and DELETEd and serves it back; no
controller runs in it. :class:`Cluster` plays the controllers and the kubelet through the same
API: each time the client sleeps between polls, the next scripted step creates or moves a pod.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import kmock
import kubernetes
from dagster_pipes import _make_message

from pipeline.kube.render import (
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    TRAINER_GROUP,
    TRAINER_VERSION,
    TRAINJOB_PLURAL,
)
from pipeline.kube.spec import Backend, TrainerSpec
from resources.kube_pipes import KubeApis, rank0_selector

NS = "train"
IMAGE = "registry.example/tracks@sha256:" + "ab" * 32
# Pod name suffixes the scripted controllers use for rank 0 and rank 1.
RANK0_SUFFIX = "-node-0-0-abcde"
RANK1_SUFFIX = "-node-0-1-fghij"


# -- pods as the API server would serve them ---------------------------------------------------


def running() -> dict[str, Any]:
    return {"running": {"startedAt": "2026-01-01T00:00:00Z"}}


def waiting() -> dict[str, Any]:
    return {"waiting": {"reason": "ContainerCreating"}}


def terminated(exit_code: int, reason: str = "Error", message: str | None = None) -> dict:
    state: dict[str, Any] = {
        "exitCode": exit_code,
        "reason": reason,
        "startedAt": "2026-01-01T00:00:00Z",
        "finishedAt": "2026-01-01T00:10:00Z",
    }
    if message is not None:
        state["message"] = message
    return {"terminated": state}


def scheduled(at: str) -> dict[str, Any]:
    """The PodScheduled condition the scheduler sets when it binds the pod to a node."""
    return {"type": "PodScheduled", "status": "True", "lastTransitionTime": at}


def api_pod(
    name: str,
    labels: Mapping[str, str],
    *,
    phase: str,
    state: Mapping[str, Any],
    reason: str | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions or [],
        "containerStatuses": [
            {
                "name": "node",
                "image": IMAGE,
                "imageID": IMAGE,
                "ready": phase == "Running",
                "restartCount": 0,
                "state": dict(state),
            }
        ],
    }
    if reason:
        status["reason"] = reason
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": dict(labels),
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": "gpu-node-7",
            "containers": [
                {"name": "node", "image": IMAGE, "resources": {"limits": {"memory": "16Gi"}}}
            ],
        },
        "status": status,
    }


def verdict(reason: str, exit_code: int, detail: str) -> str:
    """The launcher's termination message."""
    return json.dumps({"reason": reason, "detail": detail, "exit_code": exit_code, "rank": 0})


EVICTED = {
    "phase": "Failed",
    "reason": "Evicted",
    # torchrun exits 1 on SIGTERM (SignalException): only the pod status tells the truth.
    "state": terminated(1, "Error", "torch.distributed.elastic ... SignalException"),
    "conditions": [
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "TerminationByKubelet",
            "message": "The node was low on resource: memory.",
        }
    ],
}


# -- the scripted cluster ----------------------------------------------------------------------


class Cluster:
    """Plays the Job/JobSet controllers and the kubelet: one scripted step per client sleep.

    ``spec`` may be None when the workload's name is made by the code under test (from a run id
    the test cannot know in advance): it is then read from the workload the client created.
    """

    def __init__(self, apis: KubeApis, spec: TrainerSpec | None, backend: Backend) -> None:
        self.apis = apis
        self._spec = spec
        self.backend = backend
        self.steps: list[Callable[[], None]] = []
        self.sleeps = 0

    @property
    def spec(self) -> TrainerSpec:
        if self._spec is None:
            self._spec = TrainerSpec(name=self._created_name(), image=IMAGE, namespace=NS)
        return self._spec

    def _created_name(self) -> str:
        if self.backend == Backend.INDEXED_JOB:
            names = [j.metadata.name for j in self.apis.batch.list_namespaced_job(NS).items]
        else:
            group, version, plural = {
                Backend.TRAINJOB: (TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL),
                Backend.JOBSET: (JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL),
            }[self.backend]
            found = self.apis.custom.list_namespaced_custom_object(group, version, NS, plural)
            names = [item["metadata"]["name"] for item in found["items"]]
        [name] = names
        return name

    @property
    def rank0(self) -> str:
        return f"{self.spec.name}{RANK0_SUFFIX}"

    def labels(self, rank: int) -> dict[str, str]:
        labels = dict(rank0_selector(self.spec, self.backend))
        labels["batch.kubernetes.io/job-completion-index"] = str(rank)
        return labels

    def create_pods(self, state: Mapping[str, Any], phase: str = "Pending") -> None:
        for rank, name in ((1, f"{self.spec.name}{RANK1_SUFFIX}"), (0, self.rank0)):
            # Rank 1 runs and logs too: its log must never reach Dagster.
            body = api_pod(name, self.labels(rank), phase="Running", state=running())
            # Newer than rank 0: a client picking "the newest pod" without the selector fails.
            body["metadata"]["creationTimestamp"] = "2026-01-01T00:00:05Z"
            if rank == 0:
                body = api_pod(name, self.labels(0), phase=phase, state=state)
            self.apis.core.create_namespaced_pod(NS, body)

    def move_rank0(self, **pod_fields: Any) -> None:
        body = api_pod(self.rank0, self.labels(0), **pod_fields)
        self.apis.core.patch_namespaced_pod_status(self.rank0, NS, {"status": body["status"]})

    def then(self, step: Callable[[], None]) -> Cluster:
        self.steps.append(step)
        return self

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        assert self.sleeps < 50, "the client polls forever"
        if self.steps:
            self.steps.pop(0)()


def pipes_log(*lines: Mapping[str, Any] | str) -> bytes:
    """A pod log as ``kubectl logs --timestamps`` serves it."""
    out = []
    for i, line in enumerate(lines):
        text = line if isinstance(line, str) else json.dumps(line)
        out.append(f"2026-01-01T00:00:{i:02d}.000000000Z {text}\n")
    return "".join(out).encode()


RANK0_LOG = pipes_log(
    "torchrun: starting 2 workers",  # not a Pipes message: forwarded to stdout
    _make_message("opened", {"extras": {}}),
    _make_message("report_custom_message", {"payload": {"event": "step", "step": 10}}),
    _make_message(
        "report_asset_materialization",
        {
            "asset_key": "trained_model",
            "metadata": {"final_loss": {"raw_value": 0.125, "type": "float"}},
            "data_version": None,
        },
    ),
    _make_message("closed", {}),
)
RANK1_LOG = pipes_log(_make_message("report_custom_message", {"payload": {"from": "rank1"}}))


def kube_apis(
    server: kmock.KubernetesEmulator, rank0_log: bytes = RANK0_LOG, rank1_log: bytes = RANK1_LOG
) -> KubeApis:
    """The real ``kubernetes`` client's APIs, pointed at ``server``, which serves pod logs."""
    # A real API server lists an empty collection; the emulator must be told the kinds exist.
    server.resources["v1/pods"] = {}
    server.resources["batch/v1/jobs"] = {}
    server.resources[f"{TRAINER_GROUP}/{TRAINER_VERSION}/{TRAINJOB_PLURAL}"] = {}
    server.resources[f"{JOBSET_GROUP}/{JOBSET_VERSION}/{JOBSET_PLURAL}"] = {}
    pods = f"/api/v1/namespaces/{NS}/pods/"
    server["get"][re.compile(re.escape(pods) + r"[-a-z0-9]+" + RANK0_SUFFIX + "/log")] << rank0_log
    server["get"][re.compile(re.escape(pods) + r"[-a-z0-9]+" + RANK1_SUFFIX + "/log")] << rank1_log
    config = kubernetes.client.Configuration(host=str(server.url).rstrip("/"))
    return KubeApis.from_api_client(kubernetes.client.ApiClient(config))


def requests_of(server: kmock.KubernetesEmulator, method: str) -> list[Any]:
    """Every request ``server`` received with ``method``, in order."""
    return [r for r in server if r.method.value == method]
