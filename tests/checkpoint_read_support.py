"""Test helpers for reading checkpoint files around the page cache: tensors whose safetensors
file crosses every block edge, written with the listing a manifest would hold for it."""

from __future__ import annotations

from pathlib import Path

import blake3
import torch
from safetensors.torch import save as safetensors_bytes

from pipeline.checkpoint.verify import ListedFile
from pipeline.digests import DigestAlgorithm


def block_edge_tensors() -> dict[str, torch.Tensor]:
    """The same tensors every call: a header of about 40 KB over several blocks, tensors split
    between blocks, a float16 one, and a file that ends off the 4096-byte grid."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        # Long names: a header of about 40 KB, five blocks before the first data byte.
        f"layer.{i:03d}.{'weight' * 30}": torch.randn(7 + i, generator=generator)
        for i in range(150)
    }
    tensors["big"] = torch.randn(300_001, generator=generator)  # ends off the block grid
    tensors["half"] = torch.randn(1023, generator=generator).to(torch.float16)
    return tensors


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor]) -> ListedFile:
    """Write ``tensors`` as a safetensors file at ``path``; its name, size and BLAKE3 digest."""
    raw = safetensors_bytes(tensors)
    path.write_bytes(raw)
    assert len(raw) % 4096 != 0  # the last block must end off the grid, or no test crosses it
    return ListedFile(path.name, len(raw), DigestAlgorithm.BLAKE3, blake3.blake3(raw).hexdigest())
