"""Launches the trainer out of process through Dagster Pipes.

A small custom Pipes client rather than ``PipesSubprocessClient`` because Tracks needs what
that client throws away on failure: the exit code, the signal, and the trainer's custom
messages, which together decide the attempt's termination reason. It also signals the
trainer's whole process group (so ``torchrun`` workers are reached) and escalates to SIGKILL
only after the grace period.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, TypeVar

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError

from pipeline import envvars, redact
from pipeline.kube.spec import (
    Backend,
    InvalidTrainerSpecError,
    NodeResources,
    TrainerSpec,
    trainer_name,
)
from pipeline.reasons import AttemptEvidence, ObservedEnding, Termination
from pipeline.states import TerminationReason

if TYPE_CHECKING:
    # Imported when used: the kubernetes client is slow to load and only this backend needs it.
    from resources.kube_pipes import TrainJobPipesClient


@dataclass(frozen=True)
class TrainerExit:
    """How the trainer ended, and what it said through Pipes on the way.

    ``returncode`` is None when no exit was seen (a Kubernetes pod that never ran or vanished).
    ``observed`` and ``placement`` come from the Kubernetes backend: what the cluster saw of the
    ending (``finish_attempt(observed=…)``) and where rank 0 ran (the receipt's placement).
    """

    returncode: int | None
    signal_name: str | None
    custom_messages: list[Any] = field(default_factory=list)
    interrupted: bool = False
    observed: ObservedEnding | None = None
    placement: Mapping[str, Any] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        said = self.observed.termination.reason if self.observed else TerminationReason.SUCCEEDED
        return self.returncode == 0 and said == TerminationReason.SUCCEEDED


def _signal_name(returncode: int) -> str | None:
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"


class TrainerPipesClient(dg.PipesClient):
    """Runs ``python -m pipeline.trainer …`` in its own process group inside a Pipes session."""

    def __init__(self, termination_grace_seconds: float, env: Mapping[str, str] | None = None):
        self.termination_grace_seconds = termination_grace_seconds
        self.env = dict(env or {})

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    def run(  # type: ignore[override]
        self,
        *,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        command: Sequence[str],
        extras: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> tuple[dg.PipesClientCompletedInvocation, TrainerExit]:
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesTempFileContextInjector(),
            # A thread tails the trainer's message file while it runs: its log messages (the
            # progress line of each interval) reach context.log, and the run page, at once;
            # custom messages wait in the session for the asset, after the trainer exits.
            message_reader=dg.PipesTempFileMessageReader(),
            extras=extras,
        ) as session:
            process = subprocess.Popen(
                list(command),
                cwd=cwd,
                env={**os.environ, **self.env, **(env or {}), **session.get_bootstrap_env_vars()},
                start_new_session=True,
            )
            interrupted = False
            try:
                process.wait()
            except DagsterExecutionInterruptedError:
                interrupted = True
                context.log.info("run terminated: asking the trainer to checkpoint and stop")
                self._stop(process)
                raise
            finally:
                if process.poll() is None:
                    self._stop(process)
        invocation = dg.PipesClientCompletedInvocation(session)
        outcome = TrainerExit(
            returncode=process.returncode,
            signal_name=_signal_name(process.returncode),
            custom_messages=list(session.get_custom_messages()),
            interrupted=interrupted,
        )
        return invocation, outcome

    def _stop(self, process: subprocess.Popen[bytes]) -> None:
        # SIGTERM to the group: the trainer treats it like SIGINT (flag, final save, exit).
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=self.termination_grace_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass


class TrainerBackend(StrEnum):
    """Where the trainer's processes run."""

    LOCAL = "local"  # one process, a subprocess of the step
    TORCHRUN = "torchrun"  # nproc_per_node ranks on this machine, under torchrun's agent
    KUBERNETES = "kubernetes"  # nnodes pods x nproc_per_node ranks (docs/kubernetes.md)


class TrainerConfigError(ValueError):
    """A value in ``resources.trainer.config`` that cannot run; ``field`` names the key."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(message)


class SecretKeyRef(dg.Config):
    """One key of a Kubernetes Secret in the trainer's namespace."""

    secret: str
    """The Secret's name."""
    key: str
    """The key inside it whose value becomes the variable."""


# TrainerSpec fields whose config key has another name here.
_CONFIG_KEY = {
    "resources.cpu": "cpu",
    "resources.memory": "memory",
    "resources.gpus": "gpus",
    "resources.gpu_resource": "gpu_resource",
}
# world() checks the spec before the attempt whose run id names the workload exists.
_PLACEHOLDER_RUN = "config-check"


# An hour covers the largest final save; past that a preemption notice has long expired.
MAX_GRACE_SECONDS = 3600


class TrainerLauncherResource(dg.ConfigurableResource):
    """Where and how the trainer runs: a subprocess of the step, N ranks under torchrun, or
    ``nnodes`` pods of N ranks on Kubernetes.

    Chosen per run in the run config (``resources: trainer: config: {backend: torchrun,
    nproc_per_node: 2}``); nothing else about the assets changes. ``backend: kubernetes``
    creates a TrainJob, JobSet or Indexed Job through
    :class:`resources.kube_pipes.TrainJobPipesClient` and needs the fields below the line; the
    step pod and the trainer pods must mount the same ``checkpoint_pvc`` at the same
    ``checkpoint_mount_path``, with the step's storage roots (``TRACKS_HOME``) under it, so the
    paths in the trainer's arguments resolve in both (docs/kubernetes.md).
    """

    termination_grace_seconds: float = 30.0
    """How long the trainer has between SIGTERM and SIGKILL for its final save (≤ 3600 s)."""
    backend: str = TrainerBackend.LOCAL.value
    nproc_per_node: int = 1
    # -- backend: kubernetes -------------------------------------------------------------------
    image: str | None = None
    """The trainer's image, pinned by digest (repo@sha256:…) or a release tag; never latest."""
    namespace: str = "default"
    nnodes: int = 1
    workload: str = Backend.TRAINJOB.value
    """Which objects run the trainer: trainjob (Kubeflow Trainer), jobset, or indexed_job."""
    checkpoint_pvc: str | None = None
    """The ReadWriteMany claim the step pod also mounts: checkpoints, configs, snapshots."""
    checkpoint_mount_path: str = TrainerSpec.checkpoint_mount_path
    """Where both the step pod and the trainer pods mount ``checkpoint_pvc``."""
    service_account: str | None = None
    cpu: str = NodeResources.cpu
    memory: str = NodeResources.memory
    gpus: int = NodeResources.gpus
    """Per node (pod); a rank per GPU is usual, so nproc_per_node = gpus."""
    gpu_resource: str = NodeResources.gpu_resource
    secret_env: dict[str, SecretKeyRef] = {}
    """Trainer variables read from Secrets, e.g. ``TRACKS_LEDGER_URL: {secret: tracks-ledger,
    key: url}``; their inline values are dropped, so no password lands in a manifest."""
    runtime: str = TrainerSpec.runtime
    """The ClusterTrainingRuntime of a TrainJob (a copy with a longer grace period, say)."""
    shm_size: str | None = TrainerSpec.shm_size
    poll_interval_seconds: float = 5.0
    pod_start_timeout_seconds: float = 3600.0
    """How long rank 0 may stay unscheduled or pulling (time queued in Kueue counts)."""
    unschedulable_timeout_seconds: float = 300.0
    """How long the scheduler may say rank 0 fits no node (PodScheduled=False, Unschedulable)
    before the attempt ends quoting it; a cluster autoscaler adding a node takes minutes."""

    @property
    def python_executable(self) -> str:
        """The trainer's interpreter: the code server's own, or ``TRACKS_TRAINER_PYTHON``.

        A deployment setting, never run config: whoever launches a run would otherwise choose
        the program that starts with the ledger's and MLflow's credentials in its environment.
        """
        return envvars.TRACKS_TRAINER_PYTHON.get() or sys.executable

    def world(self, env: Mapping[str, str] | None = None) -> tuple[TrainerBackend, int]:
        """The backend and the number of ranks, checked (a clear error for a bad run config).

        For Kubernetes the whole trainer spec is built and validated, with ``env`` (the
        attempt's environment) when given, so an inline credential is refused here too.
        Raises :class:`TrainerConfigError` naming the config key.
        """
        backend = _choice("backend", self.backend, TrainerBackend)
        grace = self.termination_grace_seconds
        if not (math.isfinite(grace) and 0 < grace <= MAX_GRACE_SECONDS):
            # NaN or inf would never escalate to SIGKILL; 0 or less kills before any final save.
            raise TrainerConfigError(
                "termination_grace_seconds",
                f"resources.trainer.config.termination_grace_seconds is {grace}; "
                f"it must be greater than 0 and at most {MAX_GRACE_SECONDS}",
            )
        if not 1 <= self.nproc_per_node <= 64:
            raise TrainerConfigError(
                "nproc_per_node",
                f"resources.trainer.config.nproc_per_node is {self.nproc_per_node}; "
                "it must be between 1 and 64",
            )
        if backend is TrainerBackend.LOCAL and self.nproc_per_node != 1:
            raise TrainerConfigError(
                "nproc_per_node",
                "resources.trainer.config.nproc_per_node > 1 needs backend: torchrun "
                "(the local backend runs one process)",
            )
        if backend is not TrainerBackend.KUBERNETES:
            if self.nnodes != 1:
                raise TrainerConfigError(
                    "nnodes",
                    f"resources.trainer.config.nnodes is {self.nnodes}; more than one node "
                    f"needs backend: kubernetes ({backend.value} runs on this machine)",
                )
            return backend, self.nproc_per_node
        self.trainer_spec(trainer_name(_PLACEHOLDER_RUN, 1, max(self.nnodes, 1)), env=env)
        for key in (
            "poll_interval_seconds",
            "pod_start_timeout_seconds",
            "unschedulable_timeout_seconds",
        ):
            if not getattr(self, key) > 0:
                raise TrainerConfigError(
                    key, f"resources.trainer.config.{key} is {getattr(self, key)}; it must be > 0"
                )
        return backend, self.nnodes * self.nproc_per_node

    def trainer_spec(
        self, name: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> TrainerSpec:
        """The Kubernetes :class:`TrainerSpec` this config describes, validated there.

        Variables named in ``secret_env`` render as ``secretKeyRef`` and their inline values
        in ``env`` are dropped; any other inline value that looks like a credential is refused
        naming the variable (never its value) and the ``secret_env`` key to set.
        """
        if not self.image:
            raise TrainerConfigError(
                "image",
                "resources.trainer.config.image is required for backend: kubernetes (the "
                "trainer's image, pinned by digest repo@sha256:… or a release tag)",
            )
        if self.checkpoint_pvc is None:
            raise TrainerConfigError(
                "checkpoint_pvc",
                "resources.trainer.config.checkpoint_pvc is required for backend: kubernetes: "
                "the step and the trainer pods share checkpoints, configs and snapshots through "
                "that claim (ReadWriteMany), mounted at checkpoint_mount_path in both",
            )
        _choice("workload", self.workload, Backend)
        secret_env = {var: (ref.secret, ref.key) for var, ref in self.secret_env.items()}
        inline = {var: value for var, value in (env or {}).items() if var not in secret_env}
        try:
            return TrainerSpec(
                name=name,
                image=self.image,
                args=tuple(args),
                namespace=self.namespace,
                nnodes=self.nnodes,
                nproc_per_node=self.nproc_per_node,
                resources=NodeResources(
                    cpu=self.cpu, memory=self.memory, gpus=self.gpus, gpu_resource=self.gpu_resource
                ),
                env=inline,
                secret_env=secret_env,
                checkpoint_pvc=self.checkpoint_pvc,
                checkpoint_mount_path=self.checkpoint_mount_path,
                shm_size=self.shm_size,
                # The spec counts whole seconds; rounding up never cuts a final save short.
                termination_grace_seconds=math.ceil(self.termination_grace_seconds),
                service_account=self.service_account,
                runtime=self.runtime,
            )
        except InvalidTrainerSpecError as error:
            raise _config_error(error) from None

    def trainer_command(self, *args: str, log_dir: str | None = None) -> list[str]:
        backend, nproc = self.world()
        if backend is TrainerBackend.KUBERNETES:
            raise TrainerConfigError(
                "backend", "backend: kubernetes has no local command; launch() creates pods"
            )
        if backend is TrainerBackend.LOCAL:
            return [self.python_executable, "-m", "pipeline.trainer", *args]
        launch = [self.python_executable, "-m", "pipeline.distributed.launch"]
        launch += ["--nproc-per-node", str(nproc)]
        if log_dir:
            launch += ["--log-dir", log_dir]
        return [*launch, "--", *args]

    def launch(
        self,
        context: dg.AssetExecutionContext,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        extras: Mapping[str, Any] | None = None,
        log_dir: str | None = None,
    ) -> tuple[dg.PipesClientCompletedInvocation | None, TrainerExit]:
        """Run the trainer with ``args`` and ``env``; how it ended, and its Pipes session.

        The invocation is None when the trainer was never launched (Kubernetes refused the
        workload): the returned :class:`TrainerExit` then says why, for the receipt.
        """
        backend, _ = self.world()
        if backend is TrainerBackend.KUBERNETES:
            return self._launch_on_kubernetes(context, args, env=env or {}, extras=extras or {})
        client = TrainerPipesClient(self.termination_grace_seconds)
        return client.run(
            context=context,
            command=self.trainer_command(*args, log_dir=log_dir),
            env=env,
            extras=extras,
        )

    def kube_client(self) -> TrainJobPipesClient:
        """The Kubernetes Pipes client: in-cluster config in a run pod, else the kubeconfig."""
        from resources.kube_pipes import TrainJobPipesClient

        return TrainJobPipesClient(
            poll_interval=self.poll_interval_seconds,
            pod_start_timeout=self.pod_start_timeout_seconds,
            unschedulable_timeout=self.unschedulable_timeout_seconds,
        )

    def _launch_on_kubernetes(
        self,
        context: dg.AssetExecutionContext,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        extras: Mapping[str, Any],
    ) -> tuple[dg.PipesClientCompletedInvocation | None, TrainerExit]:
        import kubernetes

        from resources.kube_pipes import TrainerLaunchError

        run_id, attempt_no = extras.get("run_id"), extras.get("attempt_no")
        if not isinstance(run_id, str) or not isinstance(attempt_no, int):
            raise ValueError(
                "backend: kubernetes names the workload after the attempt: extras must carry "
                f"run_id and attempt_no, got {sorted(extras)}"
            )
        try:
            spec = self.trainer_spec(
                trainer_name(run_id, attempt_no, self.nnodes), args=args, env=env
            )
            _check_on_shared_volume(spec)
        except TrainerConfigError as error:
            # The attempt is open already: it ends with the reason, and no retry mends config.
            return None, self._not_launched(context, TerminationReason.USER_CODE_ERROR, error)
        client = self.kube_client()
        try:
            client.apis  # noqa: B018 - fail here, before a Pipes session, if no API is configured
            invocation, ending = client.run(
                context=context, spec=spec, backend=self.workload, extras=extras
            )
        except kubernetes.config.ConfigException as error:
            return None, self._not_launched(
                context, TerminationReason.USER_CODE_ERROR, error, "no Kubernetes API configured"
            )
        except TrainerLaunchError as error:
            # RBAC, a missing operator (404 on the kind) or admission (422) refuse it again on
            # retry; an API server that is overloaded or restarting may not.
            reason = TerminationReason.USER_CODE_ERROR
            if error.status is None or error.status == 429 or error.status >= 500:
                reason = TerminationReason.INFRA_TRANSIENT
            return None, self._not_launched(context, reason, error)
        placement = {
            **ending.placement(),
            "nodes": spec.nnodes,
            "accelerator_type": spec.resources.gpu_resource if spec.resources.gpus else "cpu",
            "accelerator_count": spec.resources.gpus * spec.nnodes,
        }
        outcome = TrainerExit(
            returncode=ending.returncode,
            signal_name=ending.signal_name,
            custom_messages=ending.custom_messages,
            interrupted=ending.interrupted,
            observed=ending.observed(),
            placement=placement,
        )
        return invocation, outcome

    def _not_launched(
        self,
        context: dg.AssetExecutionContext,
        reason: TerminationReason,
        error: Exception,
        what: str | None = None,
    ) -> TrainerExit:
        said = redact.text(f"{what}: {error}" if what else str(error)).rstrip(".")
        context.log.error(f"the trainer was not launched on Kubernetes: {said}")
        termination = Termination(reason, f"The trainer was not launched on Kubernetes: {said}.")
        return TrainerExit(
            returncode=None,
            signal_name=None,
            observed=ObservedEnding(AttemptEvidence(), termination, decisive=True),
            placement={"launcher": TrainerBackend.KUBERNETES.value, "namespace": self.namespace},
        )


_E = TypeVar("_E", bound=StrEnum)


def _choice(key: str, value: str, kind: type[_E]) -> _E:
    """``value`` as a member of ``kind``, or an error naming the config key and the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise TrainerConfigError(
            key, f"resources.trainer.config.{key} is {value!r}; choose one of {choices}"
        ) from None


def _config_error(error: InvalidTrainerSpecError) -> TrainerConfigError:
    """The spec's refusal in the words of the run config: which key to change, and how."""
    if error.field.startswith("env[") and error.value == redact.MASK:
        variable = error.field[len("env[") : -1].strip("'\"")
        return TrainerConfigError(
            "secret_env",
            f"resources.trainer.config.secret_env has no entry for {variable}, and its value "
            "looks like a credential (not shown), so it may not be written into a manifest: "
            f"add secret_env: {{{variable}: {{secret: <Secret name>, key: <key>}}}} so the "
            "trainer pods read it from a Kubernetes Secret",
        )
    key = _CONFIG_KEY.get(error.field) or error.field.split("[", 1)[0]
    return TrainerConfigError(key, f"resources.trainer.config.{key}: {error}")


def _check_on_shared_volume(spec: TrainerSpec) -> None:
    """Every path the trainer is handed must lie on the volume the trainer pods mount."""
    mount = PurePosixPath(spec.checkpoint_mount_path)
    for arg in spec.args:
        if arg.startswith("/") and not PurePosixPath(os.path.normpath(arg)).is_relative_to(mount):
            raise TrainerConfigError(
                "checkpoint_mount_path",
                f"resources.trainer.config.checkpoint_mount_path is {mount}, but the trainer is "
                f"handed {arg}, outside it: the trainer pods see only {spec.checkpoint_pvc} "
                f"there, so the step pod must mount the same claim at {mount} and keep its "
                f"storage roots ({envvars.TRACKS_HOME.name}) under it",
            )
