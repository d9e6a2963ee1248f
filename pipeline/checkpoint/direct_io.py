"""Checkpoint bytes that bypass the page cache (O_DIRECT), for writing and for reading.

A checkpoint is written once and read once, by another process: caching its pages helps no
one. Measured on this VM (bench/checkpoint_bench.py, README "Checkpoints that survive
kill -9"): through the page cache, 1 GB written + fsynced took 2.8 s and 2.5 s of CPU, and a
freshly written 1 GB read cold took 1.15-1.45 s with 1.2-2.0 s of system CPU (the kernel
filling a gigabyte of cache pages the guest had never touched). With O_DIRECT the write took
0.29 s and 0.04 s of CPU, and ``load_checkpoint``, BLAKE3 and the copy into the model
included, 0.50-0.54 s. A filesystem that refuses O_DIRECT (tmpfs, some network mounts) gets
the page cache.

The buffers an O_DIRECT request reads into or writes from sit on transparent huge pages
(:func:`direct_buffer`). The block layer turns each physically contiguous run of a buffer
into one segment of a request, and a virtio disk takes at most 254 segments per request
(``/sys/block/vda/queue/max_segments``): over scattered 4 KiB pages an 8 MiB read goes out
as eight requests of about 1 MiB, over 2 MiB pages as two of 4 MiB. Measured on 2 vCPUs
(AMD EPYC, 2026-11-26): a full resume of 1.007 GB took 0.41-0.66 s with read buffers
mapped after the process had freed others (4 KiB pages, wherever the allocator found them)
and 0.264-0.286 s on huge pages, the bare O_DIRECT read's 0.27 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from types import TracebackType

DIRECT_ALIGN = 4096  # covers 512- and 4096-byte logical blocks
DIRECT_MIN_BYTES = 8 * 1024 * 1024  # smaller files are written (and read) through the cache
_HUGE_PAGE = 2 * 1024 * 1024  # x86-64 and arm64 (4 KiB base pages) transparent huge pages
# Per read: hashed and copied while it is still in the last-level cache. Each block costs a
# few GIL handoffs between the reading, hashing and copying threads, and a thread back from
# a read can wait out the interpreter's switch interval (5 ms) for the GIL: measured on 2
# vCPUs (AMD EPYC, 2026-11-26), a full resume of 1.007 GB took 0.377 s with 4 MiB blocks
# and two readers per file, 0.285 s with 8 MiB and three, against 0.271 s for the bare
# O_DIRECT read; 16 MiB and 32 MiB blocks gained nothing more for twice the memory.
READ_BLOCK = 8 * 1024 * 1024
_READERS = 3  # reads in flight per file: the disk always has the next ones queued
# Buffers per file: one with the caller, one per reader, one ready. Two files are read at
# once; their buffers are kept for the next reader, across calls.
_SPARE_BLOCKS = 2 * (_READERS + 2)


def use_direct_io(fd: int, on: bool = True) -> bool:
    """Switch O_DIRECT on (or off) for ``fd``; False where the filesystem refuses it."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True


class BlockReader:
    """A file read once, in order, from offset 0 to its end, by threads of its own.

    Iterating yields ``(offset, bytes)`` pairs that cover the file in order; each memoryview
    is valid until the next one is asked for (its buffer is then read into again). Up to
    three threads read ahead, each a whole block at a time, into a few reused, page-aligned
    buffers, with O_DIRECT when ``direct`` and the filesystem allows it, so the disk has a
    read queued while the caller hashes and copies. They stop once past ``limit`` bytes (the
    size the caller expects), so a file that grew is seen as longer without being read whole.
    Leaving the ``with`` block stops the threads.
    """

    def __init__(self, fd: int, limit: int, *, direct: bool) -> None:
        self._fd = fd
        self._limit = limit
        self._direct = self._began_direct = direct and use_direct_io(fd)
        self._lock = threading.Lock()
        self._next = 0  # the offset the next reader takes
        self._end: int | None = None  # where a read found the file to end
        # A small file is one block (the reads stop at the first block past ``limit``): it
        # gets one reader, not a large file's three.
        readers = min(_READERS, limit // READ_BLOCK + 1)
        self._buffers = [read_buffers.take(READ_BLOCK) for _ in range(readers + 2)]
        self._free: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._filled: queue.SimpleQueue[tuple[int, int, int] | BaseException | None] = (
            queue.SimpleQueue()
        )
        for index in range(len(self._buffers)):
            self._free.put(index)
        self._threads = [
            threading.Thread(target=self._run, name="checkpoint-read", daemon=True)
            for _ in range(readers)
        ]

    def __enter__(self) -> BlockReader:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for _ in self._threads:
            self._free.put(None)  # wakes a thread waiting for a buffer; it stops there
        for thread in self._threads:
            thread.join()
        read_buffers.give(self._buffers)

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        # Blocks arrive in any order; they are handed out in file order. The lowest offset
        # not yet handed out is always being read by a thread that holds its buffer, so the
        # blocks parked here never starve the readers for good.
        parked: dict[int, tuple[int, int]] = {}
        at, running = 0, len(self._threads)
        while True:
            if at in parked:
                index, count = parked.pop(at)
                try:
                    yield at, self._buffers[index][:count]
                finally:
                    self._free.put(index)
                at += count
                continue
            if not running:
                return  # the file ends at ``at`` (anything parked lies past a gap)
            item = self._filled.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                index, offset, count = item
                parked[offset] = (index, count)

    def _run(self) -> None:
        try:
            while (index := self._free.get()) is not None:
                with self._lock:
                    offset = self._next
                    if offset > self._limit or (self._end is not None and offset >= self._end):
                        self._free.put(index)
                        return
                    self._next += READ_BLOCK
                count = self._fill(self._buffers[index], offset)
                if count < READ_BLOCK:
                    with self._lock:
                        self._end = min(offset + count, self._end or offset + count)
                if not count:
                    self._free.put(index)
                    continue
                self._filled.put((index, offset, count))
        except BaseException as exc:  # the caller raises it, from its own thread
            self._filled.put(exc)
        finally:
            self._filled.put(None)

    def _fill(self, view: memoryview, offset: int) -> int:
        """Read the whole block at ``offset``, short only where the file ends."""
        done = 0
        while done < len(view):
            count = self._read(view[done:], offset + done)
            if not count:
                break
            done += count
            if self._direct and count % DIRECT_ALIGN:
                # A read that ends off the block grid: the end of the file, or a file that
                # grows. The next read's offset is unaligned, which O_DIRECT refuses.
                self._direct = not use_direct_io(self._fd, on=False)
        return done

    def _read(self, view: memoryview, offset: int) -> int:
        try:
            return os.preadv(self._fd, [view], offset)
        except OSError as exc:
            # Some filesystems accept the flag and refuse the read: read through the cache
            # (the other reader may have switched the descriptor over already).
            if not (self._began_direct and exc.errno == errno.EINVAL):
                raise
            self._direct = not use_direct_io(self._fd, on=False)
            return os.preadv(self._fd, [view], offset)


def block_ceil(size: int) -> int:
    """``size`` rounded up to a whole O_DIRECT block: what a padded last write covers."""
    return -(-size // DIRECT_ALIGN) * DIRECT_ALIGN


def direct_buffer(size: int) -> memoryview:
    """``size`` bytes of private anonymous memory for O_DIRECT, on huge pages where it can be.

    Aligned to 2 MiB (so to every block size O_DIRECT asks for) and advised
    ``MADV_HUGEPAGE``: the module docstring says why. Where the kernel has no transparent huge
    pages the advice is refused and the buffer is ordinary page-aligned memory.
    """
    # The mapping is one huge page longer than asked, so an aligned start lies inside it; the
    # slack is never touched and so never backed by memory. The view keeps the mapping alive.
    mapping = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    exported = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    start = -ctypes.addressof(exported) % _HUGE_PAGE
    del exported  # a mapping with exported buffers cannot be closed
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    return memoryview(mapping)[start : start + size]


class BufferPool:
    """Buffers from :func:`direct_buffer` kept across calls, up to ``keep`` of them.

    Mapping (and first touching) a buffer costs more than the read or write it serves, so
    readers and writers hand theirs back here. Thread-safe; a buffer of another size than
    the one asked for (the block size changed) is dropped.
    """

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._spare: queue.SimpleQueue[memoryview] = queue.SimpleQueue()

    @property
    def kept(self) -> int:
        return self._spare.qsize()

    def take(self, size: int) -> memoryview:
        while True:
            try:
                buffer = self._spare.get_nowait()
            except queue.Empty:
                return direct_buffer(size)
            if len(buffer) == size:
                return buffer

    def give(self, buffers: Iterable[memoryview]) -> None:
        for buffer in buffers:
            if self._spare.qsize() >= self._keep:
                return
            self._spare.put(buffer)


# The buffers BlockReader reads into.
read_buffers = BufferPool(keep=_SPARE_BLOCKS)


def prepare_read_buffers() -> threading.Thread:
    """Map and touch the buffers a restore reads into, on a thread of its own; returns it.

    A process's first restore otherwise touches them for the first time itself, and on a VM
    first touching fresh memory costs a host fault per page: measured on 2 vCPUs, the first
    ``resume`` of 1.007 GB in a new process took 0.36-0.39 s, and 0.27-0.31 s with these
    buffers ready. The trainer starts this before it loads data and builds the model, when
    the run already has a committed checkpoint to resume. Buffers a restore takes meanwhile
    are simply mapped by the restore; the pool never grows past what two files use.
    """

    def fill() -> None:
        zeros = bytes(READ_BLOCK)
        for _ in range(_SPARE_BLOCKS):
            if read_buffers.kept >= _SPARE_BLOCKS:
                return
            buffer = direct_buffer(READ_BLOCK)
            buffer[:] = zeros
            read_buffers.give([buffer])

    thread = threading.Thread(target=fill, name="checkpoint-buffers", daemon=True)
    thread.start()
    return thread
