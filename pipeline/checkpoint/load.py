"""Loading a checkpoint of either format: verify first, then read what verified.

Loading uses safetensors and JSON only (a sharded checkpoint's DCP files go through
:mod:`pipeline.checkpoint.sharded_read`'s restricted reader); verification runs first, so a
reader never deserializes a byte that COMMITTED and MANIFEST.json do not vouch for. This sits
above :mod:`pipeline.checkpoint.verify` and the sharded reader and below every manager.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pipeline.checkpoint.errors import CorruptCheckpointError
from pipeline.checkpoint.layout import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    SHARDED_FORMAT,
    TRAINER_STATE_FILE,
)
from pipeline.checkpoint.sharded_read import load_sharded
from pipeline.checkpoint.tensorfile import TensorFileError, parse_safetensors
from pipeline.checkpoint.verify import (
    CheckpointContents,
    LedgerCommit,
    ParsedInPlace,
    _verify_layout,
    read_verified,
    read_verified_into,
    verify_files,
)


def load_checkpoint(
    directory: str | Path,
    *,
    into: dict[str, dict[str, torch.Tensor]] | None = None,
    on_model: Callable[[dict[str, torch.Tensor]], object] | None = None,
    hash_threads: int = 1,
    ledger_commit: LedgerCommit | None = None,
) -> CheckpointContents:
    """Verify, then read every file (safetensors and JSON, never pickle).

    Each data file is read once into memory and hashed as it arrives, two files at a time,
    large ones bypassing the page cache (direct_io.py says why);
    only bytes whose digest matches MANIFEST.json are parsed, so a file changed at any moment
    is caught. The tensors returned are views into those buffers (no copy).

    ``into`` maps a tensor file's name to tensors that already exist (the live model's
    parameters, the optimizer's moments): each tensor of that file with the same name, dtype
    and shape is read straight into them, and returned as them, so no fresh memory is mapped
    and nothing is copied afterwards. Those tensors are overwritten before the digest is
    known: when this raises, they hold unverified bytes (``resume`` knows what to do then).

    ``on_model`` is called with the probe file's tensors, on the caller's thread, once
    model.safetensors has been read and verified wholly into ``into`` (the live model then
    holds the checkpoint's weights) and probe.safetensors verified, while the other files are
    still being read: ``resume`` runs the probe batch there. Not called otherwise.

    ``hash_threads`` > 1 lets one block's BLAKE3 run on that many cores: for a restore that
    nothing else runs beside (once the first file is read, the second is hashed alone).

    ``ledger_commit``: what the ledger recorded for this directory (see :class:`LedgerCommit`).
    """
    info, listed = _verify_layout(directory, ledger_commit)
    if info.format == SHARDED_FORMAT:
        return load_sharded(info, listed)
    into = into or {}
    # Two files are read and hashed side by side, largest first, so the disk always has a
    # read queued while a finished slice is hashed (a legacy SHA-256 hash runs on one core).
    wanted = sorted(
        (n for n in listed if n in (TRAINER_STATE_FILE, MODEL_FILE, OPTIMIZER_FILE, PROBE_FILE)),
        key=lambda name: -listed[name].size,
    )

    def read(name: str) -> torch.Tensor | ParsedInPlace:
        if into.get(name):
            return read_verified_into(info.path, listed[name], into[name], threads=hash_threads)
        return read_verified(info.path, listed[name], threads=hash_threads)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-read") as pool:
        futures = {name: pool.submit(read, name) for name in wanted}
        early: BaseException | None = None
        if on_model is not None and MODEL_FILE in futures and PROBE_FILE in futures:
            try:
                _model_read(futures[MODEL_FILE], futures[PROBE_FILE], on_model)
            except BaseException as exc:  # raised below, once no read writes into ``into``
                early = exc
        # Every read finishes before any error is raised: none may still write into ``into``.
        done = [(name, future.exception()) for name, future in futures.items()]
        failed = [exc for _, exc in done if exc is not None]
        if failed:
            raise failed[0]
        if early is not None:
            raise early
        buffers = {name: future.result() for name, future in futures.items()}
    verify_files(info.path, listed, [name for name in listed if name not in buffers])
    in_place = any(isinstance(b, ParsedInPlace) and b.in_place for b in buffers.values())

    def parsed(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        read = buffers[name]
        if isinstance(read, ParsedInPlace):
            return read.tensors, read.metadata
        return parse_safetensors(read)

    name = TRAINER_STATE_FILE
    try:
        state_bytes = buffers[name]
        assert isinstance(state_bytes, torch.Tensor)  # JSON: never read in place
        trainer_state = json.loads(state_bytes.numpy().tobytes())
        name = MODEL_FILE
        model, _ = parsed(name)
        name = OPTIMIZER_FILE
        training_tensors, _ = parsed(name)
        name = PROBE_FILE
        probe, probe_meta = parsed(name)
    except (TensorFileError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        # Bytes that match the manifest but do not parse: written wrong, never to be used.
        raise CorruptCheckpointError(info.path, name, f"does not load: {exc}") from exc
    if not isinstance(trainer_state, dict):
        raise CorruptCheckpointError(info.path, TRAINER_STATE_FILE, "is not a JSON object")
    return CheckpointContents(
        info=info,
        model=model,
        training_tensors=training_tensors,
        trainer_state=trainer_state,
        probe=probe,
        probe_device=probe_meta.get("device", "cpu"),
        probe_cpu_capability=probe_meta.get("cpu_capability"),
        read_in_place=in_place,
    )


def _model_read(
    model: Future[torch.Tensor | ParsedInPlace],
    probe: Future[torch.Tensor | ParsedInPlace],
    then: Callable[[dict[str, torch.Tensor]], object],
) -> None:
    if model.exception() is not None or probe.exception() is not None:
        return
    read = model.result()
    if not (isinstance(read, ParsedInPlace) and read.whole):
        return  # some weights are not in the model yet: restore puts them there first
    probe_read = probe.result()
    if isinstance(probe_read, ParsedInPlace):
        tensors = probe_read.tensors
    else:
        try:
            tensors, _ = parse_safetensors(probe_read)
        except TensorFileError:
            return  # load_checkpoint says so, after the other reads
    then(tensors)
