"""What one distributed training attempt needs from Kubernetes, said once and checked once.

A :class:`TrainerSpec` is neutral: the same record renders as a Kubeflow Trainer ``TrainJob``, a
plain ``JobSet``, or an Indexed ``Job`` + headless ``Service`` (``pipeline.kube.render``). Every
field is validated here, at construction, so a bad name or an inline secret is refused with the
field named before anything reaches a cluster.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from pathlib import PurePosixPath
from types import MappingProxyType

from pipeline import envvars, ids, redact
from pipeline.ids import InvalidIdError

# The container every backend runs the trainer in. Kubeflow Trainer's torch runtime names its
# replicated job and its trainer container ``node``; the Job and JobSet renderers use the same
# name so one pod-status reader (``pipeline.kube.endings``) serves all three.
CONTAINER_NAME = "node"
REPLICATED_JOB_NAME = "node"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
DEFAULT_RUNTIME = "torch-distributed"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
TRAINER_LABEL = "tracks.dev/trainer"
IMAGE_ANNOTATION = "tracks.dev/image"

# Variables Tracks sets itself: a user value would silently fight the contract.
RESERVED_ENV_PREFIXES = ("PET_", "DAGSTER_PIPES_")
RESERVED_ENV = frozenset(
    v.name
    for v in (
        envvars.TRACKS_IMAGE,
        envvars.TRACKS_POD_NAME,
        envvars.TRACKS_POD_NAMESPACE,
        envvars.TRACKS_NODE_NAME,
    )
)

# RFC 1035 label: TrainJob and Service names must start with a letter (the Trainer's CEL rule
# is ``^[a-z]([-a-z0-9]*[a-z0-9])?$``), which also makes it a valid DNS-1123 label.
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?\Z")
_DNS_LABEL_MAX = 63
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# A Kubernetes resource.Quantity: "500m", "16Gi", "1.5", "2e3".
_QUANTITY = re.compile(
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
)
# A key in a Secret's data (Kubernetes' IsConfigMapKey): also a file name when mounted.
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+\Z")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}\Z")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
# Names that say "this is a credential": their values must come from a Secret.
_SECRET_NAME = re.compile(
    r"(?i)(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL)"
)


# Upper bounds on what one attempt may ask for: past them a typo ("5000" CPUs, "40Ti"), not a
# cluster, is the likelier cause, and the pods would sit Pending for want of such a node.
MAX_NNODES = 1024
MAX_NPROC_PER_NODE = 64  # as resources.trainer.config.nproc_per_node allows on every backend
MAX_CPU = Decimal(512)  # cores per node (pod)
MAX_GPUS = 16  # per node (pod); the largest nodes carry 8
MIN_MEMORY, MAX_MEMORY = "128Mi", "4Ti"  # Python and torch alone need more than the minimum
_QUANTITY_SUFFIX = {
    "": Decimal(1),
    **{s: Decimal(10) ** (3 * i) for i, s in enumerate("kMGTPE", start=1)},
    **{s: Decimal(10) ** (-3 * i) for i, s in enumerate("mun", start=1)},
    **{f"{s}i": Decimal(2) ** (10 * i) for i, s in enumerate("KMGTPE", start=1)},
}

# Where a mounted claim must not go: in, under or above these it would hide the system, the
# interpreter and its packages, or the pod's own credentials, and whoever can write to the claim
# would choose what the trainer runs. /usr holds /usr/lib/python* and /usr/local/lib/python*.
SYSTEM_FOLDERS = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/root",
    "/run", "/sbin", "/sys", "/usr", "/var",
)  # fmt: skip
# /opt/tracks is the image's WORKDIR (deploy/Dockerfile), the first entry of sys.path under
# `python -m`: a claim there would replace Tracks' own code.
PYTHON_FOLDERS = {"/opt/conda": "conda's Python prefix", "/opt/tracks": "the image's code folder"}
SERVICE_ACCOUNT_FOLDERS = ("/var/run/secrets", "/run/secrets")  # the service-account token
# The image's TRACKS_HOME (deploy/Dockerfile, docs/kubernetes.md): made for Tracks' own state,
# it hides nothing, and is the one place under a system folder that a claim may go.
STATE_FOLDERS = ("/var/lib/tracks",)
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


class Backend(StrEnum):
    """Which Kubernetes objects run the trainer."""

    TRAINJOB = "trainjob"  # Kubeflow Trainer v2 (a JobSet underneath); the default
    JOBSET = "jobset"  # the JobSet a TrainJob would create, for clusters without the operator
    INDEXED_JOB = "indexed_job"  # batch/v1 Indexed Job + headless Service; no operator at all


class InvalidTrainerSpecError(InvalidIdError):
    """A :class:`TrainerSpec` field that cannot be rendered; ``field`` names it."""

    def __init__(self, field_name: str, value: object, rule: str) -> None:
        self.field = field_name
        super().__init__(f"TrainerSpec.{field_name}", value, rule)


def _label(field_name: str, value: object, max_length: int = _DNS_LABEL_MAX) -> str:
    if not isinstance(value, str):
        raise InvalidTrainerSpecError(field_name, value, "must be a string")
    if not _DNS_LABEL.match(value) or len(value) > max_length:
        raise InvalidTrainerSpecError(
            field_name,
            value,
            "must be a DNS label (RFC 1035): lowercase letters, digits and '-', starting with a "
            f"letter, ending with a letter or digit, at most {max_length} characters",
        )
    return value


def _subdomain(field_name: str, value: object) -> str:
    """A DNS-1123 subdomain: what PVC, Secret, ServiceAccount and runtime names must be."""
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise InvalidTrainerSpecError(
            field_name,
            value,
            "must be a DNS subdomain: lowercase letters, digits, '-' and '.', starting and "
            "ending with a letter or digit, at most 253 characters",
        )
    return value


def _secret_key(field_name: str, value: str) -> str:
    # The API server refuses these too, but only when the pod is created: by then the attempt
    # is open and the pod sits in CreateContainerConfigError. Refused here, before either.
    if (
        len(value) > 253
        or not _SECRET_KEY.match(value)
        or value in (".", "..")
        or value.startswith("..")
    ):
        raise InvalidTrainerSpecError(
            field_name,
            value,
            "must be a Secret key: letters, digits, '-', '_' and '.', at most 253 characters,"
            " not '.' or '..' and not starting with '..'",
        )
    return value


def _quantity(field_name: str, value: object) -> str:
    if not isinstance(value, str) or not _QUANTITY.match(value):
        raise InvalidTrainerSpecError(
            field_name, value, "must be a Kubernetes quantity string such as '4', '500m', '16Gi'"
        )
    return value


def _quantity_value(value: str) -> Decimal:
    """A quantity already matched by ``_QUANTITY`` as a number (cores, bytes, a count)."""
    match = _QUANTITY.match(value)
    assert match is not None, value
    number, tail = Decimal(match.group(1)), match.group(3) or ""
    if tail in _QUANTITY_SUFFIX:
        return number * _QUANTITY_SUFFIX[tail]
    try:
        return number.scaleb(int(tail[1:]))  # a decimal exponent: "2e3"
    except (InvalidOperation, ValueError):
        return Decimal("Infinity")


def _mount_path(path: object, python: str) -> str:
    """Refuse a mount path that would hide the system, the interpreter or the pod's token."""
    if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/"):
        raise InvalidTrainerSpecError(
            "checkpoint_mount_path", path, "must be an absolute path without '..'"
        )
    if "\x00" in path:
        raise InvalidTrainerSpecError("checkpoint_mount_path", path, "must not hold a NUL")
    # "//etc/." is /etc: compare what the kubelet would mount at.
    mount = PurePosixPath("/" + path.lstrip("/"))
    if mount == PurePosixPath("/"):
        raise InvalidTrainerSpecError(
            "checkpoint_mount_path", path, "must not be '/': the claim would hide the whole image"
        )
    if _PACKAGE_DIRS & set(mount.parts):
        raise InvalidTrainerSpecError(
            "checkpoint_mount_path", path, "must not be in a site-packages or dist-packages folder"
        )
    if any(mount.is_relative_to(state) for state in STATE_FOLDERS):
        return path
    # Most specific first, so the refusal names the token folder rather than /var.
    protected = [(f, "the service-account token folder") for f in SERVICE_ACCOUNT_FOLDERS]
    protected += list(PYTHON_FOLDERS.items())
    interpreter = PurePosixPath(python)
    if interpreter.is_absolute() and len(interpreter.parts) > 3:
        # .../bin/python: the prefix above bin/ holds the interpreter's lib/ and packages.
        protected.append((str(interpreter.parent.parent), f"the prefix of {python}"))
    protected += [(f, "a system folder") for f in SYSTEM_FOLDERS]
    for folder, what in protected:
        if mount.is_relative_to(folder) or PurePosixPath(folder).is_relative_to(mount):
            raise InvalidTrainerSpecError(
                "checkpoint_mount_path",
                path,
                f"must not be {folder} ({what}), under it or above it: the claim mounted there "
                "would hide what the trainer runs on; use a folder of its own such as "
                "/checkpoints or /mnt/tracks",
            )
    return path


def _label_map(field_name: str, labels: Mapping[str, str]) -> Mapping[str, str]:
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/") if isinstance(key, str) else ("", "", key)
        ok = (
            isinstance(key, str)
            and name
            and len(name) <= 63
            and _LABEL_NAME.match(name)
            and (not prefix or (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix)))
        )
        if not ok:
            raise InvalidTrainerSpecError(
                f"{field_name}[{key!r}]",
                key,
                "a label key is an optional DNS subdomain prefix and '/', then at most 63 "
                "letters, digits, '-', '_' or '.' starting and ending with a letter or digit",
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_NAME.match(value):
            raise InvalidTrainerSpecError(
                f"{field_name}[{key!r}]",
                value,
                "a label value is at most 63 letters, digits, '-', '_' or '.', starting and "
                "ending with a letter or digit (or empty)",
            )
    return MappingProxyType(dict(labels))


def _check_image(image: object) -> str:
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise InvalidTrainerSpecError("image", image, "must be a non-empty image reference")
    if "@" in image:
        if not _DIGEST.search(image):
            raise InvalidTrainerSpecError(
                "image", image, "a digest must be '@sha256:' and 64 lowercase hex digits"
            )
        return image
    last = image.rsplit("/", 1)[-1]
    name, sep, tag = last.partition(":")
    if not sep or not name or not _TAG.match(tag):
        raise InvalidTrainerSpecError(
            "image",
            image,
            "pin the image with a digest (repo@sha256:…) or at least a tag (repo:tag), so the "
            "attempt records what actually ran",
        )
    if tag == "latest":
        # 'latest' records nothing: the same words name a different image tomorrow.
        raise InvalidTrainerSpecError(
            "image", image, "'latest' is not a version; use a digest or a release tag"
        )
    return image


@dataclass(frozen=True)
class NodeResources:
    """What one node (one pod) of the job asks for, within bounds.

    ``cpu`` more than 0 and at most 512 cores, ``memory`` from 128Mi to 4Ti, ``gpus`` from 0 to
    16: past those a typo is likelier than a node, and the pods would wait for one forever.
    """

    cpu: str = "4"
    memory: str = "16Gi"
    gpus: int = 0
    gpu_resource: str = "nvidia.com/gpu"

    def __post_init__(self) -> None:
        cpu = _quantity_value(_quantity("resources.cpu", self.cpu))
        if not 0 < cpu <= MAX_CPU:
            raise InvalidTrainerSpecError(
                "resources.cpu", self.cpu, f"must be more than 0 and at most {MAX_CPU} cores"
            )
        memory = _quantity_value(_quantity("resources.memory", self.memory))
        if not _quantity_value(MIN_MEMORY) <= memory <= _quantity_value(MAX_MEMORY):
            raise InvalidTrainerSpecError(
                "resources.memory", self.memory, f"must be from {MIN_MEMORY} to {MAX_MEMORY}"
            )
        if (
            isinstance(self.gpus, bool)
            or not isinstance(self.gpus, int)
            or not 0 <= self.gpus <= MAX_GPUS
        ):
            raise InvalidTrainerSpecError(
                "resources.gpus", self.gpus, f"must be an integer from 0 to {MAX_GPUS}"
            )
        prefix, _, name = self.gpu_resource.rpartition("/")
        if not prefix or not _DNS_SUBDOMAIN.match(prefix) or not _LABEL_NAME.match(name):
            raise InvalidTrainerSpecError(
                "resources.gpu_resource",
                self.gpu_resource,
                "an extended resource name such as 'nvidia.com/gpu'",
            )

    def requirements(self) -> dict[str, dict[str, str]]:
        """A core/v1 ``ResourceRequirements``.

        No CPU limit: CFS throttling of data-loader and NCCL threads costs more than a noisy
        neighbour. Memory limit = request, so an OOM kill is the pod's own doing and the kubelet
        reports it as ``OOMKilled`` on this container. Extended resources (GPUs) must appear in
        limits and may not be overcommitted, so requests equal limits.
        """
        requests = {"cpu": self.cpu, "memory": self.memory}
        limits = {"memory": self.memory}
        if self.gpus:
            requests[self.gpu_resource] = str(self.gpus)
            limits[self.gpu_resource] = str(self.gpus)
        return {"requests": requests, "limits": limits}


@dataclass(frozen=True)
class TrainerSpec:
    """One distributed trainer launch: ``nnodes`` pods times ``nproc_per_node`` processes.

    ``args`` are the trainer's own arguments (``python -m pipeline.trainer`` takes them); the
    container command is the Tracks torchrun wrapper in front of them (:attr:`command`).
    Secrets go in ``secret_env`` as ``{VAR: (secret_name, key)}`` and render as
    ``valueFrom.secretKeyRef``; an inline ``env`` value that looks like a credential is refused.
    ``nnodes`` is at most 1024 and ``nproc_per_node`` at most 64 (:class:`NodeResources` states
    its own bounds). ``checkpoint_mount_path`` may not be ``/``, a system folder (``/etc``,
    ``/usr``, ``/var``, …), the interpreter's folders (site-packages, ``/opt/conda``, the prefix
    of an absolute ``python``, the image's ``/opt/tracks``) or the service-account token folder,
    nor lie under or above one; ``/var/lib/tracks``, the image's ``TRACKS_HOME``, is allowed.
    """

    name: str
    image: str
    args: tuple[str, ...] = ()
    namespace: str = "default"
    nnodes: int = 1
    nproc_per_node: int = 1
    resources: NodeResources = field(default_factory=NodeResources)
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    checkpoint_pvc: str | None = None
    checkpoint_mount_path: str = "/checkpoints"
    shm_size: str | None = "1Gi"
    termination_grace_seconds: int = 120
    labels: Mapping[str, str] = field(default_factory=dict)
    master_port: int = 29500
    python: str = "python"
    runtime: str = DEFAULT_RUNTIME
    ttl_seconds_after_finished: int | None = None
    service_account: str | None = None

    def __post_init__(self) -> None:
        _label("namespace", self.namespace)
        self._check_counts()
        # Pod hostnames are '<name>-node-<job>-<index>' under a JobSet and '<name>-<index>' under
        # an Indexed Job; each must itself be a DNS label, so the name leaves room for the suffix.
        suffix = f"-{REPLICATED_JOB_NAME}-0-{self.nnodes - 1}"
        _label("name", self.name, _DNS_LABEL_MAX - len(suffix))
        _check_image(self.image)
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise InvalidTrainerSpecError("args", self.args, "must be a sequence of strings")
        object.__setattr__(self, "args", tuple(self.args))
        if not isinstance(self.resources, NodeResources):
            raise InvalidTrainerSpecError("resources", self.resources, "must be a NodeResources")
        object.__setattr__(self, "env", self._check_env(self.env))
        object.__setattr__(self, "secret_env", self._check_secret_env(self.secret_env))
        object.__setattr__(self, "labels", _label_map("labels", self.labels))
        if self.checkpoint_pvc is not None:
            _subdomain("checkpoint_pvc", self.checkpoint_pvc)
        _mount_path(self.checkpoint_mount_path, self.python)
        if self.shm_size is not None:
            _quantity("shm_size", self.shm_size)
        if self.service_account is not None:
            _subdomain("service_account", self.service_account)
        _subdomain("runtime", self.runtime)

    def _check_counts(self) -> None:
        bounds = {
            "nnodes": (self.nnodes, 1, MAX_NNODES),
            "nproc_per_node": (self.nproc_per_node, 1, MAX_NPROC_PER_NODE),
            "termination_grace_seconds": (self.termination_grace_seconds, 1, 86400),
            "master_port": (self.master_port, 1024, 65535),
        }
        if self.ttl_seconds_after_finished is not None:
            bounds["ttl_seconds_after_finished"] = (self.ttl_seconds_after_finished, 0, 2**31 - 1)
        for name, (value, low, high) in bounds.items():
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidTrainerSpecError(
                    name, value, f"must be an integer from {low} to {high}"
                )

    @staticmethod
    def _check_env_name(field_name: str, name: object) -> str:
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise InvalidTrainerSpecError(
                field_name, name, "an environment variable name: letters, digits and '_'"
            )
        if name.startswith(RESERVED_ENV_PREFIXES) or name in RESERVED_ENV:
            raise InvalidTrainerSpecError(
                field_name,
                name,
                "reserved: Tracks sets PET_* (torchrun), DAGSTER_PIPES_* (Pipes) and "
                f"{', '.join(sorted(RESERVED_ENV))} itself",
            )
        return name

    @classmethod
    def _check_env(cls, env: Mapping[str, str]) -> Mapping[str, str]:
        for name, value in env.items():
            cls._check_env_name(f"env[{name!r}]", name)
            if not isinstance(value, str):
                raise InvalidTrainerSpecError(f"env[{name!r}]", value, "must be a string")
            if _SECRET_NAME.search(name) or redact.text(value) != value:
                # Never echo the value: it is the thing being protected.
                raise InvalidTrainerSpecError(
                    f"env[{name!r}]",
                    redact.MASK,
                    "looks like a secret; pass it as secret_env={name: (secret, key)} so it "
                    "renders as valueFrom.secretKeyRef and never lands in a manifest",
                )
        return MappingProxyType(dict(env))

    @classmethod
    def _check_secret_env(
        cls, secret_env: Mapping[str, tuple[str, str]]
    ) -> Mapping[str, tuple[str, str]]:
        checked: dict[str, tuple[str, str]] = {}
        for name, ref in secret_env.items():
            cls._check_env_name(f"secret_env[{name!r}]", name)
            if (
                not isinstance(ref, tuple | list)
                or len(ref) != 2
                or not all(isinstance(part, str) and part for part in ref)
            ):
                raise InvalidTrainerSpecError(
                    f"secret_env[{name!r}]", ref, "must be a (secret name, key) pair"
                )
            _subdomain(f"secret_env[{name!r}].secret", ref[0])
            _secret_key(f"secret_env[{name!r}].key", ref[1])
            checked[name] = (ref[0], ref[1])
        return MappingProxyType(checked)

    @property
    def image_digest(self) -> str | None:
        """``sha256:…`` when the image is pinned by digest, else None (a tag only)."""
        return self.image.rsplit("@", 1)[1] if "@" in self.image else None

    @property
    def command(self) -> list[str]:
        """The container command: the Tracks torchrun wrapper; ``args`` follow ``--``."""
        return [
            self.python,
            "-m",
            "pipeline.distributed.launch",
            "--nproc-per-node",
            str(self.nproc_per_node),
            "--",
        ]


def trainer_name(run_id: str, attempt_no: int, nnodes: int = 1) -> str:
    """A DNS-label name for one attempt of a run, unique per (run, attempt).

    Run ids allow capitals, '_' and '.', which Kubernetes names do not; the slug keeps them
    readable and a digest of the exact id keeps two runs that slug alike apart.
    """
    run = ids.run_id(run_id)
    attempt = ids.attempt_no(attempt_no)
    digest = hashlib.sha256(run.encode()).hexdigest()[:8]
    tail = f"-{digest}-a{attempt}"
    room = _DNS_LABEL_MAX - len(f"-{REPLICATED_JOB_NAME}-0-{max(nnodes, 1) - 1}") - len(tail) - 2
    slug = re.sub(r"[^a-z0-9]+", "-", run.lower()).strip("-")[:room].rstrip("-")
    return f"t-{slug}{tail}" if slug else f"t{tail}"
