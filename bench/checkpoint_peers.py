"""The peers ``checkpoint_bench.py`` measures Tracks against, on the same live state.

Each peer saves the model and the Adam state durably (fsync) and restores them into the live
model and optimizer, the way its own documentation does it:

- ``torch.save`` + fsync / ``torch.load(weights_only=True)`` + ``load_state_dict``;
- safetensors ``save_file`` (optimizer tensors flattened, param groups as metadata) + fsync /
  ``load_file`` + ``load_state_dict``;
- torch.distributed.checkpoint (DCP) ``save`` / ``load`` with ``get_state_dict`` and
  ``set_state_dict`` (single process: DCP runs without a process group), its FileSystemWriter
  fsyncs by default; ``async_save`` with its default staging, and with ``DefaultStager``'s
  asynchronous staging.

No peer verifies what it reads against a digest: Tracks' restore does (every byte, plus the
probe batch in ``resume``), so a peer's restore is a floor Tracks has to meet with more work.

A save is started with ``start`` and returns a ``PendingSave``, so that a training loop can run
beside an asynchronous one the way its documentation asks: the next ``optimizer.step()`` only
after ``staged()``, the next save only after ``durable()`` of the one before.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn import Module
from torch.optim import Optimizer

from pipeline.durable import fsync_dir, fsync_file


@dataclass(frozen=True)
class Loop:
    """The training loop's two halves: an async save may overlap the first, not the second."""

    forward_backward: Callable[[], None]
    optimizer_step: Callable[[], None]


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class PendingSave:
    """A save in progress: ``staged`` returns once the live state may change again (its bytes
    are copied), ``durable`` once the save is on disk. A synchronous save is both on return."""

    staged: Callable[[], None] = _nothing
    durable: Callable[[], None] = _nothing
    synchronous: bool = True


@dataclass
class PeerFigures:
    """Per repeat: seconds of a durable save, of the loop's stall (async peers) and of a cold
    restore; training steps per second with a save every ``--save-every`` steps."""

    name: str
    save: list[float] = field(default_factory=list)
    stall: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    training: list[float] = field(default_factory=list)


def _fsync_tree(directory: Path) -> None:
    for path in [*directory.rglob("*"), directory]:
        if path.is_dir():
            fsync_dir(path)
        else:
            fsync_file(path)


class Peer:
    """A checkpointing method: saves durably and restores into the live model and optimizer."""

    name = ""

    def save(self, model: Module, optimizer: Optimizer, target: Path,
             loop: Loop) -> tuple[float, float]:  # fmt: skip
        """Save durably into ``target``: (seconds the loop was stalled, seconds to durable).

        A synchronous save stalls the loop for all of it; an asynchronous one lets ``loop``
        run its next forward/backward, and its ``optimizer_step`` wait for staging.
        """
        began = time.perf_counter()
        pending = self.start(model, optimizer, target)
        stall = time.perf_counter() - began
        if pending.synchronous:
            return stall, stall
        loop.forward_backward()
        waited_from = time.perf_counter()
        pending.staged()  # the parameters may not change before this
        stall += time.perf_counter() - waited_from
        loop.optimizer_step()
        pending.durable()
        return stall, time.perf_counter() - began

    def start(self, model: Module, optimizer: Optimizer, target: Path) -> PendingSave:
        """Begin a durable save into ``target``; a synchronous peer finishes it here."""
        self.write(model, optimizer, target)
        return PendingSave()

    def write(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        raise NotImplementedError

    def restore(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the peer keeps between saves (DCP's stager and its buffers)."""


class TorchSave(Peer):
    name = "torch.save / torch.load(weights_only=True)"

    def write(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        target.mkdir()
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, target / "ckpt.pt"
        )
        _fsync_tree(target)

    def restore(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        saved = torch.load(target / "ckpt.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])


class Safetensors(Peer):
    name = "safetensors save_file / load_file"

    def write(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        target.mkdir()
        saved = optimizer.state_dict()
        tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
        for index, per_param in saved["state"].items():
            for key, value in per_param.items():
                tensors[f"optimizer.{index}.{key}"] = value
        groups = json.dumps(saved["param_groups"])
        save_file(tensors, target / "ckpt.safetensors", metadata={"param_groups": groups})
        _fsync_tree(target)

    def restore(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        from safetensors import safe_open

        with safe_open(target / "ckpt.safetensors", "pt") as handle:
            groups = json.loads(handle.metadata()["param_groups"])
        tensors = load_file(target / "ckpt.safetensors")
        model.load_state_dict(
            {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        )
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        optimizer.load_state_dict({"state": state, "param_groups": groups})


class DcpSave(Peer):
    name = "DCP save / load"

    def write(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=target)

    def restore(self, model: Module, optimizer: Optimizer, target: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=target)
        set_state_dict(
            model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )


class DcpAsyncSave(DcpSave):
    """``dcp.async_save``: the loop is stalled until the state is staged (default: a copy on
    the calling thread; with ``async_staging``: until the stager's copy completes, which the
    next step's forward/backward may overlap, as Tracks' own copy does).

    With async staging, one ``DefaultStager`` serves every save, as in a training loop: it
    keeps its staging memory between saves (as Tracks keeps its host buffers), so only the
    first save allocates."""

    def __init__(self, async_staging: bool) -> None:
        self.async_staging = async_staging
        self.name = "DCP async_save" + (" (DefaultStager, async staging)" if async_staging else "")
        self._stager: Any = None

    def start(self, model: Module, optimizer: Optimizer, target: Path) -> PendingSave:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if not self.async_staging:
            future = dcp.async_save(state, checkpoint_id=target)
            return PendingSave(durable=future.result, synchronous=False)
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # On CPU: pinned and shared memory serve device copies and process checkpointers.
            self._stager = DefaultStager(StagingOptions(False, False, True, False))
        response = dcp.async_save(state, checkpoint_id=target, async_stager=self._stager)
        return PendingSave(
            staged=response.staging_completion.result,
            durable=response.upload_completion.result,
            synchronous=False,
        )

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def all_peers() -> list[Peer]:
    return [TorchSave(), Safetensors(), DcpSave(), DcpAsyncSave(False), DcpAsyncSave(True)]
