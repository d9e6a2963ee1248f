"""What a checkpoint holds: the list of stateful objects, and staging them to host memory.

Staging (copy every tensor to host memory, encode the rest as JSON, run the probe) is all a
save needs from live objects. Writing the staged copy touches only host memory, which is why a
background writer may do it while training goes on.

Staging has two halves (:func:`capture_checkpoint`, then :meth:`CapturedCheckpoint.finish`).
The capture runs on the training thread and copies everything the next forward or backward
pass may change: the RNG, the data cursor, the LR scheduler, the grad scaler, every JSON value
and the model's buffers (BatchNorm updates its running statistics in forward). What remains
are the model's parameters and the optimizer's state, by far the bulk of the bytes, which
change only inside ``optimizer.step()``: forward and backward read them and write gradients.
So their copy may run beside the next forward/backward, provided ``optimizer.step()`` waits
for it; :class:`~pipeline.checkpoint.manager.CheckpointManager` enforces that with an
optimizer step pre-hook. This is the overlap DataStates-LLM calls lazy snapshotting.

On a GPU no copy makes the host wait for the device, and the bulk of the bytes is not left
to the writer thread: enqueueing a copy costs the host microseconds. The capture first copies
what forward may change (the model's buffers, the probe's logits) on the training stream
itself, which orders those copies before the next forward's kernels. Then it starts the copies
of the parameters and optimizer state, into pinned buffers, on a side stream made to wait for
everything the training stream holds so far (up to the last ``optimizer.step()``); they run
while the optimizer's state is encoded and while the next forward and backward run. In that
order because a copy engine serves device-to-host copies in the order they were enqueued: a
small copy behind the bulk would hold the training stream back for all of it. An event on
each stream marks the copies; ``optimizer.step()`` makes the training stream wait for the
side stream's (the GPU waits, the host does not), and the writer waits for both before it
hashes a byte (:class:`DeviceCopies`).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from pipeline.checkpoint.codec import decode_state, encode_state
from pipeline.checkpoint.layout import MODEL_FILE, OPTIMIZER_FILE, PROBE_FILE, TENSOR_FILE_METADATA
from pipeline.checkpoint.tensorfile import FileImage

STATE_FORMAT_VERSION = 1
# A staging buffer's key: the tensor's name in its file, after its file's prefix (the model's
# and the probe's names may repeat those of the optimizer file).
_STAGING_KEY_PREFIX = {MODEL_FILE: "model.", OPTIMIZER_FILE: "", PROBE_FILE: "probe."}


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
    # The loss-spike detector's windows and the run's health history
    # (pipeline.trainer.spikes.TrainingHealth): a resumed attempt judges as the uninterrupted
    # one would, and every checkpoint carries the history of the lineage that made it.
    health: Stateful | None = None
    # The flat gradient buffer the trainer binds the parameters' gradients to
    # (pipeline.trainer.gradients.GradientBuffer); bound at the first step, never saved.
    gradients: Any | None = field(default=None, repr=False)

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
        if self.health is not None:
            parts["health"] = self.health
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
    # Set when the probe logits are still to be computed from ``model`` (see ProbeSkeleton).
    probe_pending: bool = False
    # By file name: the image whose views ``model`` or ``training_tensors`` are, when staging
    # laid that file out in one buffer (every tensor of it on the CPU); the writer writes it
    # as it is.
    images: dict[str, FileImage] = field(default_factory=dict)


class DeviceCopies:
    """Device-to-host copies still in flight: a CUDA event after the last copy on each stream.

    Empty for a model on CPU, whose copies are done when ``copy_`` returns; then every method
    returns at once.
    """

    def __init__(self) -> None:
        self._events: list[tuple[torch.device, Any]] = []

    def __bool__(self) -> bool:
        return bool(self._events)

    def record(self, device: torch.device, stream: Any) -> None:
        """Mark the copies enqueued on ``stream`` so far."""
        # Blocking: a thread that waits for it sleeps instead of spinning on a core that the
        # training loop may need.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        self._events.append((device, event))

    def order_current_streams(self) -> None:
        """Make this thread's current stream on each device wait for the copies, on the GPU:
        kernels enqueued from now on run after them; the host does not wait."""
        for device, event in self._events:
            torch.cuda.current_stream(device).wait_event(event)

    def synchronize(self) -> None:
        """Block this thread until every copy has landed in host memory."""
        for _, event in self._events:
            event.synchronize()


class StagingBuffers:
    """Host memory reused from save to save: staging is a ``copy_`` into memory already there.

    Allocating (and first touching) a gigabyte of host memory costs far more than copying into
    it, so buffers are kept and reused while the layout stays the same. A file whose tensors
    all live on the CPU is staged into one :class:`FileImage` (the file as it will lie on the
    disk, which the writer writes without gathering it first); any other tensor gets a buffer
    of its own, by key, pinned for a tensor that lives on a GPU, so the device-to-host copy
    runs at full speed and without making the host wait. The owner must not stage again while
    a writer still reads the previous staged copy.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._images: dict[str, FileImage] = {}
        self._streams: dict[torch.device, Any] = {}

    @property
    def nbytes(self) -> int:
        tensors = sum(b.numel() * b.element_size() for b in self._buffers.values())
        return tensors + sum(len(image.buffer) for image in self._images.values())

    def buffer(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """This key's host buffer for ``tensor`` (allocated on first use, or when its shape or
        dtype changed)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        return buffer

    def image(self, name: str, tensors: dict[str, torch.Tensor]) -> FileImage:
        """The file ``name`` laid out for ``tensors`` (a new image when the layout changed)."""
        image = self._images.get(name)
        if image is None or not image.fits(tensors, TENSOR_FILE_METADATA):
            self._images.pop(name, None)  # freed before the next one is mapped
            image = self._images[name] = FileImage(tensors, TENSOR_FILE_METADATA)
        return image

    def copy(self, key: str, tensor: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
        """``tensor``'s values in this key's host buffer (allocated on first use).

        With ``non_blocking``, a GPU tensor's copy is only enqueued on the current stream: its
        values are in host memory once an event recorded after it has completed. Otherwise
        (and always for a CPU tensor) they are there when this returns.
        """
        tensor = tensor.detach()
        buffer = self.buffer(key, tensor)
        # Into pageable memory a device copy is synchronous whatever it is asked.
        on_device = tensor.device.type == "cuda"
        buffer.copy_(tensor, non_blocking=non_blocking and on_device and buffer.is_pinned())
        return buffer

    def side_stream(self, device: torch.device) -> Any:
        """The stream this owner's background copies from ``device`` run on (one per device,
        kept: creating streams per save would leak them to the driver)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


def stage_checkpoint(
    state: TrainingState,
    *,
    run_id: str,
    attempt_no: int,
    metrics: dict[str, float] | None = None,
    buffers: StagingBuffers | None = None,
    run_probe: bool = True,
) -> StagedCheckpoint:
    """Copy the complete training state to host memory and compute the probe outputs.

    With ``buffers``, tensors are copied into those reused host buffers (the staged copy is
    then only valid until the next staging into the same buffers); without, they are cloned.
    With ``run_probe=False`` the logits are left for :class:`ProbeSkeleton` to compute from
    the staged weights (``probe_pending``).
    """
    return capture_checkpoint(
        state,
        run_id=run_id,
        attempt_no=attempt_no,
        metrics=metrics,
        buffers=buffers,
        run_probe=run_probe,
    ).finish()


@dataclass(frozen=True)
class CapturedCheckpoint:
    """A checkpoint whose step-stable tensors are still being copied (see the module doc).

    ``staged`` already holds every tensor's host destination. Those in ``pending`` (by staging
    key: the live CPU tensor, and its destination) are filled by :meth:`enqueue`; a GPU's are
    filled once ``copies`` are synchronized.
    """

    staged: StagedCheckpoint
    pending: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # The capture's device copies: on each training stream (buffers, probe logits) and on
    # each side stream (parameters and optimizer state, with defer_stable).
    copies: DeviceCopies = field(default_factory=DeviceCopies)

    def finish(self) -> StagedCheckpoint:
        """Copy the pending tensors to host memory: the staged checkpoint, aliasing nothing live.

        May run on another thread, but must be done before the live tensors next change.
        """
        self.enqueue().synchronize()
        return self.staged

    def enqueue(self) -> DeviceCopies:
        """Copy the pending (CPU) tensors to their host destinations: ``staged`` is complete
        once the returned copies, the capture's device copies, are synchronized.

        The live tensors may change once those copies are ordered before the change, which
        :meth:`DeviceCopies.order_current_streams` does on the thread that changes them.
        """
        for source, destination in self.pending.values():
            destination.copy_(source)
        return self.copies


def capture_checkpoint(
    state: TrainingState,
    *,
    run_id: str,
    attempt_no: int,
    metrics: dict[str, float] | None = None,
    buffers: StagingBuffers | None = None,
    run_probe: bool = True,
    defer_stable: bool = False,
    alias_cpu: bool = False,
) -> CapturedCheckpoint:
    """Stage what forward/backward may change; with ``defer_stable``, leave the rest pending
    (a CPU's) or copying on a side stream (a GPU's, with ``buffers``).

    Without ``defer_stable`` nothing is pending: the capture is the whole staging. With
    ``alias_cpu``, contiguous CPU tensors are not copied at all: the staged checkpoint holds
    the live tensors themselves, for a save that is written before the caller runs again.
    With ``buffers``, a tensor file whose tensors all live on the CPU is staged into its
    :class:`FileImage`.
    """
    stable: set[int] = set()
    if defer_stable:
        stable = {p.data_ptr() for p in state.model.parameters()}
    devices: set[torch.device] = set()
    side_streams: dict[torch.device, Any] = {}
    # Tensors copied once all of their file's are known (a file image needs its layout
    # first), by file and by the name the file gives them: (staging key, live tensor, later).
    waiting: dict[str, dict[str, tuple[str, torch.Tensor, bool]]] = {
        MODEL_FILE: {},
        OPTIMIZER_FILE: {},
    }

    def on_side_stream(key: str, tensor: torch.Tensor) -> torch.Tensor:
        assert buffers is not None
        stream = side_streams.get(tensor.device)
        if stream is None:
            stream = side_streams[tensor.device] = buffers.side_stream(tensor.device)
            # After every kernel enqueued so far: the last optimizer.step() included.
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            copy = buffers.copy(key, tensor, non_blocking=True)
            # The caching allocator must not hand this memory to another stream before the
            # copy has read it.
            tensor.record_stream(stream)
        return copy

    def host(file: str, name: str, tensor: torch.Tensor, *, later: bool) -> torch.Tensor:
        key = _STAGING_KEY_PREFIX[file] + name
        tensor = tensor.detach()
        if alias_cpu and tensor.device.type == "cpu" and tensor.is_contiguous():
            return tensor
        if tensor.device.type == "cuda" and buffers is not None:
            if later:  # started now, it runs while the rest is captured
                return on_side_stream(key, tensor)
            devices.add(tensor.device)
            # Enqueued on the training stream: ordered before the next forward's kernels.
            return buffers.copy(key, tensor, non_blocking=True)
        waiting[file][name] = (key, tensor, later)
        return tensor  # until its destination is known

    # The training stream's own copies and reads go first (the probe's logits, the model's
    # buffers, every part but the optimizer: a GradScaler reads its scale with .item()), the
    # step-stable bulk last: a GPU's copy engine serves device-to-host copies in the order they
    # were enqueued, and on an H100 a probe copy enqueued behind a gigabyte on the side stream
    # held the next step's forward back for the whole copy.
    probe_inputs = _to_host(state.probe_inputs)
    logits = probe_logits(state.model, probe_inputs) if run_probe else torch.empty(0)
    if logits.device.type == "cuda" and buffers is not None:
        logits = host(PROBE_FILE, "logits", logits.contiguous(), later=False)
    else:
        logits = _to_host(logits)
    live_model = state.model.state_dict()
    staged_model = {
        k: host(MODEL_FILE, k, v, later=False)
        for k, v in live_model.items()
        if v.data_ptr() not in stable
    }
    parts = state.stateful()
    encoded: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
    for name, part in parts.items():
        if name != "optimizer":
            document, tensors = encode_state(part.state_dict(), name)
            encoded[name] = (
                document,
                {k: host(OPTIMIZER_FILE, k, v, later=False) for k, v in tensors.items()},
            )
    # The bulk: the parameters first, whose copies run while the optimizer's state is encoded;
    # that state changes only in optimizer.step(), like the parameters.
    staged_model.update(
        {k: host(MODEL_FILE, k, v, later=True) for k, v in live_model.items()
         if v.data_ptr() in stable}
    )  # fmt: skip
    document, tensors = encode_state(parts["optimizer"].state_dict(), "optimizer")
    encoded["optimizer"] = (
        document,
        {k: host(OPTIMIZER_FILE, k, v, later=defer_stable) for k, v in tensors.items()},
    )
    model_tensors = {k: staged_model[k] for k in live_model}
    components = {name: encoded[name][0] for name in parts}
    training_tensors = {k: v for name in parts for k, v in encoded[name][1].items()}
    pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    images: dict[str, FileImage] = {}
    for file, file_tensors in ((MODEL_FILE, model_tensors), (OPTIMIZER_FILE, training_tensors)):
        sources = waiting[file]
        if not sources:
            continue
        if buffers is not None and len(sources) == len(file_tensors):
            # Every tensor of the file is on the CPU: staged straight into the file's image.
            images[file] = buffers.image(file, file_tensors)
            destinations = images[file].tensors
        else:
            destinations = {
                name: buffers.buffer(key, source)
                if buffers is not None
                else torch.empty(source.shape, dtype=source.dtype)
                for name, (key, source, _) in sources.items()
            }
        for name, (key, source, later) in sources.items():
            if later:
                pending[key] = (source, destinations[name])
            else:
                destinations[name].copy_(source)
            file_tensors[name] = destinations[name]
    copies = DeviceCopies()
    for device in sorted(devices, key=str):
        copies.record(device, torch.cuda.current_stream(device))
    for device, stream in side_streams.items():
        copies.record(device, stream)
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
    staged = StagedCheckpoint(
        step=state.step,
        model=model_tensors,
        training_tensors=training_tensors,
        trainer_state=trainer_state,
        probe={"inputs": probe_inputs, "logits": logits},
        probe_device=str(next(state.model.parameters()).device),
        metrics=dict(metrics or {}),
        probe_pending=not run_probe,
        images=images,
    )
    return CapturedCheckpoint(staged=staged, pending=pending, copies=copies)


def live_tensors(state: TrainingState) -> dict[str, dict[str, torch.Tensor]]:
    """The live tensors a checkpoint's tensor files can be read straight into, on whatever
    device they live, by file and by the names the files use: the model's state_dict, and the
    optimizer's state (its moments exist once it has stepped; before that it holds none)."""
    _, optimizer = encode_state(state.optimizer.state_dict(), "optimizer")
    return {MODEL_FILE: state.model.state_dict(), OPTIMIZER_FILE: optimizer}


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


class ProbeSkeleton:
    """The model's structure without its weights, to run the probe batch on staged weights.

    Computing the probe logits is a forward pass over every weight; on CPU it is a third of
    the staging stall for a large model. With a skeleton (a deep copy whose parameters and
    buffers are meta tensors, so it costs no memory) the background writer computes them from
    the staged copy instead, which is also exactly the copy written. Only used for CPU models
    where :meth:`build` showed, bit for bit, that it gives the live model's outputs.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    @classmethod
    def build(cls, state: TrainingState, staged: StagedCheckpoint) -> ProbeSkeleton | None:
        """A skeleton of ``state.model`` if it reproduces ``staged``'s probe exactly, else None."""
        import copy

        model = state.model
        tensors = [*model.parameters(), *model.buffers()]
        if not tensors or any(t.device.type != "cpu" for t in tensors):
            return None
        persistent = set(model.state_dict(keep_vars=True))
        named = {*dict(model.named_parameters()), *dict(model.named_buffers())}
        if named != persistent:
            return None  # non-persistent buffers are not staged: the skeleton could not run
        try:
            memo = {id(t): torch.empty_like(t, device="meta") for t in tensors}
            skeleton = cls(copy.deepcopy(model, memo).eval())
            logits = skeleton.logits(staged.model, staged.probe["inputs"])
        except Exception:  # a model deepcopy or functional_call cannot handle: stage as before
            return None
        expected = staged.probe["logits"]
        if logits.shape != expected.shape or not torch.equal(logits, expected):
            return None
        return skeleton

    def logits(self, weights: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call

        with torch.no_grad():
            return functional_call(self._module, weights, (inputs,)).detach().contiguous()

    def complete(self, staged: StagedCheckpoint) -> StagedCheckpoint:
        """``staged`` with its probe logits computed from its own weights."""
        if not staged.probe_pending:
            return staged
        logits = self.logits(staged.model, staged.probe["inputs"])
        return dataclasses.replace(
            staged, probe={**staged.probe, "logits": logits}, probe_pending=False
        )


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()
