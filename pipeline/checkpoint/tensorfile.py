"""safetensors without an extra copy: written from the staged tensors, parsed in place.

``safetensors.torch.save`` builds the whole file as one ``bytes`` object (a second copy of a
gigabyte of state) and ``safetensors.torch.load`` copies every tensor out of the bytes it is
given. For large checkpoints both copies cost as much as the disk, so the writer streams the
header and each tensor's own memory, and the reader returns views into the one buffer it read
(and hashed). The files are ordinary safetensors: any safetensors reader loads them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.checkpoint.direct_io import DIRECT_ALIGN, block_ceil, direct_buffer

# safetensors' names for torch dtypes.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class TensorFileError(ValueError):
    """Bytes that are not a well-formed safetensors file (the message says what is wrong)."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without copying them."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor; stage it first")
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: where its bytes lie in the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def safetensors_layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[TensorEntry]]:
    """A file's first bytes (header length, JSON header) and its tensors' places, in file order.

    Tensors are laid out by element size (largest first), then name, so every tensor starts
    at an offset aligned to its element size, as safetensors itself does; the header is padded
    with spaces to a multiple of 8. Offsets are from the start of the data, which follows the
    header. Depends only on names, dtypes, shapes and ``metadata``, never on values.
    """
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    entries = []
    for name, tensor in ordered:
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name, tensor.dtype, tuple(tensor.shape), offset, offset + size))
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, entries


def safetensors_chunks(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> list[memoryview]:
    """The file as a list of buffers: the header, then every tensor's own bytes in file order
    (:func:`safetensors_layout`). Equal tensors give equal bytes."""
    head, entries = safetensors_layout(tensors, metadata)
    return [memoryview(head), *(tensor_bytes(tensors[entry.name]) for entry in entries)]


class FileImage:
    """A safetensors file laid out in one buffer of its own, as it will lie on the disk.

    The buffer holds the header, then a place for each tensor (:attr:`tensors`, views of the
    buffer, which staging copies into), then zeros up to the end of the last block. It is
    block-aligned memory from :func:`direct_buffer`, so an O_DIRECT write takes it as it is:
    the writer needs no aligned bounce buffer to gather the tensors into, a second copy of
    every byte.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        self.head, entries = safetensors_layout(tensors, metadata)
        self.size = len(self.head) + (entries[-1].end if entries else 0)
        # Fresh anonymous memory reads as zeros: the padding past ``size`` already is.
        self.buffer = direct_buffer(max(DIRECT_ALIGN, block_ceil(self.size)))
        self.buffer[: len(self.head)] = self.head
        data = torch.frombuffer(self.buffer, dtype=torch.uint8)[len(self.head) :]
        self.tensors = {entry.name: tensor_view(data, entry) for entry in entries}

    @property
    def data(self) -> memoryview:
        """The file's bytes (the buffer without its padding)."""
        return self.buffer[: self.size]

    def fits(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bool:
        """Whether ``tensors`` lay out exactly as this image (names, dtypes, shapes)."""
        return safetensors_layout(tensors, metadata)[0] == self.head

    def holds(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` are this image's own views, so that its bytes are their file."""
        return tensors.keys() == self.tensors.keys() and all(
            tensor.data_ptr() == self.tensors[name].data_ptr()
            and tensor.dtype == self.tensors[name].dtype
            and tensor.shape == self.tensors[name].shape
            for name, tensor in tensors.items()
        )


def header_length(head: bytes, size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against its size."""
    if size < 8 or len(head) < 8:
        raise TensorFileError(f"{size} bytes is shorter than the 8-byte header length")
    length = int.from_bytes(head[:8], "little")
    if length > size - 8:
        raise TensorFileError(f"header length {length} exceeds the {size}-byte file")
    return length


def parse_header(raw: bytes, data_size: int) -> tuple[list[TensorEntry], dict[str, str]]:
    """The entries (in file order) and metadata of a JSON header over ``data_size`` bytes.

    Raises :class:`TensorFileError` when the header does not describe the bytes.
    """
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TensorFileError(f"header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise TensorFileError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries = []
    for name, spec in header.items():
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            start, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TensorFileError(f"{name}: malformed header entry {spec!r}") from exc
        numel = 1
        for dim in shape:
            numel *= dim
        if not 0 <= start <= end <= data_size or end - start != numel * dtype.itemsize:
            raise TensorFileError(
                f"{name}: offsets [{start}, {end}) do not hold {list(shape)} of "
                f"{spec['dtype']} within {data_size} data bytes"
            )
        entries.append(TensorEntry(name, dtype, shape, start, end))
    entries.sort(key=lambda entry: (entry.start, entry.end))
    return entries, {str(k): str(v) for k, v in dict(metadata).items()}


def tensor_view(data: torch.Tensor, entry: TensorEntry, offset: int = 0) -> torch.Tensor:
    """``entry``'s tensor as a view of the 1-D uint8 ``data`` (bytes from ``offset``)."""
    raw = data[entry.start - offset : entry.end - offset]
    if (raw.storage_offset() * raw.element_size()) % entry.dtype.itemsize:
        raw = raw.clone()  # unaligned (a foreign writer): one small copy
    return raw.view(entry.dtype).reshape(entry.shape)


def parse_safetensors(buffer: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (views into ``buffer``, a 1-D uint8 tensor) and the file's metadata.

    Only reads a length, a JSON header and raw bytes: nothing in the file can run code.
    Raises :class:`TensorFileError` when the header does not describe the bytes.
    """
    size = buffer.numel()
    length = header_length(buffer[:8].numpy().tobytes(), size)
    data = buffer[8 + length :]
    entries, metadata = parse_header(buffer[8 : 8 + length].numpy().tobytes(), data.numel())
    return {entry.name: tensor_view(data, entry) for entry in entries}, metadata
