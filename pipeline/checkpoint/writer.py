"""Hash and write a staged checkpoint, then commit it: files, MANIFEST.json, COMMITTED last.

Each data file is written straight from the staged tensors (no serialized copy) while another
thread hashes the same memory, so hashing costs no extra pass over the disk and overlaps the
write. A storage error names the file, keeps its errno, and leaves the directory uncommitted.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline import envvars
from pipeline.checkpoint.direct_io import (
    DIRECT_ALIGN,
    DIRECT_MIN_BYTES,
    BufferPool,
    block_ceil,
    use_direct_io,
)
from pipeline.checkpoint.layout import (
    COMMITTED_FILE,
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    TENSOR_FILE_METADATA,
    TRAINER_STATE_FILE,
    fsync_dir,
    replace_atomically,
    write_file_durably,
)
from pipeline.checkpoint.state import StagedCheckpoint
from pipeline.checkpoint.tensorfile import FileImage, safetensors_chunks
from pipeline.digests import FILE_DIGEST, Hasher, new_hasher, sha256_bytes

# Test hooks, both "N" or "seconds@N" (N: the checkpoint's step), acting halfway through
# optimizer.safetensors, so the directory holds a complete file and a half-written one.
# TRACKS_FAULT_ENOSPC_AT_STEP raises OSError(ENOSPC) there; TRACKS_FAULT_SLEEP_DURING_WRITE
# ("seconds@N") pauses there.

_WRITE_SLICE = 64 * 1024 * 1024  # per write(2): large, but under Linux's 2 GiB limit
_HASH_IN_THREAD_BYTES = 8 * 1024 * 1024  # below this, a thread costs more than it saves
# Large files bypass the page cache (O_DIRECT, direct_io.py says why): page-cache writeback is
# CPU that a background save otherwise takes from the training thread.
_DIRECT_BUFFER = 16 * 1024 * 1024  # an aligned bounce buffer the chunks are gathered into
# Gathered 1 MiB at a time, each piece hashed at once while it is in the core's cache; no one
# copy holds the GIL long (memoryview assignment keeps it; the write thread needs it between
# writes).
_GATHER_SLICE = 1024 * 1024
_IMAGE_SLICE = 64 * 1024 * 1024  # per pwrite(2) from a file image (write_image_direct)
_BOUNCE_BUFFERS = 3  # one being filled and hashed, one being written, one waiting to be
# Kept across writes (an async writer and the trainer may write at once): mapped once per process.
_bounce_buffers = BufferPool(keep=2 * _BOUNCE_BUFFERS)


@dataclass(frozen=True)
class WrittenCheckpoint:
    """A directory whose files and MANIFEST.json are durable but which is not yet committed."""

    path: Path
    run_id: str
    attempt_no: int
    step: int
    manifest_sha256: str
    size_bytes: int
    metrics: dict[str, float]


def serialize_staged(staged: StagedCheckpoint) -> dict[str, list[memoryview]]:
    """Every data file as the buffers it is made of, by name; equal state gives equal bytes.

    The buffers alias the staged tensors (or are their file image): nothing is copied until
    the bytes reach the disk.
    """
    return _serialize(staged, file_images(staged))


def _serialize(
    staged: StagedCheckpoint, images: dict[str, FileImage]
) -> dict[str, list[memoryview]]:
    trainer_state = json.dumps(staged.trainer_state, sort_keys=True, indent=1).encode()
    return {
        MODEL_FILE: _tensor_file(images.get(MODEL_FILE), staged.model),
        OPTIMIZER_FILE: _tensor_file(images.get(OPTIMIZER_FILE), staged.training_tensors),
        TRAINER_STATE_FILE: [memoryview(trainer_state)],
        PROBE_FILE: safetensors_chunks(
            staged.probe,
            {
                "format": "pt",
                "device": staged.probe_device,
                # CPU kernels differ in the last bit between instruction sets (AVX2, AVX512):
                # an exact post-restore comparison holds only on the same one.
                "cpu_capability": cpu_capability(),
            },
        ),
    }


def file_images(staged: StagedCheckpoint) -> dict[str, FileImage]:
    """The data files whose bytes are a staging image as it is (see :class:`FileImage`)."""
    tensors = {MODEL_FILE: staged.model, OPTIMIZER_FILE: staged.training_tensors}
    return {
        name: image
        for name, image in staged.images.items()
        if name in tensors and image.holds(tensors[name])
    }


def _tensor_file(image: FileImage | None, tensors: dict[str, Any]) -> list[memoryview]:
    if image is not None:
        return [image.data]
    return safetensors_chunks(tensors, TENSOR_FILE_METADATA)


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels use here (e.g. ``AVX2``, ``AVX512``)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def write_checkpoint_files(
    staged: StagedCheckpoint,
    directory: Path,
    *,
    run_id: str,
    attempt_no: int,
    hash_workers: int = 1,
    hash_threads: int = 1,
) -> WrittenCheckpoint:
    """Write and fsync every file, then MANIFEST.json (name, size, digest of each file).

    With ``hash_workers`` 0 (the default) each file is hashed on this thread, slice by slice,
    right before the slice is written: cache-hot, and never two busy threads beside a training
    loop on a small machine; each slice's BLAKE3 then runs on up to ``hash_threads`` cores (for
    a save the training loop waits for: nothing else needs them). ``hash_workers`` >= 1 threads
    hash the large files while this thread writes them (for machines with cores to spare). An
    OSError is re-raised naming the file it happened to, with its errno (ENOSPC stays ENOSPC).
    """
    try:
        directory.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise naming_step(exc, directory, staged.step) from exc
    images = file_images(staged)
    contents = _serialize(staged, images)
    digests = _Hashers(contents, hash_workers) if hash_workers >= 1 else None
    inline: dict[str, Hasher] = {}
    files: list[dict[str, Any]] = []
    try:
        for name, chunks in contents.items():
            halfway = _fault_halfway(staged.step) if name == OPTIMIZER_FILE else None
            digest = inline[name] = new_hasher(FILE_DIGEST, threads=hash_threads)
            size = write_chunks_durably(
                directory / name,
                chunks,
                halfway=halfway,
                digest=None if digests else digest,
                image=images.get(name),
            )
            files.append({"name": name, "size": size})
    except OSError as exc:
        raise naming_step(exc, exc.filename or directory, staged.step) from exc
    finally:
        # Never leave a thread reading buffers the caller will reuse.
        computed = digests.join() if digests else {n: d.hexdigest() for n, d in inline.items()}
    for entry in files:
        entry.update(algorithm=FILE_DIGEST.value, digest=computed[entry["name"]])
    manifest = {
        "format": FORMAT,
        "run_id": run_id,
        "attempt_no": attempt_no,
        "step": staged.step,
        "metrics": staged.metrics,
        "created_at": datetime.now(UTC).isoformat(),
        "files": files,
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, indent=1).encode()
    try:
        write_file_durably(directory / MANIFEST_FILE, manifest_bytes)
        fsync_dir(directory)
        fsync_dir(directory.parent)
    except OSError as exc:
        raise naming_step(exc, directory / MANIFEST_FILE, staged.step) from exc
    return WrittenCheckpoint(
        path=directory,
        run_id=run_id,
        attempt_no=attempt_no,
        step=staged.step,
        manifest_sha256=sha256_bytes(manifest_bytes),
        size_bytes=sum(f["size"] for f in files) + len(manifest_bytes),
        metrics=staged.metrics,
    )


def commit_checkpoint_dir(written: WrittenCheckpoint, *, fencing_token: int | None) -> dict:
    """Write COMMITTED atomically: from this rename on, the directory is a checkpoint."""
    payload = {
        "manifest_sha256": written.manifest_sha256,
        "run_id": written.run_id,
        "attempt_no": written.attempt_no,
        "step": written.step,
        "fencing_token": fencing_token,
        "committed_at": datetime.now(UTC).isoformat(),
    }
    try:
        replace_atomically(
            written.path / COMMITTED_FILE, json.dumps(payload, sort_keys=True).encode()
        )
    except OSError as exc:
        raise naming_step(exc, written.path / COMMITTED_FILE, written.step) from exc
    return payload


def write_chunks(
    fd: int,
    chunks: Sequence[memoryview],
    halfway: Callable[[], None] | None,
    digest: Hasher | None = None,
) -> int:
    """write(2) every buffer in full (large slices, short writes retried); returns the size.

    ``halfway``, when given, is called once half of the bytes are written (a fault hook);
    ``digest``, when given, is fed every slice as it is written.
    """
    half = sum(len(c) for c in chunks) // 2
    written = 0
    for chunk in chunks:
        view = chunk
        while len(view):
            if halfway is not None and written == half:
                halfway()
                halfway = None
            limit = _WRITE_SLICE
            if halfway is not None:
                limit = min(limit, half - written)
            count = os.write(fd, view[:limit])
            if digest is not None:
                digest.update(view[:count])
            written += count
            view = view[count:]
    if halfway is not None:
        halfway()
    return written


def write_chunks_direct(
    fd: int,
    chunks: Sequence[memoryview],
    halfway: Callable[[], None] | None,
    digest: Hasher | None = None,
) -> int:
    """Like :func:`write_chunks`, on a descriptor opened with O_DIRECT.

    O_DIRECT wants aligned addresses, lengths and offsets, which tensors laid end to end are
    not: the chunks are gathered into aligned bounce buffers, each written whole. The last
    block is padded with zeros and the file truncated back to its size. ``halfway`` is called
    once the first half of the bytes (rounded down to a block) are on the disk; ``digest`` is
    fed each gathered slice (not the padding) while it is still in the cache, before its write.

    The writes run on a thread of their own, in file order, while this thread gathers and
    hashes the next slice: the disk is never idle waiting for the CPU, nor the CPU for the
    disk. A write's error (ENOSPC, EIO) is raised here, with its errno, once the writes
    already in flight are done (they read the bounce buffers).
    """
    size = sum(len(c) for c in chunks)
    half = size // 2 // DIRECT_ALIGN * DIRECT_ALIGN if halfway is not None else -1
    buffers = [_bounce_buffers.take(_DIRECT_BUFFER) for _ in range(_BOUNCE_BUFFERS)]
    in_flight: deque[Future[None]] = deque()  # oldest first; the nth used buffers[n % 3]
    flushed = filled = flushes = 0
    out = buffers[0]

    def flush(length: int) -> None:
        nonlocal flushed, filled, flushes, out
        in_flight.append(disk.submit(_pwrite_all, fd, out[:length], flushed))
        flushed += length
        filled = 0
        flushes += 1
        # The next buffer is free once the write that last used it is done.
        while len(in_flight) >= len(buffers):
            in_flight.popleft().result()
        out = buffers[flushes % len(buffers)]

    def drain() -> None:
        while in_flight:
            in_flight.popleft().result()

    try:
        # Leaving the block waits for every write submitted, after an error too: none may
        # still read a buffer once they are handed back.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write") as disk:
            for chunk in chunks:
                view = chunk
                while len(view):
                    room = _DIRECT_BUFFER - filled
                    if flushed < half:
                        room = min(room, half - flushed - filled)  # flush exactly at the half
                    count = min(room, len(view), _GATHER_SLICE)
                    out[filled : filled + count] = view[:count]
                    if digest is not None:  # while the slice is still in the core's cache
                        digest.update(out[filled : filled + count])
                    filled += count
                    view = view[count:]
                    if filled == _DIRECT_BUFFER or flushed + filled == half:
                        flush(filled)
                        if flushed == half and halfway is not None:
                            drain()
                            halfway()
                            halfway = None
            if filled:
                padded = block_ceil(filled)
                out[filled:padded] = bytes(padded - filled)
                flush(padded)
            drain()
    finally:
        _bounce_buffers.give(buffers)
    if flushed != size:
        os.ftruncate(fd, size)
    if halfway is not None:
        halfway()
    return size


def write_image_direct(
    fd: int,
    image: FileImage,
    halfway: Callable[[], None] | None,
    digest: Hasher | None = None,
) -> int:
    """Like :func:`write_chunks_direct`, from a file image: its slices are written as they
    lie, with no bounce buffer to gather them into (the image is block-aligned and its last
    block padded with zeros).

    The image does not change while it is written, so each slice is handed to the write
    thread first and hashed (up to the file's end) while the disk writes it: the disk starts
    at once and never waits for the hash. Slices are as large as the raw floor's writes
    (64 MiB): the kernel splits each into requests the disk has in flight together.
    """
    size = image.size
    end = block_ceil(size)
    half = size // 2 // DIRECT_ALIGN * DIRECT_ALIGN if halfway is not None else -1
    in_flight: deque[Future[None]] = deque()
    # Leaving the block waits for every write submitted, after an error too.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write") as disk:
        at = 0
        while at < end:
            stop = min(end, at + _IMAGE_SLICE)
            if at < half:
                stop = min(stop, half)  # the halfway hook sees exactly the first half
            in_flight.append(disk.submit(_pwrite_all, fd, image.buffer[at:stop], at))
            if digest is not None and at < size:
                digest.update(image.buffer[at : min(stop, size)])
            at = stop
            # One slice written, the next queued behind it; a failed write is raised before
            # much more is hashed.
            while len(in_flight) > 1:
                in_flight.popleft().result()
            if at == half and halfway is not None:
                while in_flight:
                    in_flight.popleft().result()
                halfway()
                halfway = None
        while in_flight:
            in_flight.popleft().result()
    if end != size:
        os.ftruncate(fd, size)
    if halfway is not None:
        halfway()
    return size


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        count = os.pwrite(fd, view[done:], offset + done)
        if not count:
            raise OSError(errno.EIO, "write(2) wrote nothing")
        done += count


def write_chunks_durably(
    path: Path,
    chunks: Sequence[memoryview],
    *,
    halfway: Callable[[], None] | None = None,
    digest: Hasher | None = None,
    image: FileImage | None = None,
) -> int:
    """Create ``path``, write ``chunks`` into it and fsync it; returns the size.

    With ``image``, the chunks are that image's bytes, and an O_DIRECT write takes them from
    it as they lie. A write(2) or fsync(2) error names the file and keeps its errno.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        # Set after the create, not in open(2): an open refused for O_DIRECT could leave the
        # file created, and O_EXCL would then refuse the buffered retry.
        if sum(len(c) for c in chunks) >= DIRECT_MIN_BYTES and use_direct_io(fd):
            if image is not None:
                size = write_image_direct(fd, image, halfway, digest)
            else:
                size = write_chunks_direct(fd, chunks, halfway, digest)
        else:
            size = write_chunks(fd, chunks, halfway, digest)
        os.fsync(fd)
    except OSError as exc:
        if exc.filename is None:  # write(2) and fsync(2) errors carry no file name
            exc.filename = str(path)
        raise
    finally:
        os.close(fd)
    return size


class _Hashers:
    """The digest of each file's buffers, the large ones on ``workers`` background threads.

    The buffers are the staged tensors themselves: hashing reads the memory the write reads,
    never a second copy and never the disk.
    """

    def __init__(self, contents: dict[str, list[memoryview]], workers: int) -> None:
        self._digests: dict[str, str] = {}
        self._errors: list[BaseException] = []
        large: list[tuple[int, str]] = []
        for name, chunks in contents.items():
            size = sum(len(c) for c in chunks)
            if size < _HASH_IN_THREAD_BYTES or workers < 1:
                self._digests[name] = chunks_digest(chunks)
            else:
                large.append((size, name))
        # Largest first onto the least loaded worker: two workers split model and optimizer.
        queues: list[list[str]] = [[] for _ in range(max(1, min(workers, len(large))))]
        loads = [0] * len(queues)
        for size, name in sorted(large, reverse=True):
            lightest = loads.index(min(loads))
            queues[lightest].append(name)
            loads[lightest] += size
        self._threads = [
            threading.Thread(
                target=self._run, args=(names, contents), name="checkpoint-hash", daemon=True
            )
            for names in queues
            if names
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, names: list[str], contents: dict[str, list[memoryview]]) -> None:
        try:
            for name in names:
                self._digests[name] = chunks_digest(contents[name])
        except BaseException as exc:  # surfaced by join()
            self._errors.append(exc)

    def join(self) -> dict[str, str]:
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise self._errors[0]
        return self._digests


def chunks_digest(chunks: Sequence[memoryview]) -> str:
    digest = new_hasher(FILE_DIGEST)
    for chunk in chunks:
        # Large updates release the GIL: training and writing carry on meanwhile.
        digest.update(chunk)
    return digest.hexdigest()


def naming_step(exc: OSError, path: Path | str, step: int) -> OSError:
    """The same kind of OSError (errno kept) naming the file and the checkpoint's step."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, f"{exc.strerror} (writing the checkpoint of step {step})", str(path))


def _fault_halfway(step: int) -> Callable[[], None] | None:
    enospc = envvars.TRACKS_FAULT_ENOSPC_AT_STEP.get()
    sleep = envvars.TRACKS_FAULT_SLEEP_DURING_WRITE.get()
    if enospc and int(enospc.rpartition("@")[2]) == step:

        def fail() -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return fail
    if sleep:
        seconds, _, at_step = sleep.partition("@")
        if not at_step or int(at_step) == step:
            return lambda: time.sleep(float(seconds))
    return None
