"""text-lm trained by the real trainer on a device: the whole corpus, one uninterrupted run.

    python bench/textlm_device.py --device cuda                   # the demo config on a GPU
    python bench/textlm_device.py --device cuda --shape wide      # a model a GPU is for
    python bench/textlm_device.py --device cpu --max-steps 60     # the baseline, side by side

Lands the corpus (CPython's ``pydoc_data.topics``), snapshots it with its blocking checks passed
(once per ``--workdir``: later runs reuse it) and trains ``pipeline/trainer/configs/text-lm.yaml``
(``--shape wide``: 6 layers of width 384 over 256-byte contexts, batch 64) in a fresh
``python -m pipeline.trainer``, checkpoints committed and evaluated on the held-out split as in
production. Prints what the receipt measured: the start-up split, the median and p99 time of
every step and the throughput, and the loss and held-out bits per byte at each checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from bench.kill_drill import make_text_snapshot, parse_events  # noqa: E402

DEMO_CONFIG = REPO / "pipeline" / "trainer" / "configs" / "text-lm.yaml"
SHAPES: dict[str, dict[str, Any]] = {
    "demo": {},
    "wide": {
        "batch_size": 64,
        "learning_rate": 0.001,
        "model": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "dropout": 0.0},
    },
}


def text_snapshot(data: Path) -> Path:
    """The whole corpus landed and snapshotted under ``data``, checks passed; reused if there."""
    existing = sorted((data / "snapshots").glob("text-*"))
    if existing:
        return existing[0]
    return make_text_snapshot(data, train_documents=None, eval_documents=None)


def train(config: Path, store: Path, run_id: str) -> tuple[list[dict[str, Any]], float, str]:
    """One ``python -m pipeline.trainer`` run: its events, its wall seconds, its stderr tail."""
    log, err = store / f"{run_id}.log", store / f"{run_id}.err"
    shutil.rmtree(store / run_id, ignore_errors=True)  # a fresh run, not a resume of the last
    store.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.call(
            [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
             "--run-id", run_id, "--store", str(store)],
            cwd=REPO, stdout=stdout, stderr=stderr,
        )  # fmt: skip
    wall = time.monotonic() - started
    events = parse_events(log.read_text())
    tail = "" if code == 0 else "\n".join(err.read_text().splitlines()[-15:])
    return events, wall, tail


def report(events: list[dict[str, Any]], wall: float, label: str, batch: int) -> str:
    """The receipt's own figures: set-up split, per-step timing of every step, checkpoints."""
    finished = next(e for e in events if e.get("event") == "attempt_finished")
    timings = finished.get("timings", {})
    startup = timings.get("startup", {})
    lines = [
        f"## {label}",
        f"- finished: {finished['reason']} at step {finished['step']}, wall {wall:.1f} s;"
        f" trainer process {timings.get('trainer_process_seconds', 0.0):.1f} s, of which"
        f" set-up {timings.get('setup_seconds', 0.0):.1f} s and training"
        f" {timings.get('training_seconds', 0.0):.1f} s (evaluations and saves included)",
        "- start-up: " + ", ".join(f"{k} {v:.2f} s" for k, v in startup.items()),
    ]
    for rank, parts in sorted(timings.get("steps", {}).items()):
        total = parts["total"]
        lines.append(
            f"- rank {rank}, {parts['steps']} steps: step median {total['median'] * 1e3:.1f} ms"
            f" (p99 {total['p99'] * 1e3:.1f}), compute median"
            f" {parts['compute']['median'] * 1e3:.1f} ms, data"
            f" {parts['data']['median'] * 1e3:.2f} ms; {batch / total['median']:.0f} sequences/s"
        )
    for event in events:
        if event.get("event") == "checkpoint_committed":
            metrics = event.get("metrics", {})
            lines.append(
                f"- step {event['step']}: train loss {metrics.get('train_loss', float('nan')):.3f},"
                f" held-out {metrics.get('eval_bits_per_byte', float('nan')):.3f} bits per byte"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--max-steps", type=int, help="default: the demo config's")
    parser.add_argument("--workdir", type=Path, help="reuse a snapshot here (default: temp)")
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tracks-textlm-"))
    snapshot = text_snapshot(workdir / "data")
    values = {**yaml.safe_load(DEMO_CONFIG.read_text()), **SHAPES[args.shape]}
    values.update(snapshot_dir=str(snapshot), device=args.device)
    if args.max_steps:
        values.update(
            max_steps=args.max_steps,
            checkpoint_every_steps=min(values["checkpoint_every_steps"], args.max_steps),
        )
    run_id = f"{args.shape}-{args.device}-{values['max_steps']}"
    config = workdir / f"{run_id}.yaml"
    config.write_text(yaml.safe_dump(values))
    print(f"text-lm {args.shape} on {args.device}: {values['model']}, batch "
          f"{values['batch_size']}, {values['max_steps']} steps", flush=True)  # fmt: skip
    events, wall, failure = train(config, workdir / "store", run_id)
    if failure or not any(e.get("event") == "attempt_finished" for e in events):
        print(f"the trainer failed:\n{failure}")
        return 1
    label = f"{args.shape} on {args.device}"
    print(report(events, wall, label, values["batch_size"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
