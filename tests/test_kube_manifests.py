"""Kubernetes manifests render, validate offline, and each validator refuses a broken object.

Core kinds go through kubernetes-validate's strict 1.33 schemas; TrainJob and JobSet through
the JSON Schemas vendored in ``pipeline/kube/schemas``. Also: the deploy files parse and point
at files that exist, and ``pipeline.kube`` stays free of Dagster.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.ids import InvalidIdError
from pipeline.kube import (
    Backend,
    InvalidTrainerSpecError,
    NodeResources,
    TrainerSpec,
    render,
    render_indexed_job,
    render_jobset,
    render_trainjob,
    to_yaml,
    trainer_name,
    write_manifests,
)
from pipeline.kube.validate import ManifestValidationError, validate_manifest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "ghcr.io/acme/tracks@sha256:" + "0f" * 32


def _spec(nnodes: int = 2, **overrides: Any) -> TrainerSpec:
    fields: dict[str, Any] = {
        "name": "tr-demo-a1",
        "namespace": "training",
        "image": IMAGE,
        "args": ("--run-id", "demo", "--attempt", "1"),
        "nnodes": nnodes,
        "nproc_per_node": 4,
        "resources": NodeResources(cpu="16", memory="64Gi", gpus=4),
        "env": {"TRACKS_LOG_LEVEL": "info"},
        "secret_env": {"TRACKS_LEDGER_URL": ("tracks-ledger", "url")},
        "checkpoint_pvc": "tracks-checkpoints",
        "termination_grace_seconds": 300,
        "labels": {"team": "reasoning"},
    }
    fields.update(overrides)
    return TrainerSpec(**fields)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# -- rendering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nnodes", [1, 2])
def test_indexed_job_and_service(nnodes: int) -> None:
    service, job = render_indexed_job(_spec(nnodes))
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"tracks.dev/trainer": "tr-demo-a1"}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nnodes
    assert spec["backoffLimit"] == 0
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"] == {"containerName": "node", "operator": "In", "values": [75]}
    assert rules[1]["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert all(rule["action"] == "FailJob" for rule in rules)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert pod["terminationGracePeriodSeconds"] == 300
    assert spec["template"]["metadata"]["labels"]["tracks.dev/trainer"] == "tr-demo-a1"
    [container] = pod["containers"]
    env = _env(container)
    assert env["PET_NNODES"] == str(nnodes)
    assert env["PET_NPROC_PER_NODE"] == "4"
    assert env["PET_NODE_RANK"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert env["PET_MASTER_ADDR"] == "tr-demo-a1-0.tr-demo-a1"
    assert env["PET_MASTER_PORT"] == "29500"
    assert env["PET_MAX_RESTARTS"] == "0"
    assert env["TRACKS_LEDGER_URL"] == {"secretKeyRef": {"name": "tracks-ledger", "key": "url"}}
    assert env["TRACKS_IMAGE"] == IMAGE and env["TRACKS_CHECKPOINTS"] == "/checkpoints"
    assert container["command"] == [
        "python", "-m", "pipeline.distributed.launch", "--nproc-per-node", "4", "--",
    ]  # fmt: skip
    assert container["args"] == ["--run-id", "demo", "--attempt", "1"]
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/checkpoints"]]["persistentVolumeClaim"] == {
        "claimName": "tracks-checkpoints"
    }


@pytest.mark.parametrize("nnodes", [1, 2])
def test_trainjob(nnodes: int) -> None:
    obj = render_trainjob(_spec(nnodes))
    assert obj["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and obj["kind"] == "TrainJob"
    spec = obj["spec"]
    assert spec["runtimeRef"] == {
        "name": "torch-distributed",
        "kind": "ClusterTrainingRuntime",
        "apiGroup": "trainer.kubeflow.org",
    }
    assert spec["suspend"] is False
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nnodes, 4)
    assert trainer["image"] == IMAGE
    assert trainer["resourcesPerNode"]["requests"]["nvidia.com/gpu"] == "4"
    # The Trainer's torch plugin owns PET_* and rejects user-set ones.
    assert not [e for e in trainer["env"] if e["name"].startswith("PET_")]
    assert obj["metadata"]["labels"]["team"] == "reasoning"
    [patch] = spec["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]
    assert pod["spec"]["template"]["spec"]["containers"][0]["name"] == "node"


@pytest.mark.parametrize("nnodes", [1, 2])
def test_jobset(nnodes: int) -> None:
    obj = render_jobset(_spec(nnodes))
    [replicated] = obj["spec"]["replicatedJobs"]
    assert replicated["name"] == "node" and replicated["replicas"] == 1
    job = replicated["template"]["spec"]
    assert job["completions"] == job["parallelism"] == nnodes
    env = _env(job["template"]["spec"]["containers"][0])
    assert env["PET_MASTER_ADDR"] == "tr-demo-a1-node-0-0.tr-demo-a1"
    assert obj["spec"]["network"]["subdomain"] == "tr-demo-a1"
    assert obj["spec"]["failurePolicy"]["maxRestarts"] == 0


def test_bootstrap_env_reaches_the_trainer_and_yaml_round_trips() -> None:
    boot = {"DAGSTER_PIPES_CONTEXT": "abc", "DAGSTER_PIPES_MESSAGES": "def"}
    for backend in Backend:
        objs = render(_spec(), backend, bootstrap_env=boot)
        assert "DAGSTER_PIPES_CONTEXT" in to_yaml(objs)
        assert list(yaml.safe_load_all(to_yaml(objs))) == objs


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("nnodes", [1, 2])
@pytest.mark.parametrize("backend", list(Backend))
def test_rendered_manifests_validate(backend: Backend, nnodes: int) -> None:
    for obj in render(_spec(nnodes, shm_size=None, checkpoint_pvc=None), backend):
        validate_manifest(obj)
    for obj in render(_spec(nnodes, ttl_seconds_after_finished=3600), backend):
        validate_manifest(obj)


def _broken(backend: Backend, kind: str) -> dict[str, Any]:
    [obj] = [copy.deepcopy(o) for o in render(_spec(), backend) if o["kind"] == kind]
    return obj


BROKEN = [
    # (what, backend, kind, how to break it, field path in the error)
    (
        "Job typo",
        Backend.INDEXED_JOB,
        "Job",
        lambda o: o["spec"].__setitem__("completionsMode", "Indexed"),
        "spec",
    ),
    (
        "Service typo",
        Backend.INDEXED_JOB,
        "Service",
        lambda o: o["spec"].__setitem__("clusterIp", "None"),
        "spec",
    ),
    (
        "Job container without a name",
        Backend.INDEXED_JOB,
        "Job",
        lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name"),
        "spec.template.spec.containers[0]",
    ),
    (
        "TrainJob typo",
        Backend.TRAINJOB,
        "TrainJob",
        lambda o: o["spec"]["trainer"].__setitem__("numNode", 2),
        "spec.trainer",
    ),
    (
        "TrainJob without runtimeRef",
        Backend.TRAINJOB,
        "TrainJob",
        lambda o: o["spec"].pop("runtimeRef"),
        "spec",
    ),
    (
        "TrainJob non-DNS name",
        Backend.TRAINJOB,
        "TrainJob",
        lambda o: o["metadata"].__setitem__("name", "Demo_Run"),
        "metadata.name",
    ),
    (
        "TrainJob inline env value and secret ref at once",
        Backend.TRAINJOB,
        "TrainJob",
        lambda o: o["spec"]["trainer"]["env"][1].__setitem__("value", "x"),
        "spec.trainer.env[1]",
    ),
    (
        "JobSet typo",
        Backend.JOBSET,
        "JobSet",
        lambda o: o["spec"].__setitem__("replicatedJob", []),
        "spec",
    ),
    (
        "JobSet replicated job without template",
        Backend.JOBSET,
        "JobSet",
        lambda o: o["spec"]["replicatedJobs"][0].pop("template"),
        "spec.replicatedJobs[0]",
    ),
    (
        "JobSet non-DNS name",
        Backend.JOBSET,
        "JobSet",
        lambda o: o["metadata"].__setitem__("name", "demo.run"),
        "metadata.name",
    ),
    (
        "typo inside a JobSet's pod template",
        Backend.JOBSET,
        "JobSet",
        lambda o: o["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
            "spec"
        ].__setitem__("restartPolicyy", "Never"),
        "spec.replicatedJobs[0].template.spec.template.spec",
    ),
]


@pytest.mark.parametrize(
    ("what", "backend", "kind", "breaker", "path"), BROKEN, ids=[b[0] for b in BROKEN]
)
def test_validators_refuse_a_broken_object(
    what: str, backend: Backend, kind: str, breaker: Any, path: str
) -> None:
    obj = _broken(backend, kind)
    breaker(obj)
    with pytest.raises(ManifestValidationError) as caught:
        validate_manifest(obj)
    error = caught.value
    assert (error.kind, error.path) == (kind, path), str(error)
    assert str(error).startswith(f"{kind} '{obj['metadata']['name']}': {path}: ")


def test_unknown_kind_is_named() -> None:
    with pytest.raises(ManifestValidationError, match=r"Widget 'w': apiVersion: .*Widget"):
        validate_manifest({"apiVersion": "acme.io/v1", "kind": "Widget", "metadata": {"name": "w"}})


# -- the spec refuses what cannot be rendered --------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field", "said"),
    [
        ({"name": "Demo_Run"}, "name", "DNS label"),
        ({"name": "1demo"}, "name", "starting with a letter"),
        ({"name": "a" * 60}, "name", "at most 54 characters"),
        ({"namespace": "Training"}, "namespace", "DNS label"),
        ({"image": "ghcr.io/acme/tracks"}, "image", "digest"),
        ({"image": "ghcr.io/acme/tracks:latest"}, "image", "'latest' is not a version"),
        ({"image": "ghcr.io/acme/tracks@sha256:abc"}, "image", "64 lowercase hex"),
        ({"env": {"PET_NNODES": "3"}}, "env['PET_NNODES']", "reserved"),
        ({"env": {"HF_TOKEN": "hf_abc"}}, "env['HF_TOKEN']", "secret_env"),
        ({"env": {"DB": "postgresql://u:pw@db/x"}}, "env['DB']", "secretKeyRef"),
        ({"secret_env": {"X": ("tracks-ledger",)}}, "secret_env['X']", "pair"),
        ({"secret_env": {"X": ("tracks-ledger", "db url")}}, "secret_env['X'].key", "Secret key"),
        ({"secret_env": {"X": ("tracks-ledger", "../url")}}, "secret_env['X'].key", "Secret key"),
        ({"secret_env": {"X": ("tracks-ledger", "..")}}, "secret_env['X'].key", "'..'"),
        ({"secret_env": {"X": ("tracks-ledger", "k" * 254)}}, "secret_env['X'].key", "253"),
        ({"labels": {"team": "no spaces"}}, "labels['team']", "label value"),
        ({"nnodes": 0}, "nnodes", "from 1"),
        ({"checkpoint_mount_path": "ckpt"}, "checkpoint_mount_path", "absolute"),
    ],
)
def test_spec_refuses_with_the_field_named(
    overrides: dict[str, Any], field: str, said: str
) -> None:
    with pytest.raises(InvalidTrainerSpecError) as caught:
        _spec(**overrides)
    assert caught.value.field == field
    assert isinstance(caught.value, InvalidIdError | ValueError)
    assert f"TrainerSpec.{field}" in str(caught.value) and said in str(caught.value)


def test_node_resources_refuse_a_bad_quantity() -> None:
    with pytest.raises(InvalidTrainerSpecError, match=r"TrainerSpec.resources.memory.*quantity"):
        NodeResources(memory="lots")
    with pytest.raises(InvalidTrainerSpecError, match=r"TrainerSpec.resources.gpus"):
        NodeResources(gpus=-1)


def test_inline_secret_value_is_never_echoed() -> None:
    with pytest.raises(InvalidTrainerSpecError) as caught:
        _spec(env={"TRACKS_LEDGER_URL": "postgresql://tracks:hunter2@db:5432/ledger"})
    assert "hunter2" not in str(caught.value)


def test_image_digest_and_trainer_name() -> None:
    assert _spec().image_digest == "sha256:" + "0f" * 32
    assert _spec(image="ghcr.io/acme/tracks:2026.11.1").image_digest is None
    name = trainer_name("Reasoning_Run.v2", 3, nnodes=8)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and name.endswith("-a3")
    assert name != trainer_name("reasoning-run-v2", 3, nnodes=8)  # slugs alike, ids differ
    _spec(name=trainer_name("x" * 128, 9999, nnodes=1024), nnodes=1024)  # always fits
    with pytest.raises(InvalidIdError):
        trainer_name("../etc", 1)


# -- files -------------------------------------------------------------------------------------


def test_write_manifests_validates_and_writes_every_backend(tmp_path: Path) -> None:
    paths = write_manifests(_spec(), tmp_path / "out")
    assert sorted(p.name for p in paths) == sorted(f"tr-demo-a1.{b.value}.yaml" for b in Backend)
    for path in paths:
        for obj in yaml.safe_load_all(path.read_text()):
            validate_manifest(obj)


def test_helm_values_and_dockerfile() -> None:
    values = yaml.safe_load((ROOT / "deploy" / "helm-values.yaml").read_text())
    [deployment] = values["dagster-user-deployments"]["deployments"]
    assert deployment["codeServerArgs"] == ["-m", "definitions"]
    launcher = values["runLauncher"]
    assert launcher["type"] == "K8sRunLauncher"
    assert launcher["config"]["k8sRunLauncher"]["envSecrets"]
    assert values["postgresql"]["enabled"] is False
    # A dead run worker is marked failed (the sensor stops waiting on it), never restarted.
    monitoring = values["dagsterDaemon"]["runMonitoring"]
    assert monitoring["enabled"] is True and monitoring["maxResumeRunAttempts"] == 0
    assert values["dagsterDaemon"]["runRetries"]["enabled"] is False
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", dockerfile, flags=re.MULTILINE)
    assert copied, "the Dockerfile copies nothing"
    for line in copied:
        for source in line.split():
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"


def test_helm_values_mount_the_shared_store_where_tracks_home_points() -> None:
    # The run pod and the code server read what the trainer pods write (config, last words,
    # checkpoints): without the claim, the receipt of every Kubernetes attempt would read an
    # empty store. Both get the same volume at TRACKS_HOME, and it is a valid pod volume.
    values = yaml.safe_load((ROOT / "deploy" / "helm-values.yaml").read_text())
    [deployment] = values["dagster-user-deployments"]["deployments"]
    run_launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    home = {e["name"]: e["value"] for e in deployment["env"]}["TRACKS_HOME"]
    for owner in (deployment, run_launcher):
        [volume] = owner["volumes"]
        [mount] = owner["volumeMounts"]
        assert mount == {"name": volume["name"], "mountPath": home}
        assert volume["persistentVolumeClaim"]["claimName"]
        validate_manifest(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "helm-values"},
                "spec": {
                    "volumes": owner["volumes"],
                    "containers": [
                        {"name": "c", "image": "i:1", "volumeMounts": owner["volumeMounts"]}
                    ],
                },
            }
        )
    # The claim is the one the trainer pods mount (docs/kubernetes.md's example config).
    claim = deployment["volumes"][0]["persistentVolumeClaim"]["claimName"]
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert f"checkpoint_pvc: {claim}" in docs
    assert f"checkpoint_mount_path: {home}" in docs


def test_core_does_not_import_dagster() -> None:
    code = (
        "import sys, pipeline.kube, pipeline.kube.validate, pipeline.kube.endings;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_k8s'));"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
