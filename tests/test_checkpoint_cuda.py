"""Async saves of a model on a GPU: pinned buffers, a side stream, events and no host wait.

These run only where CUDA is: CI has no GPU, and nothing else in the suite depends on one. On a
GPU they check what the CPU tests cannot: that the parameters and optimizer state are copied on
a side stream after the last ``optimizer.step()`` (an event orders it), that the next
``optimizer.step()`` waits for those copies on the device while the host goes on, and that the
checkpoint holds the state of its step, not a later one; and that a resume reads the
checkpoint's bytes straight into the live tensors on the GPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.checkpoint import TrainingState, checkpoint_dirs, direct_io, load_checkpoint, verify
from pipeline.checkpoint import manager as manager_module
from pipeline.checkpoint.codec import encode_state
from pipeline.checkpoint.state import StagingBuffers
from pipeline.checkpoint.verify import read_verified_into
from tests.checkpoint_read_support import block_edge_tensors, write_tensor_file
from tests.checkpoint_support import checkpoint_manager

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)"
)


class _Cursor:
    def state_dict(self) -> dict[str, int]:
        return {"position": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def _cuda_state() -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).cuda()
    return TrainingState(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        data_cursor=_Cursor(),
        config={"test": "cuda"},
        config_sha256="e" * 64,
        probe_inputs=torch.randn(4, 512),
    )


def _step(state: TrainingState) -> None:
    """One step with no host synchronization in it (no ``.item()``)."""
    inputs = torch.randn(64, 512, device="cuda")
    labels = torch.randint(0, 10, (64,), device="cuda")
    state.optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(state.model(inputs), labels).backward()
    state.optimizer.step()
    state.step += 1


def _snapshot(state: TrainingState) -> dict[str, torch.Tensor]:
    """The state as the checkpoint names it, cloned on the training stream (in its order)."""
    tensors = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    _, training = encode_state(state.optimizer.state_dict(), "optimizer")
    return {**tensors, **{k: v.clone() for k, v in training.items()}}


def _assert_holds(path: Path, expected: dict[str, torch.Tensor]) -> None:
    contents = load_checkpoint(path)
    saved = {**contents.model, **contents.training_tensors}
    assert saved.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(saved[key], tensor.cpu()), key


def test_async_save_of_a_gpu_model_copies_on_a_side_stream_into_pinned_buffers(
    tmp_path: Path,
) -> None:
    state = _cuda_state()
    manager = checkpoint_manager(tmp_path)
    _step(state)
    manager.save_async(state)  # the first save stages everything on the training thread
    manager.wait()
    for _ in range(3):
        _step(state)
        expected = _snapshot(state)
        manager.save_async(state)
        _step(state)
        _step(state)
        manager.wait()
        _assert_holds(checkpoint_dirs(manager.run_dir)[0], expected)
    # Every tensor that lives on the GPU is staged into pinned memory; Adam's step counts
    # live on the CPU and are copied into ordinary memory.
    buffers = manager._buffers._buffers
    model_keys = set(state.model.state_dict())
    on_gpu = {
        f"model.{key}" if key in model_keys else key
        for key, tensor in _snapshot(state).items()
        if tensor.is_cuda
    }
    assert on_gpu and on_gpu <= buffers.keys()
    assert [key for key in on_gpu if not buffers[key].is_pinned()] == []
    assert list(manager._buffers._streams) == [torch.device("cuda", 0)]


def _sleep_cycles_for(seconds: float) -> int:
    """GPU spin cycles that take about ``seconds`` on this device."""
    cycles = 50_000_000
    torch.cuda.synchronize()
    began = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return int(cycles * seconds / (time.perf_counter() - began))


def test_optimizer_step_waits_for_the_copies_on_the_gpu_while_the_host_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _cuda_state()
    manager = checkpoint_manager(tmp_path)
    _step(state)
    manager.save_async(state)
    manager.wait()
    # The side stream is held back 1 s on the device before its copies: a step that waited
    # on the host would take that long; one ordered by events returns at once, and its
    # kernels run after the copies, so the checkpoint still holds the step it was taken at.
    cycles = _sleep_cycles_for(1.0)
    side_stream = StagingBuffers.side_stream

    def held_back(self: StagingBuffers, device: torch.device) -> torch.cuda.Stream:
        stream = side_stream(self, device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        return stream

    monkeypatch.setattr(StagingBuffers, "side_stream", held_back)
    _step(state)
    expected = _snapshot(state)
    torch.cuda.synchronize()
    manager.save_async(state)
    began = time.perf_counter()
    _step(state)  # its optimizer.step() waits for the copies
    _step(state)
    host_seconds = time.perf_counter() - began
    assert manager.last_stall is not None
    staging_wait = manager.last_stall.staging_wait
    manager.wait()
    assert host_seconds < 0.5, f"the host waited {host_seconds:.2f} s for a held-back copy"
    assert staging_wait < 0.5
    _assert_holds(checkpoint_dirs(manager.run_dir)[0], expected)
    assert not all(torch.equal(v, expected[k]) for k, v in _snapshot(state).items())


def test_a_file_is_read_straight_into_gpu_tensors_byte_for_byte_across_block_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_io, "READ_BLOCK", 8192)
    monkeypatch.setattr(verify, "DIRECT_MIN_BYTES", 64 * 1024)
    tensors = block_edge_tensors()
    listed = write_tensor_file(tmp_path / "model.safetensors", tensors)
    into = {n: torch.zeros_like(t, device="cuda") for n, t in tensors.items() if n != "half"}
    pointers = {n: t.data_ptr() for n, t in into.items()}
    read = read_verified_into(tmp_path, listed, into)
    assert read.in_place and not read.whole  # "half" has no destination: spilled on the host
    assert read.tensors["half"].device.type == "cpu"
    for name, tensor in tensors.items():
        assert torch.equal(read.tensors[name].cpu(), tensor), name
        if name in into:
            assert read.tensors[name].data_ptr() == pointers[name]


def test_resume_onto_a_gpu_reads_into_the_live_tensors_without_a_rollback_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _cuda_state()
    for _ in range(3):
        _step(state)
    expected = _snapshot(state)
    checkpoint_manager(tmp_path).save(state)
    resumed = _cuda_state()
    _step(resumed)  # Adam's moments exist to be read into
    pointers = {k: v.data_ptr() for k, v in _live(resumed).items() if v.is_cuda}

    def no_rollback_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("resume copied the live state although it read into it")

    monkeypatch.setattr(manager_module, "stage_checkpoint", no_rollback_copy)
    info = checkpoint_manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.step == 3 and resumed.step == 3
    after = _live(resumed)
    assert {k: after[k].data_ptr() for k in pointers} == pointers
    assert after.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(after[key], tensor), key


def _live(state: TrainingState) -> dict[str, torch.Tensor]:
    """The live tensors themselves, as the checkpoint names them (not clones)."""
    _, training = encode_state(state.optimizer.state_dict(), "optimizer")
    return {**state.model.state_dict(), **training}
