"""What a checkpoint holds: the list of stateful objects, and staging them to host memory.

Staging (clone every tensor to CPU, encode the rest as JSON, run the probe) happens on the
training thread and is all a save needs from live objects; writing the staged copy touches
only host memory, so it can move to a background writer without changing this module.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from pipeline.checkpoint.codec import decode_state, encode_state

STATE_FORMAT_VERSION = 1


@runtime_checkable
class Stateful(Protocol):
    """Anything that can save and load itself (torchtitan's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RNGState:
    """Python ``random``, numpy, torch CPU and (when present) every CUDA device's generator."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = random.getstate()
        np_state = np.random.get_state(legacy=False)
        np_state["state"]["key"] = np_state["state"]["key"].tolist()
        state: dict[str, Any] = {
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
            "numpy": np_state,
            "torch_cpu": _tensor_bytes(torch.get_rng_state()),
        }
        if torch.cuda.is_available():
            state["cuda"] = [_tensor_bytes(s) for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
        np_state = dict(state["numpy"])
        np_state["state"] = {
            **np_state["state"],
            "key": np.asarray(np_state["state"]["key"], dtype=np.uint32),
        }
        np.random.set_state(np_state)
        torch.set_rng_state(_bytes_tensor(state["torch_cpu"]))
        if "cuda" in state and torch.cuda.is_available():
            saved = [_bytes_tensor(s) for s in state["cuda"]]
            if len(saved) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(saved)
            else:
                # Another device count: each device still gets a saved stream, in order.
                for index in range(torch.cuda.device_count()):
                    torch.cuda.set_rng_state(saved[index % len(saved)], index)


def _tensor_bytes(state: torch.Tensor) -> bytes:
    return state.cpu().numpy().tobytes()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


@dataclass
class TrainingState:
    """Everything a resumed attempt needs to continue the exact trajectory.

    ``model`` goes to ``model.safetensors``; ``stateful()`` lists the rest, whose tensors go to
    ``optimizer.safetensors`` and whose plain values go to ``trainer_state.json``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data_cursor: Stateful
    config: dict[str, Any]
    config_sha256: str
    probe_inputs: torch.Tensor
    lr_scheduler: Any | None = None
    grad_scaler: Any | None = None
    rng: RNGState = field(default_factory=RNGState)
    step: int = 0
    data_manifest_sha256: str | None = None
    snapshot_id: str | None = None

    def stateful(self) -> dict[str, Stateful]:
        parts: dict[str, Stateful] = {
            "optimizer": self.optimizer,
            "data_cursor": self.data_cursor,
            "rng": self.rng,
        }
        if self.lr_scheduler is not None:
            parts["lr_scheduler"] = self.lr_scheduler
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            parts["grad_scaler"] = self.grad_scaler
        return parts


@dataclass(frozen=True)
class StagedCheckpoint:
    """A host-memory copy of one checkpoint: nothing in it aliases live training tensors."""

    step: int
    model: dict[str, torch.Tensor]
    training_tensors: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    probe: dict[str, torch.Tensor]
    probe_device: str
    metrics: dict[str, float]


def stage_checkpoint(
    state: TrainingState, *, run_id: str, attempt_no: int, metrics: dict[str, float] | None = None
) -> StagedCheckpoint:
    """Clone the complete training state to CPU and compute the probe outputs."""
    model_tensors = {k: _to_host(v) for k, v in state.model.state_dict().items()}
    components: dict[str, Any] = {}
    training_tensors: dict[str, torch.Tensor] = {}
    for name, part in state.stateful().items():
        encoded, tensors = encode_state(part.state_dict(), name)
        components[name] = encoded
        training_tensors.update({k: _to_host(v) for k, v in tensors.items()})
    probe_inputs = _to_host(state.probe_inputs)
    logits = probe_logits(state.model, probe_inputs)
    trainer_state = {
        "format_version": STATE_FORMAT_VERSION,
        "run_id": run_id,
        "attempt_no": attempt_no,
        "step": state.step,
        "config_sha256": state.config_sha256,
        "config": state.config,
        "snapshot_id": state.snapshot_id,
        "data_manifest_sha256": state.data_manifest_sha256,
        "metrics": dict(metrics or {}),
        **components,
    }
    return StagedCheckpoint(
        step=state.step,
        model=model_tensors,
        training_tensors=training_tensors,
        trainer_state=trainer_state,
        probe={"inputs": probe_inputs, "logits": _to_host(logits)},
        probe_device=str(next(state.model.parameters()).device),
        metrics=dict(metrics or {}),
    )


def restore_training_state(
    state: TrainingState,
    *,
    model_tensors: dict[str, torch.Tensor],
    training_tensors: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
) -> None:
    """Load a checkpoint's contents into live objects (model, optimizer, cursor, RNG …)."""
    state.model.load_state_dict(model_tensors, strict=True)
    for name, part in state.stateful().items():
        if name not in trainer_state:
            raise KeyError(f"{name} is not in the checkpoint's trainer_state.json")
        part.load_state_dict(decode_state(trainer_state[name], training_tensors))
    state.step = int(trainer_state["step"])


def probe_logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The model's outputs on the probe batch, in eval mode; consumes no RNG and no grads."""
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            return model(inputs.to(device))
    finally:
        model.train(was_training)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()
