"""Reading checkpoint files once, in order, around the page cache (``direct_io.BlockReader``).

Small blocks and a small O_DIRECT threshold make a few hundred kilobytes cross every edge a
gigabyte crosses: a header spread over several blocks, tensors split between blocks, a last
block that ends off the 4096-byte grid.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import threading
from pathlib import Path

import blake3
import pytest
import torch

from pipeline.checkpoint import CorruptCheckpointError, direct_io, verify
from pipeline.checkpoint.verify import ListedFile, read_verified, read_verified_into
from pipeline.digests import DigestAlgorithm
from tests.checkpoint_read_support import block_edge_tensors, write_tensor_file


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """8 KiB blocks, O_DIRECT from 64 KiB; returns, per read, whether it bypassed the cache."""
    monkeypatch.setattr(direct_io, "READ_BLOCK", 8192)
    monkeypatch.setattr(verify, "DIRECT_MIN_BYTES", 64 * 1024)
    direct: list[bool] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        direct.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real(fd, buffers, offset)

    monkeypatch.setattr(direct_io.os, "preadv", preadv)
    return direct


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_tensors_land_in_place_byte_for_byte_across_block_edges(
    tmp_path: Path, small_blocks: list[bool], monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    if not direct:
        monkeypatch.setattr(direct_io, "use_direct_io", lambda fd, on=True: False)
    tensors = block_edge_tensors()
    listed = write_tensor_file(tmp_path / "model.safetensors", tensors)
    # Destinations for all but two tensors: those are spilled into a fresh buffer.
    into = {n: torch.zeros_like(t) for n, t in tensors.items() if n not in ("half", "layer.007")}
    into = {n: t for n, t in into.items() if not n.startswith("layer.007.")}
    pointers = {n: t.data_ptr() for n, t in into.items()}
    read = read_verified_into(tmp_path, listed, into)
    assert read.in_place
    assert read.tensors.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(read.tensors[name], tensor), name
        if name in into:
            assert read.tensors[name].data_ptr() == pointers[name]
            assert torch.equal(into[name], tensor)
    assert len(small_blocks) > 100
    # O_DIRECT until the last block, which ends off the grid: then through the cache.
    assert any(small_blocks) is direct
    if direct:
        assert small_blocks[:-2] == [True] * (len(small_blocks) - 2)
        assert small_blocks[-1] is False
    whole = read_verified(tmp_path, listed)
    assert whole.numpy().tobytes() == (tmp_path / "model.safetensors").read_bytes()


def test_a_destination_on_a_device_bytes_cannot_be_copied_to_is_spilled_instead(
    tmp_path: Path, small_blocks: list[bool]
) -> None:
    """A copy into a meta tensor succeeds and keeps nothing: read into, it would lose the bytes."""
    tensors = block_edge_tensors()
    listed = write_tensor_file(tmp_path / "model.safetensors", tensors)
    into = {"big": torch.empty(300_001, device="meta"), "half": torch.zeros(1023).half()}
    read = read_verified_into(tmp_path, listed, into)
    assert read.in_place and not read.whole
    assert read.tensors["big"].device.type == "cpu"
    assert torch.equal(read.tensors["big"], tensors["big"])
    assert read.tensors["half"].data_ptr() == into["half"].data_ptr()
    assert torch.equal(into["half"], tensors["half"])


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_a_file_whose_size_changed_is_refused_and_no_reader_is_left_behind(
    tmp_path: Path, small_blocks: list[bool], change: str
) -> None:
    path = tmp_path / "model.safetensors"
    listed = write_tensor_file(path, block_edge_tensors())
    raw = path.read_bytes()
    path.write_bytes(raw + b"\0" * 100_000 if change == "longer" else raw[:-5000])
    before = threading.active_count()
    for read in (
        lambda: read_verified(tmp_path, listed),
        lambda: read_verified_into(tmp_path, listed, {"big": torch.zeros(300_001)}),
    ):
        with pytest.raises(CorruptCheckpointError, match="changed while being read"):
            read()
    assert threading.active_count() == before
    if change == "longer":
        # Read one block past the listed size, not the 100 KB appended.
        assert len(small_blocks) <= 2 * (-(-len(raw) // 8192) + 1)


def test_a_filesystem_that_takes_the_flag_but_refuses_the_read_is_read_through_the_cache(
    tmp_path: Path, small_blocks: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = write_tensor_file(tmp_path / "model.safetensors", block_edge_tensors())
    counting = direct_io.os.preadv

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return counting(fd, buffers, offset)

    monkeypatch.setattr(direct_io.os, "preadv", refuse_direct)
    whole = read_verified(tmp_path, listed)
    assert whole.numpy().tobytes() == (tmp_path / "model.safetensors").read_bytes()
    assert small_blocks and not any(small_blocks)


def test_a_read_error_reaches_the_caller_with_its_errno(
    tmp_path: Path, small_blocks: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = write_tensor_file(tmp_path / "model.safetensors", block_edge_tensors())
    counting = direct_io.os.preadv

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset >= 5 * 8192:
            raise OSError(errno.EIO, "Input/output error")
        return counting(fd, buffers, offset)

    monkeypatch.setattr(direct_io.os, "preadv", failing)
    before = threading.active_count()
    with pytest.raises(OSError) as caught:
        read_verified_into(tmp_path, listed, {"big": torch.zeros(300_001)})
    assert caught.value.errno == errno.EIO
    assert threading.active_count() == before


def test_blocks_that_arrive_out_of_order_or_short_are_handed_out_in_file_order(
    tmp_path: Path, small_blocks: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads read each file: a block that lands first waits for the one before it, and a
    read the kernel cuts short mid-file is finished, never taken for the end of the file."""
    path = tmp_path / "model.safetensors"
    listed = write_tensor_file(path, block_edge_tensors())
    counting = direct_io.os.preadv
    first_done = threading.Event()
    order: list[int] = []

    def uneven(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == 0:
            first_done.wait(timeout=5)  # block 0 lands after block 1
        if offset == 3 * 8192:
            buffers = [buffers[0][:4096]]  # a short read in the middle of the file
        count = counting(fd, buffers, offset)
        order.append(offset)
        if offset == 8192:
            first_done.set()
        return count

    monkeypatch.setattr(direct_io.os, "preadv", uneven)
    whole = read_verified(tmp_path, listed)
    assert whole.numpy().tobytes() == path.read_bytes()
    assert order.index(8192) < order.index(0)
    assert 3 * 8192 + 4096 in order  # the rest of the short block, read by the same thread


def test_a_file_that_ends_inside_its_header_is_refused_for_what_it_is(tmp_path: Path) -> None:
    """Bytes that match the manifest but cannot be a tensor file (shorter than the 8 bytes
    that give the header's length): "does not load", not "changed while being read"."""
    path = tmp_path / "model.safetensors"
    raw = b"\x05\x00\x00\x00\x00"
    path.write_bytes(raw)
    listed = ListedFile(path.name, len(raw), DigestAlgorithm.BLAKE3, blake3.blake3(raw).hexdigest())
    with pytest.raises(CorruptCheckpointError, match="does not load"):
        read_verified_into(tmp_path, listed, {})


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_direct_buffers_are_aligned_private_memory_on_huge_pages(tmp_path: Path) -> None:
    size = 8 * 1024 * 1024
    buffer = direct_io.direct_buffer(size)
    assert len(buffer) == size and not buffer.readonly
    exported = (ctypes.c_char * size).from_buffer(buffer)
    address = ctypes.addressof(exported)
    assert address % (2 * 1024 * 1024) == 0
    buffer[:] = b"\x01" * size  # first touch: the kernel backs it now
    # An O_DIRECT read lands in it (aligned address, aligned length).
    path = tmp_path / "blocks"
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        direct = direct_io.use_direct_io(fd)
        assert os.preadv(fd, [buffer], 0) == size
    finally:
        os.close(fd)
    assert bytes(buffer) == path.read_bytes()
    if not direct or _thp_mode() == "never":
        pytest.skip("no O_DIRECT or no transparent huge pages here: alignment checked only")
    # Private anonymous memory, advised: each 2 MiB is one physically contiguous segment of
    # an O_DIRECT request (a shared mapping would be shmem, which takes no such advice).
    assert _anon_huge_kib(address) >= size // 1024
    del exported


def test_read_buffers_prepared_ahead_are_the_ones_the_first_read_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer maps and touches the read buffers while it loads data: the first restore of
    the process then maps none of its own, and preparing twice does not grow the pool."""
    monkeypatch.setattr(direct_io, "read_buffers", direct_io.BufferPool(direct_io._SPARE_BLOCKS))
    direct_io.prepare_read_buffers().join()
    direct_io.prepare_read_buffers().join()
    assert direct_io.read_buffers.kept == direct_io._SPARE_BLOCKS

    mapped: list[int] = []
    real = direct_io.direct_buffer
    monkeypatch.setattr(direct_io, "direct_buffer", lambda size: mapped.append(size) or real(size))
    data = os.urandom(2 * direct_io.READ_BLOCK + 4096 * 3 + 17)  # three readers, a short end
    path = tmp_path / "optimizer.safetensors"
    path.write_bytes(data)
    got = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        with direct_io.BlockReader(fd, len(data), direct=True) as blocks:
            for offset, view in blocks:
                assert offset == len(got)
                got += view
    finally:
        os.close(fd)
    assert bytes(got) == data
    assert mapped == []
    assert direct_io.read_buffers.kept == direct_io._SPARE_BLOCKS  # all handed back
