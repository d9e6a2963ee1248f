"""Launches the distributed trainer on Kubernetes through Dagster Pipes, talking to rank 0 only.

Modelled on dagster-k8s's ``PipesK8sClient`` (which launches exactly one pod) and dagster-ray's
``PipesKubeRayJobClient``: open a Pipes session, put its bootstrap variables into the trainer's
environment, create a ``TrainJob`` / ``JobSet`` / Indexed ``Job`` + ``Service``, find the rank-0
pod by label, read Pipes messages from its log, wait for it to end, and turn that end into one
termination reason (``pipeline.kube.endings``). What it returns mirrors the local
:class:`~resources.launcher.TrainerPipesClient`.

A terminated Dagster run suspends the TrainJob/JobSet (its pods get SIGTERM and the trainers
checkpoint inside the grace period) or deletes the Job in the foreground, then re-raises. Every
cleanup call tolerates 404: the object may already be gone (an evicted pod, a TTL), and a 404
from cleanup must never mask the error that caused it (the dagster-k8s bug, PR #33477).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import dagster as dg
import kubernetes
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster_k8s.pipes import PipesK8sPodLogsMessageReader
from kubernetes.client.exceptions import ApiException

from pipeline import redact
from pipeline.kube import endings
from pipeline.kube.render import (
    COMPLETION_INDEX_ANNOTATION,
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    TRAINER_GROUP,
    TRAINER_VERSION,
    TRAINJOB_PLURAL,
    render,
)
from pipeline.kube.spec import REPLICATED_JOB_NAME, Backend, TrainerSpec
from pipeline.reasons import AttemptEvidence, ObservedEnding, Termination
from pipeline.states import TerminationReason

_CRD = {
    Backend.TRAINJOB: (TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL, "TrainJob"),
    Backend.JOBSET: (JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, "JobSet"),
}
# Long enough for a cluster autoscaler to add a node (a few minutes), short enough that a
# request no node can meet is said within minutes, not after the hour-long start timeout.
DEFAULT_UNSCHEDULABLE_TIMEOUT = 300.0


class TrainerLaunchError(RuntimeError):
    """The trainer's Kubernetes objects could not be created; names the object and the reason.

    ``status`` is the API server's HTTP status (403: RBAC, 404: no such kind, so the operator is
    missing; 422: admission refused the object; 5xx: the API server itself).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KubeTrainerExit:
    """How rank 0 ended, its termination reason, and what it said through Pipes on the way.

    The first four fields mean what they mean on :class:`~resources.launcher.TrainerExit`;
    ``returncode`` is None when no container exit was observed (a pod that never ran or
    vanished). ``evidence`` can be re-classified with more facts (the last committed step).
    """

    returncode: int | None
    signal_name: str | None
    custom_messages: list[Any] = field(default_factory=list)
    interrupted: bool = False
    reason: TerminationReason = TerminationReason.USER_CODE_ERROR
    detail: str = ""
    backend: Backend = Backend.TRAINJOB
    workload: str = ""
    namespace: str = ""
    pod_name: str | None = None
    node_name: str | None = None
    termination_message: Mapping[str, Any] | str | None = None
    evidence: AttemptEvidence = field(default_factory=AttemptEvidence)
    image: str = ""
    image_digest: str | None = None  # when the image is pinned by digest
    oom_killed: bool = False  # the kubelet said OOMKilled on the trainer container
    disruption: str | None = None  # the platform's words when it took the pod away (redacted)
    scheduled_at: datetime | None = None  # rank 0's pod bound to a node (accelerators held)
    finished_at: datetime | None = None  # rank 0's container ended (None: stopped, or lost)
    ran: bool = False  # rank 0's container started

    def accelerator_wall_seconds(self, now: datetime | None = None) -> float | None:
        """How long rank 0's pod held its node's accelerators: scheduled → ended (or now).

        0.0 for a pod that was never scheduled (time queued holds no GPU); None when a pod
        ran but its scheduling time is not known, and the attempt's wall time is charged.
        Rank 0's interval stands for every node's: gang scheduling binds them together.
        """
        if self.scheduled_at is None:
            return None if self.ran else 0.0
        until = self.finished_at or now or datetime.now(UTC)
        return max(0.0, (until - self.scheduled_at).total_seconds())

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and self.reason == TerminationReason.SUCCEEDED

    @property
    def kind(self) -> str:
        """The workload's kind: TrainJob, JobSet or Job."""
        return "Job" if self.backend == Backend.INDEXED_JOB else _CRD[self.backend][3]

    def placement(self) -> dict[str, Any]:
        """Where rank 0 ran, in the keys of the attempt's placement; unknown facts left out."""
        facts = {
            "launcher": "kubernetes",
            "namespace": self.namespace or None,
            "workload": f"{self.kind}/{self.workload}" if self.workload else None,
            "pod": self.pod_name,
            "node": self.node_name,
            "image": self.image or None,
            # Only a digest names what ran; a tag can be moved to another image later.
            "image_digest": self.image_digest,
            "scheduled_at": self.scheduled_at.isoformat() if self.scheduled_at else None,
        }
        return {key: value for key, value in facts.items() if value is not None}

    def observed(self) -> ObservedEnding:
        """This ending as evidence for the attempt's receipt (``finish_attempt(observed=…)``)."""
        # Facts only the cluster has decide: an OOM kill (torchrun's agent exits 1 after it),
        # a pod taken away before it could exit cleanly, or no container exit seen at all.
        decisive = (
            self.returncode is None
            or self.oom_killed
            or (self.disruption is not None and self.returncode != 0)
        )
        detail = self.detail
        if self.disruption and self.returncode != 0 and self.disruption[:60] not in detail:
            # The launcher's verdict was kept (a graceful save on SIGTERM); say who sent it.
            took = self.disruption.rstrip(".")
            detail = f"{detail.rstrip('.')}. The platform took the pod away ({took})."
        return ObservedEnding(
            evidence=self.evidence,
            termination=Termination(self.reason, detail),
            decisive=decisive,
            accelerator_wall_seconds=self.accelerator_wall_seconds(),
        )


@dataclass(frozen=True)
class KubeApis:
    """The API objects the client uses; inject them (tests, a non-default cluster)."""

    core: kubernetes.client.CoreV1Api
    batch: kubernetes.client.BatchV1Api
    custom: kubernetes.client.CustomObjectsApi

    @classmethod
    def from_api_client(cls, api_client: kubernetes.client.ApiClient) -> KubeApis:
        return cls(
            core=kubernetes.client.CoreV1Api(api_client),
            batch=kubernetes.client.BatchV1Api(api_client),
            custom=kubernetes.client.CustomObjectsApi(api_client),
        )


def rank0_selector(spec: TrainerSpec, backend: Backend) -> dict[str, str]:
    """Labels that pick rank 0's pod: completion index 0 of job 0 of the workload."""
    if backend == Backend.INDEXED_JOB:
        return {"job-name": spec.name, COMPLETION_INDEX_ANNOTATION: "0"}
    return {
        "jobset.sigs.k8s.io/jobset-name": spec.name,
        "jobset.sigs.k8s.io/replicatedjob-name": REPLICATED_JOB_NAME,
        "jobset.sigs.k8s.io/job-index": "0",
        COMPLETION_INDEX_ANNOTATION: "0",
    }


class TrainJobPipesClient(dg.PipesClient):
    """Runs a :class:`TrainerSpec` on Kubernetes and follows rank 0 through Pipes.

    ``apis`` is built from the in-cluster config (or kubeconfig) on first use unless injected.
    ``sleeper`` and ``clock`` are injectable so tests run in milliseconds. Rank 0 may take
    ``pod_start_timeout`` seconds to start (queued, pulling), but only ``unschedulable_timeout``
    of them with the scheduler saying it fits no node: then the attempt ends quoting it.
    """

    def __init__(
        self,
        *,
        apis: KubeApis | None = None,
        poll_interval: float = 5.0,
        pod_start_timeout: float = 3600.0,
        unschedulable_timeout: float = DEFAULT_UNSCHEDULABLE_TIMEOUT,
        delete_on_completion: bool = False,
        sleeper: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._apis = apis
        self.poll_interval = poll_interval
        self.pod_start_timeout = pod_start_timeout
        self.unschedulable_timeout = unschedulable_timeout
        self.delete_on_completion = delete_on_completion
        self.sleeper = sleeper
        self.clock = clock

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    @property
    def apis(self) -> KubeApis:
        if self._apis is None:
            # The run pod has a service account; a laptop has a kubeconfig.
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            self._apis = KubeApis.from_api_client(kubernetes.client.ApiClient())
        return self._apis

    def run(  # type: ignore[override]
        self,
        *,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        spec: TrainerSpec,
        backend: Backend | str = Backend.TRAINJOB,
        extras: Mapping[str, Any] | None = None,
    ) -> tuple[dg.PipesClientCompletedInvocation, KubeTrainerExit]:
        backend = Backend(backend)
        reader = PipesK8sPodLogsMessageReader()
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesEnvContextInjector(),
            message_reader=reader,
            extras=extras,
        ) as session:
            objs = render(spec, backend, bootstrap_env=session.get_bootstrap_env_vars())
            try:
                # Inside the try: a run terminated mid-create must not leave half a workload.
                self._create(spec, backend, objs)
                context.log.info(f"created {backend.value} {spec.namespace}/{spec.name}")
                ending, started, disruption = self._follow(context, spec, backend, reader)
            except DagsterExecutionInterruptedError:
                context.log.info(
                    f"run terminated: stopping {backend.value} {spec.name} so its trainers "
                    "checkpoint and exit inside their grace period"
                )
                self._stop_quietly(context, spec, backend)
                raise
            except BaseException:
                # The step is failing: nobody would be left to follow a trainer still running.
                self._stop_quietly(context, spec, backend)
                raise
            if not started:
                # Given up on (or failed) before rank 0 ran: it must not start unobserved later.
                self._stop(spec, backend)
            if self.delete_on_completion:
                self._delete(spec, backend)
        outcome = self._outcome(
            ending, spec, backend, list(session.get_custom_messages()), disruption
        )
        context.log.info(f"rank 0 of {spec.name} ended: {outcome.reason} ({outcome.detail})")
        return dg.PipesClientCompletedInvocation(session), outcome

    # -- creating -----------------------------------------------------------------------------

    def _create(self, spec: TrainerSpec, backend: Backend, objs: list[dict[str, Any]]) -> None:
        apis = self.apis
        for obj in objs:
            try:
                if obj["kind"] == "Service":
                    apis.core.create_namespaced_service(spec.namespace, obj)
                elif obj["kind"] == "Job":
                    created = apis.batch.create_namespaced_job(spec.namespace, obj)
                    self._adopt_service(spec, created)
                else:
                    group, version, plural, _ = _CRD[backend]
                    apis.custom.create_namespaced_custom_object(
                        group, version, spec.namespace, plural, obj
                    )
            except ApiException as error:
                # Nothing half-made may outlive the step (a Service without its Job).
                self._delete(spec, backend)
                raise TrainerLaunchError(
                    f"creating {obj['kind']} {spec.namespace}/{spec.name} failed: "
                    f"{error.status} {error.reason}: {_api_message(error)}",
                    status=error.status,
                ) from None

    def _adopt_service(self, spec: TrainerSpec, job: Any) -> None:
        """Make the Job own its Service, so deleting the Job (or its TTL) removes both."""
        uid = getattr(getattr(job, "metadata", None), "uid", None)
        if not uid:
            return
        owner = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": spec.name,
            "uid": uid,
            "blockOwnerDeletion": False,
        }
        self.apis.core.patch_namespaced_service(
            spec.name, spec.namespace, {"metadata": {"ownerReferences": [owner]}}
        )

    # -- following ----------------------------------------------------------------------------

    def _follow(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        spec: TrainerSpec,
        backend: Backend,
        reader: PipesK8sPodLogsMessageReader,
    ) -> tuple[endings.PodEnding | _NoPod, bool, str | None]:
        """Rank 0's ending, whether it ever started, and the platform's words if it took the
        pod away (an eviction, a node shutdown)."""
        pod = self._wait_for_rank0(spec, backend)
        if isinstance(pod, _NoPod):
            return pod, False, None
        name = pod["metadata"]["name"]
        context.log.info(f"rank 0 is pod {spec.namespace}/{name}; reading its Pipes messages")
        if _ran(pod):
            # Blocks while the container runs (follow=True) and returns when its log ends. Each
            # Pipes log message goes to context.log, so to the run page, as its line is read,
            # not at the end; dagster-k8s holds a line until the next one arrives, which is why
            # the trainer writes its progress line before the step's custom message
            # (pipeline/trainer/reporting.py, tests/test_progress.py).
            reader.consume_pod_logs(
                context=context, core_api=self.apis.core, pod_name=name, namespace=spec.namespace
            )
        while True:
            try:
                current = self.apis.core.read_namespaced_pod(name, spec.namespace)
            except ApiException as error:
                if error.status == 404:
                    lost = endings.lost_pod(name, "the pod was deleted")
                    return replace(lost, scheduled_at=endings.scheduled_at(pod)), True, None
                raise
            pod = self._as_dict(current)
            if endings.is_finished(pod):
                disruption = endings.disruption(pod)
                said = redact.text(disruption)[:300] if disruption else None
                return endings.classify_pod(pod), True, said
            self.sleeper(self.poll_interval)

    def _wait_for_rank0(self, spec: TrainerSpec, backend: Backend) -> dict[str, Any] | _NoPod:
        deadline = self.clock() + self.pod_start_timeout
        selector = rank0_selector(spec, backend)
        last_seen: dict[str, Any] | None = None
        unschedulable_since: float | None = None
        while True:
            pod = self._find_rank0(spec, selector)
            if pod is not None:
                last_seen = pod
                if endings.has_started(pod):
                    return pod
            held_since = endings.scheduled_at(last_seen) if last_seen else None
            failure = self._workload_failure(spec, backend)
            if failure is not None:
                kind = "Job" if backend == Backend.INDEXED_JOB else _CRD[backend][3]
                return _NoPod(endings.ending_without_pod(kind, spec.name, failure), held_since)
            now = self.clock()
            said = endings.unschedulable(pod) if pod is not None else None
            if said is None:
                unschedulable_since = None
            elif unschedulable_since is None:
                unschedulable_since = now
            elif now - unschedulable_since >= self.unschedulable_timeout:
                return _NoPod(self._unschedulable(spec, now - unschedulable_since, said))
            if now >= deadline:
                where = _pending_phrase(last_seen)
                return _NoPod(
                    endings.Termination(
                        TerminationReason.INFRA_TRANSIENT,
                        f"Rank 0 of {spec.name} did not start within "
                        f"{self.pod_start_timeout:.0f}s ({where}); the workload was stopped.",
                    ),
                    held_since,
                )
            self.sleeper(self.poll_interval)

    def _unschedulable(self, spec: TrainerSpec, seconds: float, said: str) -> endings.Termination:
        # Infrastructure, as the start timeout is: a busy cluster may have room on a retry.
        return endings.Termination(
            TerminationReason.INFRA_TRANSIENT,
            f"Rank 0 of {spec.name} could not be scheduled: the scheduler found no node for it "
            f"for {seconds:.0f}s (unschedulable_timeout {self.unschedulable_timeout:.0f}s), "
            f'saying "{said.rstrip(".")}"; the workload was stopped.',
        )

    def _find_rank0(self, spec: TrainerSpec, selector: Mapping[str, str]) -> dict[str, Any] | None:
        found = self.apis.core.list_namespaced_pod(
            spec.namespace, label_selector=",".join(f"{k}={v}" for k, v in selector.items())
        )
        pods = [self._as_dict(item) for item in found.items or []]
        # The API server filters by the selector; checking again costs nothing and keeps a
        # careless proxy (or mock) from handing rank 1's log to Dagster.
        pods = [
            p
            for p in pods
            if all(
                (p.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in selector.items()
            )
            and not p.get("metadata", {}).get("deletionTimestamp")
        ]
        if not pods:
            return None
        return max(pods, key=lambda p: str(p.get("metadata", {}).get("creationTimestamp") or ""))

    def _workload_failure(self, spec: TrainerSpec, backend: Backend) -> str | None:
        try:
            if backend == Backend.INDEXED_JOB:
                obj = self._as_dict(self.apis.batch.read_namespaced_job(spec.name, spec.namespace))
            else:
                group, version, plural, _ = _CRD[backend]
                obj = self.apis.custom.get_namespaced_custom_object(
                    group, version, spec.namespace, plural, spec.name
                )
        except ApiException as error:
            if error.status == 404:
                return "NotFound: the workload was deleted before rank 0 ran"
            raise
        return endings.workload_failure(obj)

    # -- stopping -----------------------------------------------------------------------------

    def _stop(self, spec: TrainerSpec, backend: Backend) -> None:
        """Stop the trainers: suspend a TrainJob/JobSet, delete a Job; 404 means done already.

        Suspending (not deleting) keeps the object, its events and conditions for the
        post-mortem; the pods are terminated with their grace period all the same.
        """
        if backend == Backend.INDEXED_JOB:
            self._delete(spec, backend)
            return
        group, version, plural, _ = _CRD[backend]
        _ignore_404(
            lambda: self.apis.custom.patch_namespaced_custom_object(
                group, version, spec.namespace, plural, spec.name, {"spec": {"suspend": True}}
            )
        )

    def _stop_quietly(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        spec: TrainerSpec,
        backend: Backend,
    ) -> None:
        """:meth:`_stop` on an error path: its own failure is logged, never raised over the
        error being handled."""
        try:
            self._stop(spec, backend)
        except Exception as error:
            context.log.warning(f"could not stop {backend.value} {spec.name}: {error!r}")

    def _delete(self, spec: TrainerSpec, backend: Backend) -> None:
        """Delete the workload and (foreground) its pods; the Job's Service with it."""
        apis = self.apis
        if backend == Backend.INDEXED_JOB:
            _ignore_404(
                lambda: apis.batch.delete_namespaced_job(
                    spec.name, spec.namespace, propagation_policy="Foreground"
                )
            )
            _ignore_404(lambda: apis.core.delete_namespaced_service(spec.name, spec.namespace))
            return
        group, version, plural, _ = _CRD[backend]
        _ignore_404(
            lambda: apis.custom.delete_namespaced_custom_object(
                group,
                version,
                spec.namespace,
                plural,
                spec.name,
                propagation_policy="Foreground",
            )
        )

    # -- helpers ------------------------------------------------------------------------------

    def _as_dict(self, obj: Any) -> dict[str, Any]:
        if isinstance(obj, dict):
            return obj
        return self.apis.core.api_client.sanitize_for_serialization(obj)

    @staticmethod
    def _outcome(
        ending: endings.PodEnding | _NoPod,
        spec: TrainerSpec,
        backend: Backend,
        custom_messages: list[Any],
        disruption: str | None = None,
    ) -> KubeTrainerExit:
        common = {
            "custom_messages": custom_messages,
            "backend": backend,
            "workload": spec.name,
            "namespace": spec.namespace,
            "image": spec.image,
            "image_digest": spec.image_digest,
        }
        if isinstance(ending, _NoPod):
            return KubeTrainerExit(
                returncode=None,
                signal_name=None,
                reason=ending.termination.reason,
                detail=ending.termination.detail,
                scheduled_at=ending.scheduled_at,
                **common,
            )
        message = ending.message.words if ending.message.words is not None else ending.message.text
        return KubeTrainerExit(
            returncode=ending.exit_code,
            signal_name=ending.evidence.signal_name,
            reason=ending.reason,
            detail=ending.termination.detail,
            pod_name=ending.pod_name,
            node_name=ending.node_name,
            termination_message=message,
            evidence=ending.evidence,
            oom_killed=ending.oom_killed,
            disruption=disruption,
            scheduled_at=ending.scheduled_at,
            finished_at=ending.finished_at,
            ran=True,
            **common,
        )


@dataclass(frozen=True)
class _NoPod:
    """The workload ended (or was given up on) before rank 0 ever ran."""

    termination: endings.Termination
    scheduled_at: datetime | None = None  # bound to a node all the same (an image pull failing)


def _ran(pod: Mapping[str, Any]) -> bool:
    """True if the trainer container ever started, so a log exists to read."""
    state = (endings.container_status(pod) or {}).get("state") or {}
    return bool(state.get("running") or state.get("terminated"))


def _pending_phrase(pod: Mapping[str, Any] | None) -> str:
    if pod is None:
        return "no rank-0 pod was created"
    status = pod.get("status") or {}
    waiting = ((endings.container_status(pod) or {}).get("state") or {}).get("waiting") or {}
    why = waiting.get("reason") or status.get("reason")
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            why = f"unschedulable: {condition.get('message') or condition.get('reason')}"
    return f"pod {pod['metadata']['name']} {status.get('phase', 'Pending')}" + (
        f", {why}" if why else ""
    )


def _api_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.body)[:500]
    except ValueError:
        return str(error.body)[:500]


def _ignore_404(call: Callable[[], object]) -> None:
    try:
        call()
    except ApiException as error:
        if error.status != 404:
            raise
