"""Serving the champion: every byte verified against what the ledger recorded at promotion.

``mlflow.pyfunc.load_model("models:/…@champion")`` would run whatever Python sits in the model's
artifact folder and load whatever weights sit beside it. Tracks' loader does neither: it reads
the promotion's serving manifest from the ledger (each served file's name, size and digest,
taken from the verified checkpoint when it was promoted), downloads the version's artifacts,
refuses a link, a missing file or a byte that differs, and builds the model with the installed
Tracks package from safetensors and JSON alone. No code from the artifact folder is imported.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import ids
from pipeline.digests import new_hasher, recorded_digest
from pipeline.mlflow_setup import CHAMPION_ALIAS, DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from pipeline.ledger import Ledger, PromotionRecord
    from pipeline.settings import TracksSettings

# The artifacts a served version consists of, by their MLflow artifact key.
SERVED_ARTIFACTS = {"weights": "model.safetensors", "trainer_state": "trainer_state.json"}


class ChampionVerificationError(Exception):
    """The champion's artifacts are not what the ledger recorded when it was promoted."""

    def __init__(self, model_name: str, version: str, problem: str) -> None:
        super().__init__(f"{model_name} version {version}: {problem}; refusing to serve it")
        self.model_name = model_name
        self.version = version


@dataclass(frozen=True)
class ServedModel:
    """The champion, verified and built from Tracks' own code."""

    model_name: str
    version: str
    promotion_id: str
    checkpoint_manifest_sha256: str
    model: nn.Module

    def predict(self, pixels: Any) -> np.ndarray:
        """Digit labels for rows of 64 pixels (values 0..16) or [N, 8, 8] images."""
        import numpy as np
        import torch

        from pipeline.serving.loading import PIXEL_MAX

        array = np.asarray(pixels, dtype=np.float32).reshape(-1, 64)
        images = torch.from_numpy(array / PIXEL_MAX).reshape(-1, 1, 8, 8)
        with torch.inference_mode():
            return self.model(images).argmax(dim=1).numpy().astype(np.int64)


def serving_manifest(
    checkpoint_dir: str | Path,
    checkpoint_manifest_sha256: str,
    *,
    exported_weights: Path | None = None,
) -> dict[str, Any]:
    """What promotion records for serving: each served file's size and digest (with algorithm).

    Taken from the checkpoint's verified ``MANIFEST.json``, so the bytes vouched for are the
    bytes training committed. A sharded checkpoint has no single weights file: its weights are
    served from ``exported_weights`` (:func:`export_sharded_weights`), hashed here.
    """
    import json

    from pipeline.digests import FILE_DIGEST, file_digest

    manifest = json.loads((Path(checkpoint_dir) / "MANIFEST.json").read_bytes())
    listed = {entry["name"]: entry for entry in manifest["files"]}
    files = {}
    for key, name in SERVED_ARTIFACTS.items():
        if key == "weights" and exported_weights is not None:
            files[key] = {
                "name": name,
                "bytes": exported_weights.stat().st_size,
                "algorithm": FILE_DIGEST.value,
                "digest": file_digest(exported_weights, FILE_DIGEST),
                "exported_from": manifest.get("format"),
            }
            continue
        entry = listed[name]
        algorithm, digest = recorded_digest(entry)
        files[key] = {
            "name": name,
            "bytes": int(entry["size"]),
            "algorithm": algorithm.value,
            "digest": digest,
        }
    return {"checkpoint_manifest_sha256": checkpoint_manifest_sha256, "files": files}


def export_sharded_weights(checkpoint_dir: str | Path, export_root: Path) -> Path | None:
    """One ``model.safetensors`` built from a sharded checkpoint's verified shards, or None.

    Serving loads one weights file; a checkpoint written by N ranks holds its tensors in DCP
    shards, so promotion consolidates them (after full verification) into
    ``<export_root>/<manifest sha256>/model.safetensors``, written durably.
    """
    import safetensors.torch

    from pipeline.checkpoint import load_checkpoint
    from pipeline.checkpoint.layout import SHARDED_FORMAT
    from pipeline.durable import fsync_dir, fsync_file

    contents = load_checkpoint(checkpoint_dir)
    if contents.info.format != SHARDED_FORMAT:
        return None
    target = Path(export_root) / contents.info.manifest_sha256
    target.mkdir(parents=True, exist_ok=True)
    path = target / SERVED_ARTIFACTS["weights"]
    partial = target / f".{path.name}.partial"
    tensors = {name: tensor.contiguous() for name, tensor in contents.model.items()}
    safetensors.torch.save_file(tensors, str(partial), metadata={"format": "pt"})
    fsync_file(partial)
    partial.replace(path)
    fsync_dir(target)
    return path


def load_champion(
    settings: TracksSettings, ledger: Ledger, model_name: str = DEFAULT_MODEL_NAME
) -> ServedModel:
    """The ``champion`` version of ``model_name``, verified against its promotion record."""
    from pipeline.mlflow_setup import mlflow_client
    from pipeline.promotion.promote import _champion, _promotion_for_version

    ids.model_name(model_name)
    client = mlflow_client(settings)
    version = _champion(client, model_name)
    if version is None:
        raise LookupError(f"{model_name} has no {CHAMPION_ALIAS} version to serve")
    number = str(version.version)
    record = _promotion_for_version(ledger, model_name, number)
    if record is None or not record.serving_manifest:
        raise ChampionVerificationError(
            model_name, number, "the ledger has no promotion with a serving manifest for it"
        )
    import mlflow

    with tempfile.TemporaryDirectory(prefix="tracks-champion-") as tmp:
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{model_name}/{number}",
                dst_path=tmp,
                tracking_uri=settings.mlflow_tracking_uri,
            )
        )
        paths = _verified_files(local / "artifacts", record, model_name, number)
        from pipeline.serving.loading import load_model_from_files

        model = load_model_from_files(paths["weights"], paths["trainer_state"])
    return ServedModel(
        model_name=model_name,
        version=number,
        promotion_id=record.promotion_id,
        checkpoint_manifest_sha256=record.checkpoint_manifest_sha256,
        model=model,
    )


def _verified_files(
    artifacts: Path, record: PromotionRecord, model_name: str, version: str
) -> dict[str, Path]:
    expected = record.serving_manifest["files"]
    if not artifacts.is_dir() or artifacts.is_symlink():
        raise ChampionVerificationError(model_name, version, f"{artifacts} is not a folder")
    present = {entry.name: entry for entry in os.scandir(artifacts)}
    wanted = {spec["name"] for spec in expected.values()}
    extra = sorted(set(present) - wanted)
    if extra:
        raise ChampionVerificationError(
            model_name, version, f"unexpected file(s) in its artifacts: {', '.join(extra)}"
        )
    paths = {}
    for key, spec in expected.items():
        name = spec["name"]
        path = artifacts / name
        if name not in present:
            raise ChampionVerificationError(model_name, version, f"{name} is missing")
        try:
            algorithm, recorded = recorded_digest(spec)  # records before BLAKE3 name sha256
        except ValueError as exc:
            raise ChampionVerificationError(model_name, version, f"{name}: {exc}") from exc
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a link is refused, not followed
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ChampionVerificationError(model_name, version, f"{name} is not a file")
            digest, size = new_hasher(algorithm), 0
            while chunk := os.read(fd, 4 * 1024 * 1024):
                digest.update(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        if size != spec["bytes"] or digest.hexdigest() != recorded:
            raise ChampionVerificationError(
                model_name,
                version,
                f"{name} has {algorithm} {digest.hexdigest()} ({size} bytes), but promotion "
                f"recorded {recorded} ({spec['bytes']} bytes)",
            )
        paths[key] = path
    return paths
