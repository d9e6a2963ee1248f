"""Checkpoint benchmark on a GPU: the async stall against the device-to-host floor, training
throughput with saves, and a verified resume onto the device.

    python bench/checkpoint_gpu.py                                # defaults, CUDA only
    python bench/checkpoint_gpu.py --batch 4096 --save-every 10 50 --repeats 5
    .venv/bin/python bench/checkpoint_gpu.py --device cpu --batch 16 --repeats 1 --save-every 2
        # a check of this script on a machine with no GPU; its figures mean nothing

The state is the CPU bench's (``checkpoint_bench.py``): an MLP of 5 x Linear(4096, 4096) and
Adam, 1.007 GB of parameters and moments, here on ``cuda:0``, trained as the trainer trains
(deterministic kernels, one intra-op CPU thread). Each figure is the median of ``--repeats``:

(g1) the device-to-host floor: one copy of a contiguous device tensor as large as the state
     into pinned host memory, timed with CUDA events; and the same bytes copied tensor by
     tensor, as a checkpoint copies them.
(g2) the stall against that floor: from the call of ``save_async`` until every parameter and
     Adam moment has landed in host memory, with no training work queued to overlap it; the
     longest the next ``optimizer.step()`` can be held. ÷ (bytes ÷ floor bandwidth); goal
     <= 1.2. The host's own part (inside ``save_async``) is printed beside it.
(g3) the stall a training step sees: the step after ``save_async`` (synchronized) minus the
     median plain step: the copies run on a side stream beside forward and backward, and
     only ``optimizer.step()`` waits for them, on the GPU.
(g4) training throughput with ``save_async`` every N steps ÷ without, over windows of 2 x N
     steps that wait at their end for their last save to commit (every save's whole cost
     inside the window), the two sides alternating A B, B A. The background save's own time
     (copy, BLAKE3, write, fsync, commit) is printed beside it: when it is longer than N
     steps, the next save waits for it.
(g5) ``CheckpointManager.resume`` in a fresh manager onto the device (every byte read and
     verified, restored into the live CUDA tensors, probe re-run), checked bit for bit
     against the state that was saved.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Deterministic cuBLAS needs it before the first CUDA call (as the trainer sets it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint_bench import (
    WIDTH,
    build_state,
    filesystem,
    machine,
    raw_write,
    remove_checkpoints,
    run_in_temp_dir,
    settle,
    state_bytes,
    train_step,
)

from pipeline.checkpoint import CheckpointConfig, CheckpointManager, TrainingState
from pipeline.checkpoint.codec import encode_state


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synchronized(fn: Callable[[], object]) -> float:
    """Seconds of host time until ``fn``'s device work is done (nothing queued before it)."""
    synchronize()
    began = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - began


def event_seconds(fn: Callable[[], object]) -> float:
    """Device time of the work ``fn`` enqueues on the current stream (CUDA events)."""
    if not torch.cuda.is_available():
        return synchronized(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def device_to_host_floor(state: TrainingState, repeats: int) -> tuple[list[float], list[float]]:
    """Bytes per second of one contiguous copy into pinned memory, and of the state's own
    tensors copied one by one into pinned buffers."""
    tensors = [t for t in live_state(state).values() if t.numel() > 1]  # not Adam's steps
    size = sum(t.numel() * t.element_size() for t in tensors)
    device, pin = tensors[0].device, tensors[0].device.type == "cuda"
    source = torch.empty(size, dtype=torch.uint8, device=device).random_()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
    whole, per_tensor = [], []

    def copy_whole() -> None:
        pinned.copy_(source, non_blocking=True)

    def copy_each() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=True)

    copy_whole(), copy_each()  # warm-up
    for _ in range(repeats):
        whole.append(size / event_seconds(copy_whole))
        per_tensor.append(size / event_seconds(copy_each))

    return whole, per_tensor


def live_state(state: TrainingState) -> dict[str, torch.Tensor]:
    """The live model and optimizer tensors, named as the checkpoint names them."""
    model = {f"model.{k}": v for k, v in state.model.state_dict().items()}
    _, optimizer = encode_state(state.optimizer.state_dict(), "optimizer")
    return {**model, **optimizer}


def snapshot(state: TrainingState) -> dict[str, torch.Tensor]:
    """The state cloned to host memory (for the resume check)."""
    return {k: v.detach().cpu() for k, v in live_state(state).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4096, help="rows per training step")
    parser.add_argument("--save-every", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp dir)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("checkpoint_gpu: no CUDA device is visible (--device cpu checks the script only)")
        return 2
    if args.repeats < 1 or args.batch < 1 or min(args.save_every) < 1:
        parser.error("--repeats, --batch and --save-every must be at least 1")
    return run_in_temp_dir(args, "tracks-ckpt-gpu-", run)


def run(args: argparse.Namespace, root: Path) -> int:
    say = lambda text: print(text, flush=True)  # noqa: E731
    for line in machine():
        say(line)
    device = torch.device(args.device)
    gpu = "no GPU"
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(0)
        gpu = f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB"
    say(f"GPU: {gpu}; {filesystem(root)}")
    state = build_state()
    state.model.to(device)  # before any optimizer step: Adam's moments are made on the device
    inputs = torch.randn(args.batch, WIDTH, device=device)
    targets = torch.randn(args.batch, WIDTH, device=device)

    def step() -> None:
        train_step(state, inputs, targets)

    for _ in range(3):
        step()
    size = state_bytes(state)
    plain = [synchronized(step) for _ in range(10)]
    step_seconds = statistics.median(plain)
    say(f"state: {size / 1e9:.3f} GB on the GPU; one step (batch {args.batch}) "
        f"{step_seconds * 1e3:.1f} ms")  # fmt: skip

    whole, per_tensor = device_to_host_floor(state, args.repeats)
    floor_bw = statistics.median(whole)
    floor_seconds = size / floor_bw
    say(f"(g1) device-to-host into pinned memory: one copy {_fmt(whole, 1e-9, 'GB/s')}; "
        f"tensor by tensor {_fmt(per_tensor, 1e-9, 'GB/s')}; floor for the state "
        f"{floor_seconds * 1e3:.1f} ms")  # fmt: skip

    manager = CheckpointManager(root / "run", CheckpointConfig(keep_last_k=100), run_id="bench")
    manager.bind_attempt(1, None)
    first = synchronized(lambda: manager.save_async(state))
    manager.wait()
    say(f"first save: {first:.3f} s on the host (pins {manager._buffers.nbytes / 1e9:.2f} GB "
        "of staging buffers, once per process)")  # fmt: skip
    remove_checkpoints(root)

    # (g2) until the bytes are in host memory, nothing to overlap.
    landed, host_part, background = [], [], []
    for _ in range(args.repeats):
        step()
        synchronize()
        began = time.perf_counter()
        manager.save_async(state)
        host_part.append(time.perf_counter() - began)
        manager.wait_staged()  # the current stream now waits for the copies
        synchronize()
        landed.append(time.perf_counter() - began)
        manager.wait()
        background.append(time.perf_counter() - began)
        remove_checkpoints(root)
    stall_ratio = statistics.median(landed) / floor_seconds
    say(f"(g2) save_async until the state is in host memory {_fmt(landed, 1e3, 'ms')}; "
        f"inside save_async {_fmt(host_part, 1e3, 'ms')}")  # fmt: skip
    say(f"(g2) ÷ bytes/floor ({floor_seconds * 1e3:.1f} ms) = {stall_ratio:.2f}  (goal <= 1.2)")
    say(f"     the whole background save (copy, BLAKE3, write, fsync, commit) "
        f"{_fmt(background, 1, 's')}")  # fmt: skip

    # (g3) the stall a training step sees.
    exposed = []
    for _ in range(args.repeats):
        before = [synchronized(step) for _ in range(3)]

        def save_then_step() -> None:
            manager.save_async(state)
            step()

        exposed.append(synchronized(save_then_step) - statistics.median(before))
        manager.wait()
        remove_checkpoints(root)
    say(f"(g3) the step after save_async took longer than a plain step by "
        f"{_fmt(exposed, 1e3, 'ms')} ({statistics.median(exposed) / floor_seconds:.2f} of "
        "the floor)")  # fmt: skip

    # The disk's floor for the background save: write(2) + fsync of the same bytes.
    staged = [b.reshape(-1).view(torch.uint8).numpy() for b in manager._buffers._buffers.values()]
    disk = []
    for index in range(args.repeats):
        settle()
        began = time.perf_counter()
        written = raw_write(root / f"raw-{index}", {"state.bin": [memoryview(b) for b in staged]})
        disk.append(written / (time.perf_counter() - began))
        shutil.rmtree(root / f"raw-{index}")
    say(f"     the disk: write(2) + fsync of the same bytes {_fmt(disk, 1e-9, 'GB/s')} "
        f"({size / statistics.median(disk):.2f} s)")  # fmt: skip

    # (g4) throughput with saves every N steps.
    rows = []
    for every in args.save_every:
        window = 2 * every
        with_saves, without = [], []

        def train_only(window: int = window) -> None:
            for _ in range(window):
                step()

        def train_and_save(every: int = every, window: int = window) -> None:
            for index in range(window):
                step()
                manager.poll()
                if index % every == every // 2:
                    manager.save_async(state)
            manager.wait()

        for index in range(args.repeats):
            sides = [(train_only, without), (train_and_save, with_saves)]
            for fn, into in sides if index % 2 == 0 else sides[::-1]:
                into.append(window / synchronized(fn))
                remove_checkpoints(root)
        ratio = statistics.median(with_saves) / statistics.median(without)
        rows.append((every, ratio))
        say(f"(g4) save every {every} steps ({every * step_seconds:.2f} s of training): "
            f"{_fmt(with_saves, 1, 'steps/s')} with, {_fmt(without, 1, 'steps/s')} without: "
            f"{ratio:.3f}")  # fmt: skip

    # (g5) resume onto the device, verified, bit-exact.
    step()
    saved = snapshot(state)
    manager.save(state)
    resumed = build_state()
    resumed.model.to(device)
    train_step(resumed, inputs, targets)  # Adam's moments exist after a step; resume overwrites
    reader = CheckpointManager(root / "run", CheckpointConfig(keep_last_k=100), run_id="bench")
    reader.bind_attempt(2, None)
    seconds = synchronized(lambda: reader.resume(resumed))
    restored = snapshot(resumed)
    exact = restored.keys() == saved.keys() and all(
        torch.equal(restored[key], value) for key, value in saved.items()
    )
    say(f"(g5) resume onto the GPU: {seconds:.2f} s ({size / seconds / 1e9:.2f} GB/s, warm page "
        f"cache); bit-exact: {exact}")  # fmt: skip

    say("")
    say(f"GPU summary ({gpu}, {size / 1e9:.3f} GB, batch {args.batch}):")
    say(f"  async stall until in host memory ÷ bytes/D2H floor: {stall_ratio:.2f} (goal <= 1.2)")
    for every, ratio in rows:
        say(f"  training with a save every {every} steps ÷ without: {ratio:.3f}")
    say(f"  resume onto the GPU bit-exact: {exact}")
    return 0 if exact else 1


def _fmt(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    shown = ", ".join(f"{v * scale:.3g}" for v in values)
    return f"median {statistics.median(values) * scale:.3g} {unit} [{shown}]"


if __name__ == "__main__":
    sys.exit(main())
