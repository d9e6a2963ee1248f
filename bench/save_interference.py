"""What each kind of background work costs the training loop, side by side in one run.

    .venv/bin/python bench/save_interference.py --repeats 5

The checkpoint bench's model and training step (``checkpoint_bench.py``) on one intra-op
thread, as the trainer trains, while a second thread repeats one kind of work without pause on
the other core: nothing, BLAKE3 of a cache-resident buffer, BLAKE3 of 256 MiB in memory, and a
256 MiB copy by torch's ``copy_`` and by glibc's ``memmove`` (non-temporal stores). Prints
training steps/s with each ÷ with nothing (median of ``--repeats``, in an order rotated every
repeat) and the rate the background work ran at. A background save is a staging copy, a hash
and a write: this says what the first two cost the training loop on this machine (the write,
O_DIRECT from memory the copy already filled, is not measured here).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint_bench import (  # bench/ is on sys.path
    BATCH,
    WIDTH,
    build_state,
    rotated,
    train_step,
)

from pipeline.checkpoint import TrainingState

_BYTES = 256 * 1024 * 1024
_STEPS = 6


def background_work() -> dict[str, tuple[Callable[[], None], int]]:
    """Each kind of work, with the bytes one call goes through (0: none)."""
    source = torch.ones(_BYTES, dtype=torch.uint8)
    target = torch.ones(_BYTES, dtype=torch.uint8)  # touched: no page faults in the timing
    small = bytes(1 << 20)
    memmove = ctypes.CDLL(None).memmove
    memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def hash_cached() -> None:
        hasher = blake3.blake3()
        for _ in range(_BYTES // len(small)):
            hasher.update(small)

    return {
        "nothing": (lambda: time.sleep(0.05), 0),
        "BLAKE3, cache-resident": (hash_cached, _BYTES),
        "BLAKE3, from memory": (lambda: blake3.blake3(source.numpy()).digest(), _BYTES),
        "copy, torch copy_": (lambda: target.copy_(source), _BYTES),
        "copy, glibc memmove": (
            lambda: memmove(target.data_ptr(), source.data_ptr(), _BYTES),
            _BYTES,
        ),
    }


def steps_beside(
    work: tuple[Callable[[], None], int],
    state: TrainingState,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[float, float]:
    """Training steps/s while another thread repeats ``work``, and GB/s that work ran at."""
    fn, size = work
    stop, calls, busy = threading.Event(), [0], [0.0]

    def loop() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            fn()
            busy[0] += time.perf_counter() - start
            calls[0] += 1

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.2)
    start = time.perf_counter()
    for _ in range(_STEPS):
        train_step(state, inputs, targets)
    rate = _STEPS / (time.perf_counter() - start)
    stop.set()
    thread.join()
    return rate, (calls[0] * size / busy[0] / 1e9 if size else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(1)
    state = build_state()
    inputs, targets = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    for _ in range(3):  # Adam's moments allocated and touched
        train_step(state, inputs, targets)
    work = background_work()
    rates: dict[str, list[float]] = {name: [] for name in work}
    speeds: dict[str, list[float]] = {name: [] for name in work}
    names = list(work)
    for index in range(args.repeats):
        for name in rotated(index, names):
            rate, speed = steps_beside(work[name], state, inputs, targets)
            rates[name].append(rate)
            speeds[name].append(speed)
    alone = statistics.median(rates["nothing"])
    print(f"training alone: {alone:.3f} steps/s (median of {args.repeats}, {_STEPS} steps each)")
    for name in names[1:]:
        rate = statistics.median(rates[name])
        print(
            f"{name:24s} {rate:.3f} steps/s  ratio {rate / alone:.3f}"
            f"  background at {statistics.median(speeds[name]):.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
