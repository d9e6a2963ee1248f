"""False positives of the health checks: clean runs of the demo config must raise none.

    .venv/bin/python bench/health_false_positives.py                      # seeds 0-19: documented
    .venv/bin/python bench/health_false_positives.py --seeds 3 --jobs 1   # a quick one

Trains ``--seeds`` runs of the demo config (``TrainConfig``'s defaults: 300 steps, the digits
snapshot; only the seed differs), each by the standalone trainer (``python -m pipeline.trainer``,
no ledger, no Dagster), and counts from each process's own JSON events and exit code:

- spikes: ``spike`` events (the loss-spike detector, pipeline/trainer/spikes.py, at its
  defaults), whatever their action;
- hung: an exit code of 81 or an ``attempt_finished`` whose reason is ``hung`` (the watchdog);
- failures: any other ending than ``succeeded``.

A clean run has no corrupted batch and no drill hook (``TRACKS_FAULT_*`` are removed from the
trainers' environment), so every spike and every hang counted is a false positive. Prints one
line per run and a Markdown summary (``--output`` writes it to a file too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline import envvars  # noqa: E402

HUNG_EXIT_CODE = 81


@dataclass(frozen=True)
class RunResult:
    seed: int
    exit_code: int
    reason: str | None
    spikes: list[dict[str, Any]]
    final_loss: float | None
    eval_accuracy: float | None
    seconds: float

    @property
    def hung(self) -> bool:
        return self.exit_code == HUNG_EXIT_CODE or self.reason == "hung"


def clean_env() -> dict[str, str]:
    """This environment without a drill hook (and without a ledger or MLflow to write to)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(envvars.DRILL_HOOK_PREFIX)
        and k not in {envvars.TRACKS_LEDGER_URL.name, envvars.TRACKS_MLFLOW_URI.name}
    }


def train_one(seed: int, snapshot_dir: Path, work: Path) -> RunResult:
    import yaml

    folder = work / f"seed-{seed:02d}"
    folder.mkdir(parents=True)
    config = folder / "train.yaml"
    config.write_text(yaml.safe_dump({"snapshot_dir": str(snapshot_dir), "seed": seed}))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
         "--run-id", f"clean-{seed:02d}", "--store", str(folder / "store")],
        cwd=REPO, capture_output=True, text=True, env=clean_env(), check=False,
    )  # fmt: skip
    seconds = time.monotonic() - started
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    finished = next((e for e in events if e["event"] == "attempt_finished"), {})
    steps = [e for e in events if e["event"] == "step"]
    committed = [e for e in events if e["event"] == "checkpoint_committed"]
    if done.returncode != 0 and not finished:
        print(done.stderr[-2000:], file=sys.stderr)
    return RunResult(
        seed=seed,
        exit_code=done.returncode,
        reason=finished.get("reason"),
        spikes=[e for e in events if e["event"] == "spike"],
        final_loss=steps[-1]["loss"] if steps else None,
        eval_accuracy=committed[-1]["metrics"].get("eval_accuracy") if committed else None,
        seconds=seconds,
    )


def summary(results: list[RunResult], wall: float) -> str:
    spikes = sum(len(r.spikes) for r in results)
    hung = sum(r.hung for r in results)
    failed = [r for r in results if r.reason != "succeeded" and not r.hung]
    from pipeline.trainer.config import SpikeConfig

    lines = [
        f"{len(results)} clean runs of the demo config (seeds "
        f"{min(r.seed for r in results)}-{max(r.seed for r in results)}), standalone trainer, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {wall:.0f} s wall.",
        "",
        f"- spikes: **{spikes}** (detector defaults: {SpikeConfig()})",
        f"- hung endings (exit 81 or reason hung): **{hung}**",
        f"- other failures: **{len(failed)}**",
        "",
        "| seed | ending | exit | spikes | final loss | eval accuracy | seconds |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "—"
        accuracy = f"{r.eval_accuracy:.4f}" if r.eval_accuracy is not None else "—"
        lines.append(
            f"| {r.seed} | {r.reason} | {r.exit_code} | {len(r.spikes)} | {loss} | {accuracy} | "
            f"{r.seconds:.1f} |"
        )
    for r in results:
        for e in r.spikes:
            lines.append(f"\nseed {r.seed}: spike at step {e['step']} ({e['metric']} "
                         f"{e['value']}, z {e['zscore']}, mean {e['mean']})")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 (default 20)")
    parser.add_argument("--jobs", type=int, default=2, help="trainers at once (default 2)")
    parser.add_argument("--output", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)

    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tracks-health-fp-") as tmp:
        work = Path(tmp)
        write_digits_landing(work / "landing")
        snapshot = create_snapshot(work / "landing", work / "snapshots")
        # The blocking checks' verdict file, written once before the trainers read it at once.
        from pipeline.data.gate import ensure_checks_passed

        ensure_checks_passed(snapshot, snapshot_root=snapshot.path.parent)
        results: list[RunResult] = []
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for result in pool.map(
                lambda seed: train_one(seed, snapshot.path, work), range(args.seeds)
            ):
                print(
                    f"seed {result.seed}: {result.reason} (exit {result.exit_code}), "
                    f"{len(result.spikes)} spike(s), {result.seconds:.1f} s",
                    flush=True,
                )
                results.append(result)
    text = summary(results, time.monotonic() - started)
    print(text)
    if args.output:
        args.output.write_text(text)
    bad = sum(len(r.spikes) for r in results) + sum(r.hung for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
