"""``python -m pipeline.checkpoint.restore_check CHECKPOINT_DIR``: does this checkpoint restore?

In a brand-new process (nothing cached from the attempt that wrote it): verify the checkpoint,
rebuild the model, optimizer, LR scheduler, data cursor and RNG from its safetensors and JSON
alone, re-run the stored probe batch and compare with the outputs stored at save time. Prints one
JSON line (the verdict) on stdout; exits 0 when the checkpoint restores, 1 when it does not, with
a message on stderr naming the directory and the file at fault.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.checkpoint.errors import CheckpointError, CorruptCheckpointError
from pipeline.checkpoint.layout import TRAINER_STATE_FILE
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manager import CheckpointConfig, CheckpointManager
from pipeline.checkpoint.state import TrainingState, probe_logits
from pipeline.checkpoint.verify import CheckpointContents
from pipeline.determinism import use_deterministic_kernels
from pipeline.process_exit import exit_process

EXIT_OK = 0
EXIT_DOES_NOT_RESTORE = 1

# trainer_state.json keys that describe the checkpoint; every other key is a saved component
# (optimizer, data_cursor, rng, lr_scheduler, grad_scaler …) that must be rebuilt to restore.
_DESCRIPTIVE_KEYS = frozenset(
    {
        "format_version",
        "run_id",
        "attempt_no",
        "step",
        "config_sha256",
        "config",
        "snapshot_id",
        "data_manifest_sha256",
        "metrics",
    }
)


@dataclass(frozen=True)
class RestoreVerdict:
    """What one restore check found; ``to_json()`` is the line the command prints."""

    ok: bool
    checkpoint: str
    seconds: float
    run_id: str | None = None
    attempt_no: int | None = None
    step: int | None = None
    manifest_sha256: str | None = None
    probe_max_abs_diff: float | None = None
    probe_comparison: str | None = None
    device: str | None = None
    file: str | None = None
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def restore_check(directory: str | Path, *, device: str = "cpu") -> RestoreVerdict:
    """Verify, rebuild and probe ``directory``; raises :class:`CheckpointError` when it fails."""
    started = time.monotonic()
    # The trainer's numerics: one CPU thread (one order of float additions), so a CPU probe
    # must match bit for bit; deterministic kernels matter only on a GPU (and cost a second).
    torch.set_num_threads(1)
    if device == "cuda":
        use_deterministic_kernels()
    contents = load_checkpoint(directory)
    state = rebuild_training_state(contents, device=torch.device(device))
    manager = CheckpointManager(
        contents.info.path.parent, CheckpointConfig(), run_id=contents.info.run_id
    )
    # The resume path's own restore: load every component, check the step, re-run the probe.
    manager.restore(state, contents)
    actual = probe_logits(state.model, contents.probe["inputs"]).detach().cpu()
    diff = (actual - contents.probe["logits"]).abs().max().item() if actual.numel() else 0.0
    exact = contents.probe_device == "cpu" and device == "cpu"
    return RestoreVerdict(
        ok=True,
        checkpoint=str(contents.info.path),
        seconds=round(time.monotonic() - started, 3),
        run_id=contents.info.run_id,
        attempt_no=contents.info.attempt_no,
        step=state.step,
        manifest_sha256=contents.info.manifest_sha256,
        probe_max_abs_diff=float(diff),
        probe_comparison="exact" if exact else "allclose",
        device=device,
    )


def rebuild_training_state(contents: CheckpointContents, *, device: torch.device) -> TrainingState:
    """Fresh model, optimizer, scheduler and data cursor, shaped by the checkpoint's own config.

    Nothing is loaded into them yet: :meth:`CheckpointManager.restore` does that, as on resume.
    """
    from pipeline.trainer.config import ConfigError, TrainConfig
    from pipeline.trainer.data import EpochSampler
    from pipeline.trainer.families import family
    from pipeline.trainer.spikes import TrainingHealth
    from pipeline.trainer.train import build_optimizer

    path, saved = contents.info.path, contents.trainer_state

    def corrupt(detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(path, TRAINER_STATE_FILE, detail)

    raw_config, config_sha256 = saved.get("config"), saved.get("config_sha256")
    if not isinstance(raw_config, dict):
        raise corrupt("has no 'config' object to rebuild the model from")
    try:
        cfg = TrainConfig.from_dict(raw_config, source=f"{path / TRAINER_STATE_FILE}: config")
    except ConfigError as exc:
        raise corrupt(f"'config' does not load: {exc}") from exc
    if cfg.sha256() != config_sha256:
        raise corrupt(f"'config' does not hash to its config_sha256 {config_sha256!r}")
    cursor = saved.get("data_cursor")
    if not isinstance(cursor, dict) or not isinstance(cursor.get("num_examples"), int):
        raise corrupt("has no data_cursor with num_examples")

    model = family(cfg.model_family).build_model(cfg.to_dict()["model"]).to(device)
    optimizer, scheduler = build_optimizer(cfg, model)
    try:
        sampler = EpochSampler(cursor["num_examples"], cfg.batch_size, cfg.seed)
    except ValueError as exc:
        raise corrupt(f"data_cursor does not rebuild: {exc}") from exc
    state = TrainingState(
        model=model,
        optimizer=optimizer,
        data_cursor=sampler,
        config=raw_config,
        config_sha256=config_sha256,
        probe_inputs=contents.probe["inputs"],
        lr_scheduler=scheduler,
        data_manifest_sha256=saved.get("data_manifest_sha256"),
        snapshot_id=saved.get("snapshot_id"),
        # The spike detector's windows and history ride in the trainer state (spikes.py).
        health=TrainingHealth(cfg.spikes) if "health" in saved else None,
    )
    # A component saved but not rebuilt here would be silently skipped by restore: refuse, so
    # this check cannot pass on a checkpoint whose state the trainer restores differently.
    unrebuilt = sorted(set(saved) - _DESCRIPTIVE_KEYS - set(state.stateful()))
    if unrebuilt:
        raise corrupt(
            f"holds {', '.join(unrebuilt)}, which restore_check does not rebuild "
            "(the trainer saves state this check does not know about)"
        )
    return state


def _failure(directory: str, exc: Exception, started: float) -> RestoreVerdict:
    if isinstance(exc, CheckpointError):
        error = str(exc)  # already names the directory and the file
    else:
        error = f"checkpoint {directory} does not restore: {type(exc).__name__}: {exc}"
    return RestoreVerdict(
        ok=False,
        checkpoint=getattr(exc, "directory", directory),
        seconds=round(time.monotonic() - started, 3),
        file=getattr(exc, "file", None),
        error=error,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.checkpoint.restore_check",
        description="Restore a committed checkpoint in this new process and re-run its probe.",
    )
    parser.add_argument("checkpoint_dir", help="a committed checkpoint directory (step-…-a…)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        verdict = restore_check(args.checkpoint_dir, device=args.device)
    except Exception as exc:  # any failure is a verdict that names the checkpoint
        verdict = _failure(args.checkpoint_dir, exc, started)
    print(verdict.to_json(), flush=True)
    if not verdict.ok:
        print(f"restore_check: FAILED: {verdict.error}", file=sys.stderr)
        return EXIT_DOES_NOT_RESTORE
    return EXIT_OK


if __name__ == "__main__":
    exit_process(main())
