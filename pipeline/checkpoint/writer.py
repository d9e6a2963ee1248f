"""Hash and write a staged checkpoint, then commit it: files, MANIFEST.json, COMMITTED last."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from safetensors.torch import save as safetensors_bytes

from pipeline.checkpoint.layout import (
    COMMITTED_FILE,
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    TRAINER_STATE_FILE,
    fsync_dir,
    replace_atomically,
    write_file_durably,
)
from pipeline.checkpoint.state import StagedCheckpoint
from pipeline.digests import sha256_bytes


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


def serialize_staged(staged: StagedCheckpoint) -> dict[str, bytes]:
    """The bytes of every data file, by name. Deterministic: equal state gives equal bytes."""
    trainer_state = json.dumps(staged.trainer_state, sort_keys=True, indent=1).encode()
    return {
        MODEL_FILE: safetensors_bytes(staged.model, metadata={"format": "pt"}),
        OPTIMIZER_FILE: safetensors_bytes(staged.training_tensors, metadata={"format": "pt"}),
        TRAINER_STATE_FILE: trainer_state,
        PROBE_FILE: safetensors_bytes(
            staged.probe, metadata={"format": "pt", "device": staged.probe_device}
        ),
    }


def write_checkpoint_files(
    staged: StagedCheckpoint, directory: Path, *, run_id: str, attempt_no: int
) -> WrittenCheckpoint:
    """Write and fsync every file, then MANIFEST.json (name, size, sha256 of each file)."""
    directory.mkdir(parents=True, exist_ok=False)
    files: list[dict[str, Any]] = []
    for name, data in serialize_staged(staged).items():
        write_file_durably(directory / name, data)
        files.append({"name": name, "size": len(data), "sha256": sha256_bytes(data)})
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
    write_file_durably(directory / MANIFEST_FILE, manifest_bytes)
    fsync_dir(directory)
    fsync_dir(directory.parent)
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
    replace_atomically(written.path / COMMITTED_FILE, json.dumps(payload, sort_keys=True).encode())
    return payload
