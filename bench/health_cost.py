"""What the health detectors cost a training step: the same run with and without them.

    .venv/bin/python bench/health_cost.py [--repeats 8] [--steps 600]

Trains the demo config (``TrainConfig``'s defaults on the digits snapshot, seed 0) in a fresh
``python -m pipeline.trainer`` with the loss-spike detector and the hang watchdog on (the
defaults) and with both off (``spikes.enabled: false``, ``watchdog.enabled: false``),
alternating which goes first, and prints each run's median step time from its receipt
(``timings.steps``: the whole step, and its compute phase) and its training seconds; then the
medians and on ÷ off. Issue 29 asks for under 1.01.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.health_false_positives import clean_env  # noqa: E402
from bench.kill_drill import make_snapshot, parse_events  # noqa: E402

DETECTORS_OFF = {"spikes": {"enabled": False}, "watchdog": {"enabled": False}}


def train_once(config: Path, store: Path, run_id: str) -> tuple[float, float, float]:
    """Median step seconds, median compute seconds and training seconds of one trainer run."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
         "--run-id", run_id, "--store", str(store)],
        cwd=REPO, capture_output=True, text=True, env=clean_env(), check=False,
    )  # fmt: skip
    finished = [e for e in parse_events(done.stdout) if e.get("event") == "attempt_finished"]
    if done.returncode != 0 or not finished:
        raise SystemExit(f"{run_id}: the trainer failed:\n{done.stderr[-2000:]}")
    timings = finished[-1]["timings"]
    steps = timings["steps"]["0"]
    return steps["total"]["median"], steps["compute"]["median"], timings["training_seconds"]


def main(argv: list[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tracks-health-cost-"))
    snapshot = make_snapshot(work / "data")
    configs = {}
    for name, overrides in (("on", {}), ("off", DETECTORS_OFF)):
        configs[name] = work / f"{name}.yaml"
        base = {"snapshot_dir": str(snapshot), "seed": 0, "max_steps": args.steps}
        configs[name].write_text(yaml.safe_dump({**base, **overrides}))
    figures: dict[str, list[tuple[float, float, float]]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        for name in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
            row = train_once(configs[name], work / "store", f"{name}-{repeat}")
            figures[name].append(row)
            print(f"{name:3} step {row[0] * 1e3:.3f} ms, compute {row[1] * 1e3:.3f} ms, "
                  f"training {row[2]:.2f} s")  # fmt: skip
    medians = {
        name: [statistics.median(row[k] for row in rows) for k in range(3)]
        for name, rows in figures.items()
    }
    print()
    for name, (step, compute, training) in medians.items():
        print(f"detectors {name:3}: median step {step * 1e3:.3f} ms, "
              f"compute {compute * 1e3:.3f} ms, training {training:.2f} s")  # fmt: skip
    ratios = [medians["on"][k] / medians["off"][k] for k in range(3)]
    print("on ÷ off: step {:.3f}, compute {:.3f}, training {:.3f}".format(*ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
