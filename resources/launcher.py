"""Launches the trainer out of process through Dagster Pipes.

A small custom Pipes client rather than ``PipesSubprocessClient`` because Tracks needs what
that client throws away on failure: the exit code, the signal, and the trainer's custom
messages, which together decide the attempt's termination reason. It also signals the
trainer's whole process group (so ``torchrun`` workers are reached) and escalates to SIGKILL
only after the grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError


@dataclass(frozen=True)
class TrainerExit:
    """How the trainer process ended, and what it said through Pipes on the way."""

    returncode: int
    signal_name: str | None
    custom_messages: list[Any] = field(default_factory=list)
    interrupted: bool = False

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0


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


class TrainerLauncherResource(dg.ConfigurableResource):
    """Where and how the trainer runs: a subprocess of the step, or N ranks under torchrun.

    Chosen per run in the run config (``resources: trainer: config: {backend: torchrun,
    nproc_per_node: 2}``); nothing else about the assets changes. The Kubernetes backend is
    :class:`resources.kube_pipes.TrainJobPipesClient` (see docs/kubernetes.md).
    """

    python_executable: str = sys.executable
    termination_grace_seconds: float = 30.0
    backend: str = TrainerBackend.LOCAL.value
    nproc_per_node: int = 1

    def world(self) -> tuple[TrainerBackend, int]:
        """The backend and the number of ranks, checked (a clear error for a bad run config)."""
        try:
            backend = TrainerBackend(self.backend)
        except ValueError:
            choices = ", ".join(b.value for b in TrainerBackend)
            raise ValueError(
                f"resources.trainer.config.backend is {self.backend!r}; choose one of {choices}"
            ) from None
        if not 1 <= self.nproc_per_node <= 64:
            raise ValueError(
                f"resources.trainer.config.nproc_per_node is {self.nproc_per_node}; "
                "it must be between 1 and 64"
            )
        if backend is TrainerBackend.LOCAL and self.nproc_per_node != 1:
            raise ValueError(
                "resources.trainer.config.nproc_per_node > 1 needs backend: torchrun "
                "(the local backend runs one process)"
            )
        return backend, self.nproc_per_node

    def trainer_command(self, *args: str, log_dir: str | None = None) -> list[str]:
        backend, nproc = self.world()
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
    ) -> tuple[dg.PipesClientCompletedInvocation, TrainerExit]:
        client = TrainerPipesClient(self.termination_grace_seconds)
        return client.run(
            context=context,
            command=self.trainer_command(*args, log_dir=log_dir),
            env=env,
            extras=extras,
        )
