"""Names on disk and the durable-write primitives the protocol is built from."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

from pipeline import ids, safepath
from pipeline.durable import (  # noqa: F401 - the checkpoint protocol's primitives
    fsync_dir,
    make_dir_durably,
    replace_atomically,
    write_file_durably,
)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
PROBE_FILE = "probe.safetensors"
# The metadata of model.safetensors and optimizer.safetensors (what safetensors' own torch
# writer records).
TENSOR_FILE_METADATA = MappingProxyType({"format": "pt"})
MANIFEST_FILE = "MANIFEST.json"
COMMITTED_FILE = "COMMITTED"
# Written into a committed directory that failed verification: never a resume target again,
# and never counted by retention, even when no ledger is attached.
CORRUPT_FILE = "CORRUPT"
FORMAT = "tracks-checkpoint/1"
# Written by N ranks: model and optimizer tensors as torch.distributed.checkpoint shards
# (DCP_METADATA_FILE and one ``__<rank>_<n>.distcp`` file per rank and writer thread), each
# rank's RNG in ``rank-<rank>.json``, each rank's digests in ``digests-<rank>.json``.
SHARDED_FORMAT = "tracks-checkpoint-sharded/1"
DCP_METADATA_FILE = ".metadata"
_DCP_SHARD_RE = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp\Z")
_RANK_FILE_RE = re.compile(r"^(?P<kind>rank|digests)-(?P<rank>\d{5,})\.json\Z")

_DIR_RE = re.compile(r"^step-(?P<step>\d{10})-a(?P<attempt>\d{2,})\Z")


def is_dcp_file(name: str) -> bool:
    """A file torch.distributed.checkpoint writes (and only its restricted loaders read)."""
    return name == DCP_METADATA_FILE or _DCP_SHARD_RE.match(name) is not None


def file_rank(name: str) -> tuple[str, int] | None:
    """Whose file ``name`` is in a sharded checkpoint: ``("shard", rank)`` for a DCP shard,
    ``("rank", rank)`` or ``("digests", rank)`` for a rank's JSON; None for a run-level file."""
    if (shard := _DCP_SHARD_RE.match(name)) is not None:
        return "shard", int(shard["rank"])
    if (own := _RANK_FILE_RE.match(name)) is not None:
        return own["kind"], int(own["rank"])
    return None


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def digests_file(rank: int) -> str:
    return f"digests-{rank:05d}.json"


def checkpoint_dir_name(step: int, attempt_no: int) -> str:
    """``step-0000001200-a03``: sorts by step, and two attempts never share a directory."""
    return f"step-{step:010d}-a{attempt_no:02d}"


def parse_checkpoint_dir_name(name: str) -> tuple[int, int] | None:
    """``(step, attempt_no)`` for a checkpoint directory name, else None."""
    match = _DIR_RE.match(name)
    if match is None:
        return None
    return int(match["step"]), int(match["attempt"])


def run_dir(store: str | Path, run_id: str) -> Path:
    """``<store>/<run_id>``: the id validated, the path kept under the store, no link followed."""
    return safepath.under(Path(store).resolve(), ids.run_id(run_id))
