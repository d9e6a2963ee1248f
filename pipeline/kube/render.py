"""Manifests for a :class:`~pipeline.kube.spec.TrainerSpec`: pure functions, plain dicts.

Three renderings of one contract (see ``docs/kubernetes.md``):

- :func:`render_trainjob`: a Kubeflow Trainer v2 ``TrainJob``. The Trainer's torch plugin sets
  ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
  ``PET_MASTER_PORT`` itself and rejects user-set ones, so none are rendered here; pod-level
  settings (grace period, failure policy) come from the referenced ``ClusterTrainingRuntime``.
- :func:`render_jobset`: the JobSet a TrainJob creates underneath, for clusters with the JobSet
  controller but no Trainer operator; Tracks sets the ``PET_*`` variables itself.
- :func:`render_indexed_job`: a headless ``Service`` + batch/v1 Indexed ``Job``; no operator.

In every rendering the trainer container is called ``node``, restarts are ``Never`` and any
failure fails the whole job at once (no in-cluster retries): retries belong to the Dagster resume
sensor, which starts a new attempt under a new fencing token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from pipeline import envvars
from pipeline.kube.spec import (
    CONTAINER_NAME,
    IMAGE_ANNOTATION,
    MANAGED_BY_LABEL,
    REPLICATED_JOB_NAME,
    TERMINATION_MESSAGE_PATH,
    TRAINER_LABEL,
    Backend,
    TrainerSpec,
)

TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_VERSION = "v1alpha1"
TRAINJOB_PLURAL = "trainjobs"
JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# The "preempted" exit code of the Tracks launcher (pipeline.trainer.exit_codes.PREEMPTED).
PREEMPTED_EXIT_CODE = 75
# Who owns the runtime patch on a TrainJob (the API keys patches by manager).
PATCH_MANAGER = "tracks.dev/trainer"
_CHECKPOINT_VOLUME = "checkpoints"
_SHM_VOLUME = "dshm"

Manifest = dict[str, Any]


def _labels(spec: TrainerSpec) -> dict[str, str]:
    return {**spec.labels, MANAGED_BY_LABEL: "tracks", TRAINER_LABEL: spec.name}


def _annotations(spec: TrainerSpec) -> dict[str, str]:
    return {IMAGE_ANNOTATION: spec.image}


def _user_env(spec: TrainerSpec, bootstrap_env: Mapping[str, str] | None) -> list[Manifest]:
    """The variables every backend sets: the user's, secret references, identity, Pipes."""
    env: list[Manifest] = [{"name": k, "value": v} for k, v in spec.env.items()]
    env += [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        for k, (secret, key) in spec.secret_env.items()
    ]
    # The receipt's placement and container_digest come from these (docs/architecture.md,
    # "The ledger tables").
    env += [
        {"name": envvars.TRACKS_IMAGE.name, "value": spec.image},
        _downward(envvars.TRACKS_POD_NAME.name, "metadata.name"),
        _downward(envvars.TRACKS_POD_NAMESPACE.name, "metadata.namespace"),
        _downward(envvars.TRACKS_NODE_NAME.name, "spec.nodeName"),
    ]
    if spec.checkpoint_pvc is not None:
        env.append({"name": envvars.TRACKS_CHECKPOINTS.name, "value": spec.checkpoint_mount_path})
    env += [{"name": k, "value": v} for k, v in (bootstrap_env or {}).items()]
    return env


def _downward(name: str, field_path: str) -> Manifest:
    """A variable whose value the kubelet fills in from the pod's own fields."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _torchrun_env(spec: TrainerSpec, master_addr: str) -> list[Manifest]:
    """torchrun reads ``PET_<FLAG>`` for each ``--flag``; the rank comes from the Job index."""
    index_path = f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"
    return [
        {"name": "PET_NNODES", "value": str(spec.nnodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(spec.nproc_per_node)},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": index_path}}},
        {"name": "PET_MASTER_ADDR", "value": master_addr},
        {"name": "PET_MASTER_PORT", "value": str(spec.master_port)},
        # torchrun would otherwise restart the whole worker group in place after an exit 75,
        # reusing this attempt's fencing token.
        {"name": "PET_MAX_RESTARTS", "value": "0"},
    ]


def _volumes(spec: TrainerSpec) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = []
    mounts: list[Manifest] = []
    if spec.checkpoint_pvc is not None:
        volumes.append(
            {
                "name": _CHECKPOINT_VOLUME,
                "persistentVolumeClaim": {"claimName": spec.checkpoint_pvc},
            }
        )
        mounts.append({"name": _CHECKPOINT_VOLUME, "mountPath": spec.checkpoint_mount_path})
    if spec.shm_size is not None:
        # Containers get a 64 MiB /dev/shm; NCCL and DataLoader workers need far more.
        volumes.append(
            {"name": _SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
        )
        mounts.append({"name": _SHM_VOLUME, "mountPath": "/dev/shm"})
    return volumes, mounts


def _pod_template(
    spec: TrainerSpec,
    master_addr: str,
    bootstrap_env: Mapping[str, str] | None,
    subdomain: str | None,
) -> Manifest:
    volumes, mounts = _volumes(spec)
    container: Manifest = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": spec.command,
        "args": list(spec.args),
        "env": _torchrun_env(spec, master_addr) + _user_env(spec, bootstrap_env),
        "resources": spec.resources.requirements(),
        "ports": [{"name": "c10d", "containerPort": spec.master_port, "protocol": "TCP"}],
        # The launcher writes its JSON verdict here; if it could not, the log tail stands in.
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: Manifest = {
        # podFailurePolicy requires Never; restarts belong to the resume sensor anyway.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.termination_grace_seconds,
        "containers": [container],
    }
    if subdomain is not None:
        pod_spec["subdomain"] = subdomain
    if volumes:
        pod_spec["volumes"] = volumes
    if spec.service_account is not None:
        pod_spec["serviceAccountName"] = spec.service_account
    return {
        "metadata": {"labels": _labels(spec), "annotations": _annotations(spec)},
        "spec": pod_spec,
    }


def _pod_failure_policy() -> Manifest:
    return {
        "rules": [
            # A rank that saved and exited 75 was preempted: fail the Job now, so the resume
            # sensor (not the Job controller) owns the retry.
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER_NAME,
                    "operator": "In",
                    "values": [PREEMPTED_EXIT_CODE],
                },
            },
            # Eviction, preemption or node drain: the pod carries DisruptionTarget.
            {
                "action": "FailJob",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
        ]
    }


def _indexed_job_spec(
    spec: TrainerSpec,
    master_addr: str,
    bootstrap_env: Mapping[str, str] | None,
    subdomain: str | None,
) -> Manifest:
    job_spec: Manifest = {
        "completionMode": "Indexed",
        "completions": spec.nnodes,
        "parallelism": spec.nnodes,
        "backoffLimit": 0,
        "podFailurePolicy": _pod_failure_policy(),
        "template": _pod_template(spec, master_addr, bootstrap_env, subdomain),
    }
    return job_spec


def render_trainjob(
    spec: TrainerSpec, *, bootstrap_env: Mapping[str, str] | None = None
) -> Manifest:
    """A Kubeflow Trainer v2 ``TrainJob`` running ``spec`` on the ``spec.runtime`` runtime."""
    volumes, mounts = _volumes(spec)
    pod_spec_patch: Manifest = {}
    if volumes:
        pod_spec_patch["volumes"] = volumes
        pod_spec_patch["containers"] = [{"name": CONTAINER_NAME, "volumeMounts": mounts}]
    if spec.service_account is not None:
        pod_spec_patch["serviceAccountName"] = spec.service_account
    pod_patch: Manifest = {"metadata": {"labels": _labels(spec), "annotations": _annotations(spec)}}
    if pod_spec_patch:
        pod_patch["spec"] = pod_spec_patch
    runtime_patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": REPLICATED_JOB_NAME, "template": {"spec": {"template": pod_patch}}}
                    ]
                }
            }
        },
    }
    return {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainJob",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": _labels(spec),
            "annotations": _annotations(spec),
        },
        "spec": {
            "runtimeRef": {
                "name": spec.runtime,
                "kind": "ClusterTrainingRuntime",
                "apiGroup": TRAINER_GROUP,
            },
            "suspend": False,
            "trainer": {
                "image": spec.image,
                "command": spec.command,
                "args": list(spec.args),
                "env": _user_env(spec, bootstrap_env),
                "numNodes": spec.nnodes,
                "numProcPerNode": spec.nproc_per_node,
                "resourcesPerNode": spec.resources.requirements(),
            },
            "runtimePatches": [runtime_patch],
        },
    }


def jobset_master_addr(spec: TrainerSpec) -> str:
    """Rank 0's stable DNS name under a JobSet: ``<js>-<rjob>-<job>-<pod>.<subdomain>``."""
    return f"{spec.name}-{REPLICATED_JOB_NAME}-0-0.{spec.name}"


def render_jobset(spec: TrainerSpec, *, bootstrap_env: Mapping[str, str] | None = None) -> Manifest:
    """A ``JobSet`` with one replicated Indexed Job of ``nnodes`` pods, as a TrainJob makes."""
    job_template: Manifest = {
        "metadata": {"labels": _labels(spec)},
        # The JobSet controller sets the pods' subdomain from spec.network.
        "spec": _indexed_job_spec(spec, jobset_master_addr(spec), bootstrap_env, None),
    }
    jobset_spec: Manifest = {
        "replicatedJobs": [{"name": REPLICATED_JOB_NAME, "replicas": 1, "template": job_template}],
        "network": {
            "enableDNSHostnames": True,
            "subdomain": spec.name,
            # Rendezvous happens before any pod is Ready.
            "publishNotReadyAddresses": True,
        },
        # No restarts here: a failed child Job fails the JobSet, and Dagster decides.
        "failurePolicy": {
            "maxRestarts": 0,
            "rules": [{"name": "failOnAnyJobFailure", "action": "FailJobSet"}],
        },
        "suspend": False,
    }
    if spec.ttl_seconds_after_finished is not None:
        jobset_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": _labels(spec),
            "annotations": _annotations(spec),
        },
        "spec": jobset_spec,
    }


def indexed_job_master_addr(spec: TrainerSpec) -> str:
    """Rank 0's DNS name under an Indexed Job: pod hostname ``<job>-0`` in the Service."""
    return f"{spec.name}-0.{spec.name}"


def render_indexed_job(
    spec: TrainerSpec, *, bootstrap_env: Mapping[str, str] | None = None
) -> list[Manifest]:
    """A headless ``Service`` and an Indexed ``Job`` (both named ``spec.name``), in that order.

    The Service comes first so that rank 0's DNS name exists before any pod resolves it.
    """
    service: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": {
            "clusterIP": "None",
            "selector": {TRAINER_LABEL: spec.name},
            # Rendezvous happens before any pod is Ready.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "c10d", "port": spec.master_port, "targetPort": spec.master_port}],
        },
    }
    job_spec = _indexed_job_spec(spec, indexed_job_master_addr(spec), bootstrap_env, spec.name)
    if spec.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    job: Manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": _labels(spec),
            "annotations": _annotations(spec),
        },
        "spec": job_spec,
    }
    return [service, job]


def render(
    spec: TrainerSpec,
    backend: Backend | str = Backend.TRAINJOB,
    *,
    bootstrap_env: Mapping[str, str] | None = None,
) -> list[Manifest]:
    """Every object ``backend`` needs for ``spec``, in creation order."""
    match Backend(backend):
        case Backend.TRAINJOB:
            return [render_trainjob(spec, bootstrap_env=bootstrap_env)]
        case Backend.JOBSET:
            return [render_jobset(spec, bootstrap_env=bootstrap_env)]
        case Backend.INDEXED_JOB:
            return render_indexed_job(spec, bootstrap_env=bootstrap_env)
    raise AssertionError(backend)  # pragma: no cover - Backend() refused anything else


def to_yaml(objs: Manifest | Iterable[Manifest]) -> str:
    """One YAML stream, ``---`` between documents, keys in rendering order."""
    docs = [objs] if isinstance(objs, Mapping) else list(objs)
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def write_manifests(
    spec: TrainerSpec,
    directory: str | Path,
    backends: Iterable[Backend | str] = tuple(Backend),
) -> list[Path]:
    """Render, validate and write ``<name>.<backend>.yaml`` per backend; return the paths.

    Validation runs first for every backend, so a broken object leaves no file behind.
    """
    from pipeline.kube.validate import validate_manifest  # the schemas are heavy to load

    rendered = {Backend(b): render(spec, b) for b in backends}
    for objs in rendered.values():
        for obj in objs:
            validate_manifest(obj)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for backend, objs in rendered.items():
        path = out / f"{spec.name}.{backend.value}.yaml"
        path.write_text(to_yaml(objs), encoding="utf-8")
        paths.append(path)
    return paths
