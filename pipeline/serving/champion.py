"""Serving the champion: every byte verified against what the ledger recorded at promotion.

``mlflow.pyfunc.load_model("models:/…@champion")`` would run whatever Python sits in the model's
artifact folder and load whatever weights sit beside it. Tracks' loader does neither: it reads
the promotion's serving manifest from the ledger (each served file's name, size and digest,
taken from the verified checkpoint when it was promoted), downloads the version's artifacts,
refuses a link, a missing file or a byte that differs, and builds the model with the installed
Tracks package from safetensors and JSON alone. No code from the artifact folder is imported.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import ids, safepath
from pipeline.digests import DigestAlgorithm, new_hasher, recorded_digest
from pipeline.mlflow_setup import CHAMPION_ALIAS, DEFAULT_MODEL_NAME
from pipeline.serving.registry import promotion_for_version, registered_champion

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from pipeline.ledger import Ledger, PromotionRecord
    from pipeline.settings import TracksSettings

# The artifacts a served version consists of, by their MLflow artifact key.
SERVED_ARTIFACTS = {"weights": "model.safetensors", "trainer_state": "trainer_state.json"}
MANIFEST_NAME = "MANIFEST.json"


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
    # The model family the verified trainer state names (the same field the checkpoint
    # loader reads), not a guess from the model's class.
    family: str

    def continue_text(self, prompts: list[str], *, max_new_tokens: int = 64) -> list[str]:
        """text-lm: the greedy continuation of each prompt."""
        if self.family != "text-lm":
            raise TypeError(f"{self.model_name} serves a {self.family} model, not text")
        return continue_prompts(self.model, prompts, max_new_tokens=max_new_tokens)

    def predict(self, pixels: Any) -> np.ndarray:
        """Digit labels for rows of 64 pixels (values 0..16) or [N, 8, 8] images."""
        import numpy as np
        import torch

        from pipeline.serving.loading import PIXEL_MAX

        if self.family != "digits-cnn":
            raise TypeError(
                f"{self.model_name} serves a {self.family} model: continue_text(prompts), "
                "not pixels"
            )

        array = np.asarray(pixels, dtype=np.float32).reshape(-1, 64)
        images = torch.from_numpy(array / PIXEL_MAX).reshape(-1, 1, 8, 8)
        with torch.inference_mode():
            return self.model(images).argmax(dim=1).numpy().astype(np.int64)


def continue_prompts(model: Any, prompts: list[str], *, max_new_tokens: int = 64) -> list[str]:
    """The greedy continuation of each prompt by a TextLM (as the generation evaluator decodes,
    on its thread count: the same prompt gives the same bytes)."""
    from pipeline.textlm.generation import DecodingParams, evaluation_threads, generate
    from pipeline.textlm.tokenizer import TOKENIZER

    params = DecodingParams(max_new_tokens=max_new_tokens)
    with evaluation_threads():
        return [generate(model, TOKENIZER.encode(p), params).text for p in prompts]


class ServedFilesChangedError(Exception):
    """A checkpoint's files changed between verification and the private copy promotion logs."""

    def __init__(self, checkpoint_dir: str | Path, problem: str) -> None:
        super().__init__(
            f"checkpoint {checkpoint_dir}: {problem}; refusing to promote bytes nobody verified"
        )
        self.checkpoint_dir = str(checkpoint_dir)


@dataclass(frozen=True)
class StagedServedFiles:
    """Private, verified copies of what a promotion logs and vouches for (see ``stage_…``)."""

    folder: Path
    manifest_sha256: str
    weights: Path
    trainer_state: Path
    exported: bool  # weights consolidated from a sharded checkpoint's verified shards

    @property
    def manifest(self) -> Path:
        return self.folder / MANIFEST_NAME


def stage_served_files(
    checkpoint_dir: str | Path, checkpoint_manifest_sha256: str, staging: Path
) -> StagedServedFiles:
    """Copy the served files of a checkpoint into ``staging``, verified, before anything logs them.

    ``staging`` must be a private folder of this process (``tempfile.mkdtemp``). The store
    stays writable by others while MLflow uploads, so nothing is ever read from it twice: its
    ``MANIFEST.json`` must hash to ``checkpoint_manifest_sha256`` (the ledger's), and each file
    is hashed while it is copied and must match that manifest. Links are never followed.
    Raises :class:`ServedFilesChangedError` on any difference.
    """
    import json

    from pipeline.checkpoint.layout import SHARDED_FORMAT
    from pipeline.digests import sha256_bytes

    source = Path(checkpoint_dir)
    manifest_raw = _read_nofollow(source / MANIFEST_NAME, source)
    actual = sha256_bytes(manifest_raw)
    if actual != checkpoint_manifest_sha256:
        raise ServedFilesChangedError(
            source,
            f"{MANIFEST_NAME} now has sha256 {actual}, the ledger committed "
            f"{checkpoint_manifest_sha256}",
        )
    _write_new(staging / MANIFEST_NAME, manifest_raw)
    manifest = json.loads(manifest_raw)
    listed = {entry["name"]: entry for entry in manifest["files"]}
    trainer_state = _copy_verified(source, SERVED_ARTIFACTS["trainer_state"], listed, staging)
    weights = staging / SERVED_ARTIFACTS["weights"]
    exported = manifest.get("format") == SHARDED_FORMAT
    if exported:
        # load_checkpoint parses only bytes it hashed itself; the manifest it hashed must be
        # the committed one too, or a manifest swapped in meanwhile would vouch for shards.
        _export_sharded(source, checkpoint_manifest_sha256, weights)
    else:
        _copy_verified(source, SERVED_ARTIFACTS["weights"], listed, staging)
    return StagedServedFiles(
        folder=staging,
        manifest_sha256=checkpoint_manifest_sha256,
        weights=weights,
        trainer_state=trainer_state,
        exported=exported,
    )


def serving_manifest(staged: StagedServedFiles) -> dict[str, Any]:
    """What promotion records for serving: each served file's size and digest (with algorithm).

    Computed from the private verified copies only (:func:`stage_served_files`), so the bytes
    vouched for are the bytes training committed. A sharded checkpoint has no single weights
    file: its consolidated export is hashed here.
    """
    import json

    from pipeline.digests import FILE_DIGEST, file_digest, sha256_bytes

    manifest_raw = staged.manifest.read_bytes()
    if sha256_bytes(manifest_raw) != staged.manifest_sha256:
        raise ServedFilesChangedError(
            staged.folder, f"the staged {MANIFEST_NAME} is not the committed manifest"
        )
    manifest = json.loads(manifest_raw)
    listed = {entry["name"]: entry for entry in manifest["files"]}
    files = {}
    for key, name in SERVED_ARTIFACTS.items():
        if key == "weights" and staged.exported:
            files[key] = {
                "name": name,
                "bytes": staged.weights.stat().st_size,
                "algorithm": FILE_DIGEST.value,
                "digest": file_digest(staged.weights, FILE_DIGEST),
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
    return {"checkpoint_manifest_sha256": staged.manifest_sha256, "files": files}


def committed_weights_digest(
    checkpoint_dir: str | Path, checkpoint_manifest_sha256: str
) -> dict[str, str] | None:
    """The model tensors file's digest as the committed manifest records it, or None.

    ``{"name", "algorithm", "digest"}`` of ``model.safetensors``, read from the checkpoint's
    ``MANIFEST.json`` only after that file hashes to ``checkpoint_manifest_sha256`` (the
    ledger's); a link is never followed. None for a sharded checkpoint, whose weights are spread
    over shards (only the export promotion stages has one digest). Raises
    :class:`ServedFilesChangedError` when the manifest is not the committed one.
    """
    import json

    from pipeline.checkpoint.layout import SHARDED_FORMAT
    from pipeline.digests import sha256_bytes

    source = Path(checkpoint_dir)
    raw = _read_nofollow(source / MANIFEST_NAME, source)
    if (actual := sha256_bytes(raw)) != checkpoint_manifest_sha256:
        raise ServedFilesChangedError(
            source,
            f"{MANIFEST_NAME} now has sha256 {actual}, the ledger committed "
            f"{checkpoint_manifest_sha256}",
        )
    manifest = json.loads(raw)
    if manifest.get("format") == SHARDED_FORMAT:
        return None
    name = SERVED_ARTIFACTS["weights"]
    entry = next((e for e in manifest["files"] if e.get("name") == name), None)
    if entry is None:
        raise ServedFilesChangedError(source, f"{name} is not listed in {MANIFEST_NAME}")
    try:
        algorithm, digest = recorded_digest(entry)
    except ValueError as exc:
        raise ServedFilesChangedError(source, f"{name}: {exc}") from exc
    return {"name": name, "algorithm": algorithm.value, "digest": digest}


def _export_sharded(source: Path, checkpoint_manifest_sha256: str, target: Path) -> None:
    import safetensors.torch

    from pipeline.checkpoint import load_checkpoint

    contents = load_checkpoint(source)
    if contents.info.manifest_sha256 != checkpoint_manifest_sha256:
        raise ServedFilesChangedError(
            source,
            f"its shards were read under manifest {contents.info.manifest_sha256}, the ledger "
            f"committed {checkpoint_manifest_sha256}",
        )
    tensors = {name: tensor.contiguous() for name, tensor in contents.model.items()}
    safetensors.torch.save_file(tensors, str(target), metadata={"format": "pt"})


def _open_served(path: Path, checkpoint_dir: Path) -> int:
    """An fd for reading ``path``, a regular file reached without a link, or the refusal."""
    try:
        return safepath.open_regular_nofollow(path)
    except safepath.UnsafePathError:
        raise ServedFilesChangedError(checkpoint_dir, f"{path.name} is not a file") from None
    except OSError as exc:
        raise ServedFilesChangedError(
            checkpoint_dir, f"{path.name} cannot be opened ({exc.strerror})"
        ) from exc


def _read_nofollow(path: Path, checkpoint_dir: Path) -> bytes:
    with os.fdopen(_open_served(path, checkpoint_dir), "rb") as handle:
        return handle.read()


def _write_new(path: Path, data: bytes) -> None:
    # O_EXCL|O_NOFOLLOW: the private folder holds only what this process wrote into it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _copy_verified(
    source: Path, name: str, listed: dict[str, dict[str, Any]], staging: Path
) -> Path:
    if name not in listed:
        raise ServedFilesChangedError(source, f"{name} is not listed in {MANIFEST_NAME}")
    try:
        algorithm, recorded = recorded_digest(listed[name])
    except ValueError as exc:
        raise ServedFilesChangedError(source, f"{name}: {exc}") from exc
    target = staging / name
    src = _open_served(source / name, source)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # Hash exactly the bytes written to the copy: one read, so no window between them.
            actual, size = _read_hashed(src, algorithm, copy_to=dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    expected_size = int(listed[name]["size"])
    if size != expected_size or actual != recorded:
        raise ServedFilesChangedError(
            source,
            f"{name} now has {algorithm} {actual} ({size} bytes), the committed "
            f"manifest records {recorded} ({expected_size} bytes)",
        )
    return target


def _read_hashed(
    fd: int, algorithm: DigestAlgorithm, *, copy_to: int | None = None
) -> tuple[str, int]:
    """Read ``fd`` to its end: its digest and size, each chunk also written to ``copy_to``."""
    digest, size = new_hasher(algorithm), 0
    while chunk := os.read(fd, 4 * 1024 * 1024):
        digest.update(chunk)
        size += len(chunk)
        view = memoryview(chunk)
        while copy_to is not None and view:
            view = view[os.write(copy_to, view) :]
    return digest.hexdigest(), size


def load_champion(
    settings: TracksSettings, ledger: Ledger, model_name: str = DEFAULT_MODEL_NAME
) -> ServedModel:
    """The ``champion`` version of ``model_name``, verified against its promotion record."""
    from pipeline.mlflow_setup import mlflow_client

    ids.model_name(model_name)
    client = mlflow_client(settings)
    version = registered_champion(client, model_name)
    if version is None:
        raise LookupError(f"{model_name} has no {CHAMPION_ALIAS} version to serve")
    number = str(version.version)
    record = promotion_for_version(ledger, model_name, number)
    if record is None or not record.serving_manifest:
        raise ChampionVerificationError(
            model_name, number, "the ledger has no promotion with a serving manifest for it"
        )
    import mlflow

    with tempfile.TemporaryDirectory(prefix="tracks-champion-") as tmp:
        # What the registry serves for the version (the logged model of its source): every
        # byte of it is checked below, and an extra file is refused.
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{model_name}/{number}",
                dst_path=tmp,
                tracking_uri=settings.mlflow_tracking_uri,
            )
        )
        paths = _verified_files(local / "artifacts", record, model_name, number)
        from safetensors.torch import load_file

        from pipeline.serving.loading import checkpoint_family, model_from_state

        # The verified trainer state, read once: the model is built from it and it names the
        # family (load_model_from_files would read it again).
        state = json.loads(Path(paths["trainer_state"]).read_text())
        where = Path(paths["trainer_state"]).parent
        model = model_from_state(state, load_file(str(paths["weights"])), where)
        family = checkpoint_family(state, paths["trainer_state"])
    return ServedModel(
        model_name=model_name,
        version=number,
        promotion_id=record.promotion_id,
        checkpoint_manifest_sha256=record.checkpoint_manifest_sha256,
        model=model,
        family=family,
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
        try:
            fd = safepath.open_regular_nofollow(path)  # a link is refused, not followed
        except safepath.UnsafePathError:
            raise ChampionVerificationError(model_name, version, f"{name} is not a file") from None
        try:
            actual, size = _read_hashed(fd, algorithm)
        finally:
            os.close(fd)
        if size != spec["bytes"] or actual != recorded:
            raise ChampionVerificationError(
                model_name,
                version,
                f"{name} has {algorithm} {actual} ({size} bytes), but promotion "
                f"recorded {recorded} ({spec['bytes']} bytes)",
            )
        paths[key] = path
    return paths
