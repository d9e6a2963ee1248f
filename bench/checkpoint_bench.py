"""Checkpoint benchmark: ~1 GB of model + Adam state, our protocol against raw I/O, side by side.

    .venv/bin/python bench/checkpoint_bench.py                 # defaults: 5 repeats, save every 10
    .venv/bin/python bench/checkpoint_bench.py --repeats 7 --dir /mnt/fast

An MLP of 5 x Linear(4096, 4096) (83.9 M float32 parameters) trained with Adam: parameters
plus the two moments are 1.007 GB. One process, one training thread (as the trainer runs:
``torch.set_num_threads(1)``, for bit-exact resumes), no GPU. Each figure is the median of
``--repeats`` runs:

(a) stall: time the training thread is stopped by a save: inside
    ``CheckpointManager.save_async`` (capturing RNG, cursor, JSON state; the previous save had
    finished) plus the time the next ``optimizer.step()`` waits for the background copy of
    parameters and Adam state into the reused host buffers, which overlaps that step's
    forward/backward ÷ a synchronous ``torch.save`` + fsync of the same model and optimizer
    state_dicts. Target <= 0.05. Also printed: how much longer the step after a save took
    than the plain steps before it (the background copy, hashing and writing compete for
    memory bandwidth; that cost is what (d) measures over whole windows).
(b) save throughput: bytes ÷ time of ``write_and_commit`` (every file hashed, written, fsynced,
    MANIFEST.json, COMMITTED by temp file + fsync + rename + directory fsync), ÷ the same for
    a raw write(2) + fsync of the same bytes to the same files: the faster of a write through
    the page cache and one around it (O_DIRECT, from aligned memory that already holds the
    bytes, as Tracks' writer bypasses the cache). Target >= 0.8.
(c) restore throughput: ``CheckpointManager.resume`` in a fresh manager, as a new attempt runs
    it (trainer state checked, every tensor read once straight into the live model and
    optimizer tensors, BLAKE3 of every byte, restore, the probe batch re-run), ÷ a
    raw read of the same files (two at a time, 32 MiB reads), into buffers already mapped and
    touched, as the live tensors are: the faster of a read through the page cache
    (POSIX_FADV_SEQUENTIAL) and one around it (O_DIRECT, straight into page-aligned buffers).
    Both cold: the files' pages are dropped from the page cache first (posix_fadvise
    DONTNEED), as for a new process on a new node. Target >= 0.8. A raw read into fresh
    memory is printed beside it: on a VM the first touch of each page costs more CPU than
    the read.
(d) training throughput with ``save_async`` every ``--save-every`` steps ÷ without saving,
    over windows of 2 x save-every steps that include all the work of their two saves.
    Target >= 0.98. The same windows run with Tracks' synchronous ``save`` and with each
    peer's save (below), all in an order rotated every repeat.
(e) side by side on the same state (``checkpoint_peers.py``): Tracks' ``save``, ``save_async``
    and full ``resume`` (verify, restore, probe) against ``torch.save``/``torch.load``,
    safetensors, and DCP ``save``/``load``/``async_save``; each saves durably and restores
    cold into the live model and optimizer, in an order rotated every repeat; and (d)'s
    training throughput with each one's saves.

The two sides of each ratio alternate A B, B A, … (more sides: in a rotated order) so that
drift (page cache, writeback, other load on the machine) hits both; every timed write
follows the deletion of the previous one's files, ``sync`` and a 1.5 s pause (on a VM, a
write right after another 1 GB write can run 3x slower while the host flushes). The load
average is printed: on a shared machine it matters.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import blake3
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint_peers import (  # bench/ is on sys.path
    Loop,
    Peer,
    PeerFigures,
    PendingSave,
    all_peers,
)

from pipeline.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    TrainingState,
)
from pipeline.checkpoint.direct_io import (
    DIRECT_ALIGN,
    DIRECT_MIN_BYTES,
    block_ceil,
    direct_buffer,
    use_direct_io,
)
from pipeline.checkpoint.layout import fsync_dir
from pipeline.checkpoint.state import (
    ProbeSkeleton,
    StagingBuffers,
    probe_logits,
    stage_checkpoint,
)
from pipeline.checkpoint.writer import serialize_staged
from pipeline.determinism import use_deterministic_kernels

WIDTH, DEPTH, BATCH = 4096, 5, 16
T = TypeVar("T")
_SLICE = 64 * 1024 * 1024


class Cursor:
    """The benchmark's data cursor: a step counter and a seed (Stateful)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def build_state() -> TrainingState:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for index in range(DEPTH):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if index < DEPTH - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    return TrainingState(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
        data_cursor=Cursor(),
        config={"bench": "checkpoint", "width": WIDTH, "depth": DEPTH},
        config_sha256="b" * 64,
        probe_inputs=torch.randn(4, WIDTH),
    )


def forward_backward(state: TrainingState, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    state.optimizer.zero_grad(set_to_none=True)
    F.mse_loss(state.model(inputs), targets).backward()


def optimizer_step(state: TrainingState) -> None:
    state.optimizer.step()
    state.step += 1
    state.data_cursor.position += 1  # type: ignore[attr-defined]


def train_step(state: TrainingState, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    forward_backward(state, inputs, targets)
    optimizer_step(state)


def remove_checkpoints(root: Path) -> None:
    """Delete the bench run's checkpoints (between timed saves, outside their time)."""
    for directory in list((root / "run").glob("step-*")):
        shutil.rmtree(directory)


def state_bytes(state: TrainingState) -> int:
    total = sum(t.numel() * t.element_size() for t in state.model.state_dict().values())
    for per_param in state.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in per_param.values() if torch.is_tensor(t))
    return total


def drop_cache(directory: Path) -> None:
    """Evict the files' pages from the page cache (they are clean: written and fsynced)."""
    drop_cache_files(directory)


def raw_write(directory: Path, files: dict[str, list[memoryview]]) -> int:
    """write(2) + fsync of exactly the bytes the checkpoint writer writes, nothing else."""
    directory.mkdir()
    total = 0
    for name, chunks in files.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for chunk in chunks:
                view = chunk
                while len(view):
                    count = os.write(fd, view[:_SLICE])
                    view = view[count:]
                    total += count
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)
    return total


def file_images(
    files: dict[str, list[memoryview]], reuse: dict[str, tuple[memoryview, int]] | None = None
) -> dict[str, tuple[memoryview, int]]:
    """Each file's bytes laid out in one aligned buffer (on huge pages, padded to the block),
    with the file's size: what an O_DIRECT write can take as it is. Buffers of ``reuse`` with
    the right length are filled again (no memory is mapped or freed between repeats)."""
    images = {}
    for name, chunks in files.items():
        size = sum(len(chunk) for chunk in chunks)
        length = max(DIRECT_ALIGN, block_ceil(size))
        image = (reuse or {}).get(name, (None, 0))[0]
        if image is None or len(image) != length:
            image = direct_buffer(length)
        at = 0
        for chunk in chunks:
            image[at : at + len(chunk)] = chunk.cast("B")
            at += len(chunk)
        image[at:] = bytes(len(image) - at)
        images[name] = (image, size)
    return images


def raw_write_direct(directory: Path, images: dict[str, tuple[memoryview, int]]) -> int:
    """write(2) + fsync of the same bytes with O_DIRECT, from aligned memory already there (no
    gathering, no hashing): the floor for a writer that bypasses the page cache, as Tracks'
    does for files of 8 MiB and more. Small files go through the cache, as Tracks' do."""
    directory.mkdir()
    total = 0
    for name, (image, size) in images.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            direct = size >= DIRECT_MIN_BYTES and use_direct_io(fd)
            end = len(image) if direct else size
            at = 0
            while at < end:
                at += os.write(fd, image[at : min(end, at + _SLICE)])
            if direct and end != size:
                os.ftruncate(fd, size)
            os.fsync(fd)
            total += size
        finally:
            os.close(fd)
    fsync_dir(directory)
    return total


def raw_read(
    directory: Path, buffers: dict[str, torch.Tensor] | None = None, *, direct: bool = False
) -> int:
    """Read every file as load_checkpoint does (two files at a time, largest first), without
    hashing or parsing: the floor. 32 MiB reads, through the page cache (POSIX_FADV_SEQUENTIAL)
    or, ``direct``, around it (O_DIRECT, straight into ``buffers``, which must be page-aligned).

    Into ``buffers`` (memory already mapped and touched, as the live tensors ``resume`` reads
    into are), else into fresh memory."""

    def read_one(path: Path) -> int:
        size = path.stat().st_size
        buffer = buffers[path.name] if buffers else torch.empty(size, dtype=torch.uint8)
        view = memoryview(buffer.numpy()) if size else memoryview(bytearray())
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            offset = 0
            while offset < size:
                count = os.preadv(fd, [view[offset : offset + 32 * 1024 * 1024]], offset)
                if not count:
                    break
                offset += count
        finally:
            os.close(fd)
        return min(offset, size)

    files = sorted(directory.iterdir(), key=lambda path: -path.stat().st_size)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return sum(pool.map(read_one, files))


def mapped_bytes(size: int) -> torch.Tensor:
    """``size`` bytes of aligned memory, touched (as live tensors are), with room for an
    O_DIRECT read of the file's last partial block: on huge pages, as Tracks' own read
    buffers are (direct_io.py), so the floor's requests are as large as the disk takes."""
    buffer = direct_buffer(max(DIRECT_ALIGN, block_ceil(size)))
    return torch.frombuffer(buffer, dtype=torch.uint8).fill_(1)


def settle(seconds: float = 1.5) -> None:
    """Start a timed write or read on an idle disk: on this VM a 1 GB write+fsync right after
    another one runs 2-4x slower while the host still flushes the first."""
    os.sync()
    time.sleep(seconds)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


@dataclass
class Row:
    name: str
    ours: str
    baseline: str
    ratio: float
    target: str
    met: bool


def machine() -> list[str]:
    with open("/proc/meminfo") as handle:
        mem_kb = int(next(line for line in handle if line.startswith("MemTotal")).split()[1])
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line for line in handle if line.startswith("model name")).split(":")[1]
    except (OSError, StopIteration):
        pass
    return [
        f"CPU: {cpu.strip()}, {os.cpu_count()} cores; RAM {mem_kb / 1024**2:.1f} GiB",
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op thread(s), CUDA {torch.cuda.is_available()}",
    ]


def filesystem(directory: Path) -> str:
    try:
        done = subprocess.run(
            ["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "--target", str(directory)],
            capture_output=True,
            text=True,
        )
    except OSError:  # no findmnt on this machine
        return f"{directory}: unknown filesystem"
    return f"{directory}: {done.stdout.strip() or 'unknown filesystem'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--save-every", type=int, default=10, help="steps between saves in (d)")
    parser.add_argument("--hash-workers", type=int, default=0, help="0: hash inline (default)")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.save_every < 1:
        parser.error("--repeats and --save-every must be at least 1")
    return run_in_temp_dir(args, "tracks-ckpt-bench-", run)


def run_in_temp_dir(
    args: argparse.Namespace, prefix: str, run: Callable[[argparse.Namespace, Path], int]
) -> int:
    """``run(args, root)`` in a new directory under ``--dir``, removed afterwards, on one
    intra-op thread with deterministic kernels, as the trainer trains."""
    if args.dir is not None and not args.dir.is_dir():
        raise SystemExit(f"--dir {args.dir}: not a directory")
    torch.set_num_threads(1)
    use_deterministic_kernels()
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=args.dir))
    try:
        return run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> int:
    say = lambda text: print(text, flush=True)  # noqa: E731
    loads = os.getloadavg()
    state = build_state()
    inputs, targets = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    step_seconds = [timed(lambda: train_step(state, inputs, targets))[0] for _ in range(3)][-1]
    size = state_bytes(state)
    say(f"state: {size / 1e9:.3f} GB (model + Adam moments); one step {step_seconds:.2f} s")
    manager = CheckpointManager(
        root / "run",
        CheckpointConfig(keep_last_k=100, hash_workers=args.hash_workers),
        run_id="bench",
    )
    manager.bind_attempt(1, None)

    # The first save allocates (and first touches) the staging buffers: once per process.
    first_stall, _ = timed(lambda: manager.save_async(state))
    manager.wait()
    say(f"first save: {first_stall:.3f} s stall (allocating {manager._buffers.nbytes / 1e9:.2f} GB")
    say("of staging buffers, once per process)")
    remove_checkpoints(root)

    # (a) stall per save vs torch.save + fsync, interleaved ABBA.
    stalls, torch_saves, slower = [], [], []

    def our_save() -> None:
        settle()
        plain = [timed(lambda: train_step(state, inputs, targets))[0] for _ in range(3)]
        manager.save_async(state)
        after = timed(lambda: train_step(state, inputs, targets))[0]
        assert manager.last_stall is not None and manager.last_stall.step == state.step - 1
        stalls.append(manager.last_stall.total)
        slower.append(after - statistics.median(plain))
        manager.wait()
        remove_checkpoints(root)

    def torch_save() -> None:
        target = root / "torch.pt"

        def save() -> None:
            torch.save(
                {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()},
                target,
            )
            with open(target, "rb") as handle:
                os.fsync(handle.fileno())

        settle()
        torch_saves.append(timed(save)[0])
        target.unlink()

    for index in range(args.repeats):
        for side in _abba(index, our_save, torch_save):
            side()
    probe_seconds = timed(lambda: probe_logits(state.model, state.probe_inputs))[0]
    say(f"(a) stall {_fmt(stalls)}; torch.save+fsync {_fmt(torch_saves)}")
    say(f"(a) the step after a save, longer than a plain one by {_fmt(slower)}")

    # (b) full save vs raw write + fsync of the same bytes, interleaved ABBA.
    # The floor is the faster of two raw writes of the same bytes: through the page cache, and
    # with O_DIRECT from aligned memory already there, as Tracks' writer bypasses the cache.
    buffers = StagingBuffers()
    ours_b, raw_b, direct_b = [], [], []
    images: dict[str, tuple[memoryview, int]] = {}
    for index in range(args.repeats):
        state.step += 1
        staged = stage_checkpoint(state, run_id="bench", attempt_no=1, buffers=buffers)
        files = serialize_staged(staged)
        images = file_images(files, images)

        def our_write(staged: Any = staged) -> None:
            settle()
            seconds, info = timed(lambda: manager.write_and_commit(staged))
            ours_b.append(info.size_bytes / seconds)
            remove_checkpoints(root)

        def plain_write(files: Any = files, images: Any = images) -> None:
            settle()
            seconds, written = timed(lambda: raw_write(root / "raw", files))
            raw_b.append(written / seconds)
            shutil.rmtree(root / "raw")
            settle()
            seconds, written = timed(lambda: raw_write_direct(root / "raw", images))
            direct_b.append(written / seconds)
            shutil.rmtree(root / "raw")

        for side in _abba(index, our_write, plain_write):
            side()
    say(f"(b) save {_fmt(ours_b, 1e-9, 'GB/s')}; raw write {_fmt(raw_b, 1e-9, 'GB/s')}; "
        f"O_DIRECT {_fmt(direct_b, 1e-9, 'GB/s')}")  # fmt: skip
    write_floor = max(statistics.median(raw_b), statistics.median(direct_b))

    # (c) restore with verification vs raw read, both cold, interleaved ABBA. Both read into
    # memory that is already there: ours into the live tensors, the floor into buffers
    # touched once beforehand. The floor is the faster of a read through the page cache and
    # one around it (O_DIRECT); a read into fresh memory is timed too, for comparison.
    state.step += 1
    checkpoint = manager.save(state).path
    ours_c, raw_c, direct_c, fresh_c = [], [], [], []
    mapped = {path.name: mapped_bytes(path.stat().st_size) for path in checkpoint.iterdir()}

    def restore() -> int:
        # What a new attempt runs: a fresh manager, the full resume (trainer state checked,
        # every byte read into the live tensors and hashed, restore, probe batch).
        reader = CheckpointManager(root / "run", CheckpointConfig(keep_last_k=100), run_id="bench")
        reader.bind_attempt(2, None)
        info = reader.resume(state)
        assert info is not None and info.path == checkpoint
        return info.size_bytes

    def cold_restore() -> None:
        drop_cache(checkpoint)
        settle()
        seconds, restored = timed(restore)
        ours_c.append(restored / seconds)

    def cold_read() -> None:
        drop_cache(checkpoint)
        settle()
        seconds, read = timed(lambda: raw_read(checkpoint, mapped))
        raw_c.append(read / seconds)
        drop_cache(checkpoint)
        settle()
        seconds, read = timed(lambda: raw_read(checkpoint, mapped, direct=True))
        direct_c.append(read / seconds)

    def cold_read_into_fresh_memory() -> None:
        drop_cache(checkpoint)
        settle()
        seconds, read = timed(lambda: raw_read(checkpoint))
        fresh_c.append(read / seconds)

    for index in range(args.repeats):
        for side in _abba(index, cold_restore, cold_read):
            side()
    # Outside the interleaving: on this VM, disk reads in the seconds after a gigabyte of
    # memory is freed ran slower (a restore right after this read took 0.62-0.74 s, 0.49-0.69
    # s without it), and only the restore, never the floor, would follow it.
    for _ in range(args.repeats):
        cold_read_into_fresh_memory()
    restore()  # warm the cache
    seconds, restored = timed(restore)
    warm_ours = restored / seconds
    seconds, read = timed(lambda: raw_read(checkpoint, mapped))
    warm_raw = read / seconds
    mapped.clear()
    say(f"(c) restore {_fmt(ours_c, 1e-9, 'GB/s')}; raw read {_fmt(raw_c, 1e-9, 'GB/s')}; "
        f"O_DIRECT {_fmt(direct_c, 1e-9, 'GB/s')}; "
        f"into fresh memory {_fmt(fresh_c, 1e-9, 'GB/s')}")  # fmt: skip
    read_floor = max(statistics.median(raw_c), statistics.median(direct_c))
    remove_checkpoints(root)

    # (e) the peers and Tracks' own save/resume on the same state, in a rotated order.
    peers = all_peers()
    peer_rows = peers_side_by_side(args, root, state, manager, peers, inputs, targets, say)

    # (d) training throughput without saving, with Tracks' saves and with each peer's, the
    # windows in an order rotated every repeat.
    plain = training_side_by_side(
        args, root, state, manager, peers, peer_rows, inputs, targets, say
    )
    saving = peer_rows[1].training  # Tracks save_async
    for peer in peers:
        peer.close()

    med = statistics.median
    rows = [
        Row("(a) training-loop stall per save", f"{med(stalls):.3f} s",
            f"{med(torch_saves):.3f} s torch.save+fsync", med(stalls) / med(torch_saves),
            "<= 0.05", med(stalls) / med(torch_saves) <= 0.05),
        Row("(b) full save throughput", f"{med(ours_b) / 1e9:.2f} GB/s",
            f"{write_floor / 1e9:.2f} GB/s raw write+fsync", med(ours_b) / write_floor,
            ">= 0.8", med(ours_b) / write_floor >= 0.8),
        Row("(c) restore with verification (cold)", f"{med(ours_c) / 1e9:.2f} GB/s",
            f"{read_floor / 1e9:.2f} GB/s raw read", med(ours_c) / read_floor,
            ">= 0.8", med(ours_c) / read_floor >= 0.8),
        Row(f"(d) training, save every {args.save_every} steps", f"{med(saving):.3f} steps/s",
            f"{med(plain):.3f} steps/s without saving", med(saving) / med(plain),
            ">= 0.98", med(saving) / med(plain) >= 0.98),
    ]  # fmt: skip
    print()
    print(f"checkpoint bench: {size / 1e9:.3f} GB state, median of {args.repeats}, "
          f"hash_workers={args.hash_workers}")  # fmt: skip
    load = ", ".join(f"{v:.2f}" for v in (*loads, *os.getloadavg()))
    for line in [*machine(), filesystem(root), f"load average at start, end: {load}"]:
        print("  " + line)
    print()
    header = ("", "ours", "baseline", "ratio", "target", "")
    table = [header] + [
        (r.name, r.ours, r.baseline, f"{r.ratio:.3f}", r.target, "met" if r.met else "MISSED")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print()
    print(f"first save (allocating staging buffers): {first_stall:.3f} s stall, once per process")
    where = (
        "in the background writer"
        if isinstance(manager._skeleton, ProbeSkeleton)
        else ("in the stall")
    )
    print(f"(a) the probe batch's forward pass ({probe_seconds:.3f} s) runs {where}")
    print(f"(a) the step after a save took {statistics.median(slower):.3f} s longer than a "
          "plain step (background copy, hashing, writing)")  # fmt: skip
    print(f"one training step: {step_seconds:.2f} s; saves every {args.save_every} steps = "
          f"every {args.save_every / med(plain):.1f} s")  # fmt: skip
    print(f"(c) warm page cache, for comparison: restore {warm_ours / 1e9:.2f} GB/s, "
          f"raw read {warm_raw / 1e9:.2f} GB/s, ratio {warm_ours / warm_raw:.3f}")  # fmt: skip
    print(f"(c) a raw read into fresh memory (every page first touched by the read): "
          f"{med(fresh_c) / 1e9:.2f} GB/s cold; "
          f"restore ÷ that: {med(ours_c) / med(fresh_c):.3f}")  # fmt: skip
    print(f"sha256 on one core: {sha256_speed() / 1e9:.2f} GB/s; "
          f"blake3 on one core: {blake3_speed() / 1e9:.2f} GB/s")  # fmt: skip
    print()
    print_peers(
        peer_rows, size=size, raw_write=write_floor, raw_read=read_floor, training=med(plain)
    )
    return 0


def peers_side_by_side(
    args: argparse.Namespace,
    root: Path,
    state: TrainingState,
    manager: CheckpointManager,
    peers: list[Peer],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    say: Callable[[str], None],
) -> list[PeerFigures]:
    """Each peer and Tracks save (durable) and restore cold into the live state, per repeat."""
    loop = training_loop(state, inputs, targets)
    tracks_sync = PeerFigures("Tracks save / resume (verify every byte, restore, probe)")
    tracks_async = PeerFigures("Tracks save_async")

    def tracks_round() -> None:
        settle()
        began = time.perf_counter()
        info = manager.save(state)
        tracks_sync.save.append(time.perf_counter() - began)
        tracks_sync.stall.append(tracks_sync.save[-1])
        drop_cache(info.path)
        settle()
        reader = CheckpointManager(root / "run", CheckpointConfig(keep_last_k=100), run_id="bench")
        reader.bind_attempt(2, None)
        began = time.perf_counter()
        assert reader.resume(state) is not None
        tracks_sync.restore.append(time.perf_counter() - began)
        shutil.rmtree(info.path)
        settle()
        began = time.perf_counter()
        manager.save_async(state)
        loop.forward_backward()
        loop.optimizer_step()  # waits in optimizer.step() until the copy is done
        manager.wait()
        tracks_async.save.append(time.perf_counter() - began)
        assert manager.last_stall is not None
        tracks_async.stall.append(manager.last_stall.total)
        remove_checkpoints(root)

    figures = {peer.name: PeerFigures(peer.name) for peer in peers}

    def peer_round(peer: Peer) -> Callable[[], None]:
        def run_peer() -> None:
            target = root / "peer"
            settle()
            stall, total = peer.save(state.model, state.optimizer, target, loop)
            figures[peer.name].stall.append(stall)
            figures[peer.name].save.append(total)
            drop_cache_tree(target)
            settle()
            began = time.perf_counter()
            peer.restore(state.model, state.optimizer, target)
            figures[peer.name].restore.append(time.perf_counter() - began)
            shutil.rmtree(target)

        return run_peer

    sides = [tracks_round, *(peer_round(peer) for peer in peers)]
    for index in range(args.repeats):
        for side in rotated(index, sides):
            side()
    for figure in (tracks_sync, tracks_async, *figures.values()):
        say(f"(e) {figure.name}: save {_fmt(figure.save)}; stall {_fmt(figure.stall)}"
            + (f"; restore {_fmt(figure.restore)}" if figure.restore else ""))  # fmt: skip
    return [tracks_sync, tracks_async, *figures.values()]


def training_loop(state: TrainingState, inputs: torch.Tensor, targets: torch.Tensor) -> Loop:
    """``train_step`` in its two halves, for peers whose save must finish staging in between."""
    return Loop(
        functools.partial(forward_backward, state, inputs, targets),
        functools.partial(optimizer_step, state),
    )


def training_side_by_side(
    args: argparse.Namespace,
    root: Path,
    state: TrainingState,
    manager: CheckpointManager,
    peers: list[Peer],
    rows: list[PeerFigures],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    say: Callable[[str], None],
) -> list[float]:
    """Steps per second over windows of 2 x save-every steps: without saving, and with a save
    every save-every steps by Tracks (``save_async``, ``save``) and by each peer, appended to
    ``rows`` (in ``peers_side_by_side``'s order). Returns the rates without saving.

    Each window saves half-way through each save-every steps and waits at its end for its last
    save to be durable, so every save's whole cost (stall and background work) falls inside
    it. Every save goes to a folder of its own, deleted after the window, outside its time."""
    window = 2 * args.save_every
    loop = training_loop(state, inputs, targets)
    tracks_sync, tracks_async, *peer_figures = rows
    assert [peer.name for peer in peers] == [figure.name for figure in peer_figures]
    plain: list[float] = []

    def saves_at(index: int) -> bool:
        return index % args.save_every == args.save_every // 2

    def timed_window(loop_body: Callable[[], None], into: list[float]) -> Callable[[], None]:
        def run_window() -> None:
            settle()
            seconds, _ = timed(loop_body)
            into.append(window / seconds)
            remove_checkpoints(root)
            shutil.rmtree(root / "window", ignore_errors=True)  # a peer's saves

        return run_window

    def train_only() -> None:
        for _ in range(window):
            train_step(state, inputs, targets)

    def tracks_save_async() -> None:
        for index in range(window):
            train_step(state, inputs, targets)  # waits in optimizer.step() for the copy
            manager.poll()
            if saves_at(index):
                manager.save_async(state)
        manager.wait()

    def tracks_save() -> None:
        for index in range(window):
            train_step(state, inputs, targets)
            if saves_at(index):
                manager.save(state)

    def peer_saves(peer: Peer) -> Callable[[], None]:
        def train_and_save() -> None:
            pending: PendingSave | None = None
            (root / "window").mkdir()
            for index in range(window):
                loop.forward_backward()
                if pending is not None:
                    pending.staged()
                loop.optimizer_step()
                if saves_at(index):
                    if pending is not None:
                        pending.durable()  # one save at a time, as DCP's examples do
                    pending = peer.start(state.model, state.optimizer, root / "window" / str(index))
            if pending is not None:
                pending.durable()

        return train_and_save

    sides = [
        timed_window(train_only, plain),
        timed_window(tracks_save_async, tracks_async.training),
        timed_window(tracks_save, tracks_sync.training),
        *(timed_window(peer_saves(peer), figure.training)
          for peer, figure in zip(peers, peer_figures, strict=True)),
    ]  # fmt: skip
    for index in range(args.repeats):
        for side in rotated(index, sides):
            side()
    say(f"(d) without saves {_fmt(plain, 1, 'steps/s')}")
    for figure in rows:
        say(f"(d) {figure.name}: with saves {_fmt(figure.training, 1, 'steps/s')}")
    return plain


def drop_cache_tree(directory: Path) -> None:
    for folder in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        drop_cache_files(folder)


def drop_cache_files(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def print_peers(
    rows: list[PeerFigures], *, size: int, raw_write: float, raw_read: float, training: float
) -> None:
    """Seconds (median) and the share of the raw floor: size ÷ raw speed ÷ the time taken;
    training steps per second with saves ÷ ``training``, the rate without saving."""
    med = statistics.median
    write_floor, read_floor = size / raw_write, size / raw_read
    print(f"side by side, {size / 1e9:.3f} GB, median of {len(rows[0].save)} "
          f"(floors: write+fsync {write_floor:.3f} s, cold read {read_floor:.3f} s; "
          f"training without saves {training:.3f} steps/s)")  # fmt: skip
    header = ("", "save s", "share of floor", "stall s", "restore s", "share of floor",
              "training with saves ÷ without")  # fmt: skip
    table = [header]
    for row in rows:
        save, stall = med(row.save), med(row.stall)
        restore = med(row.restore) if row.restore else None
        table.append((
            row.name, f"{save:.3f}", f"{write_floor / save:.2f}", f"{stall:.3f}",
            f"{restore:.3f}" if restore else "-",
            f"{read_floor / restore:.2f}" if restore else "-",
            f"{med(row.training) / training:.3f}",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print("peers do not verify what they read; Tracks' resume verifies every byte (BLAKE3),")
    print("restores into the live model and optimizer and re-runs the probe batch.")


def blake3_speed() -> float:
    data = memoryview(bytearray(256 * 1024 * 1024))
    seconds, _ = timed(lambda: blake3.blake3(data).digest())
    return len(data) / seconds


def sha256_speed() -> float:
    data = memoryview(bytearray(256 * 1024 * 1024))
    seconds, _ = timed(lambda: hashlib.sha256(data).digest())
    return len(data) / seconds


def rotated(index: int, sides: list[T]) -> list[T]:
    """Repeat ``index`` starts one side later than the one before: no side always runs first,
    or always right after the same neighbour's writeback."""
    shift = index % len(sides)
    return sides[shift:] + sides[:shift]


def _abba(index: int, first: Callable[[], None], second: Callable[[], None]) -> list:
    """A B, B A, A B …: a drift in the machine (page cache, other load) hits both sides."""
    return [first, second] if index % 2 == 0 else [second, first]


def _fmt(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    shown = ", ".join(f"{v * scale:.3f}" for v in values)
    return f"median {statistics.median(values) * scale:.3f} {unit} [{shown}]"


if __name__ == "__main__":
    sys.exit(main())
