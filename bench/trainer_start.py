"""What a fresh trainer process costs, side by side in two checkouts of Tracks.

    .venv/bin/python bench/trainer_start.py OTHER_CHECKOUT [--repeats 6] [--nproc 2]

Trains the same two-step digits run (a checked snapshot, one checkpoint) in a fresh
``python -m pipeline.trainer`` of this checkout and of OTHER_CHECKOUT (each with its own
``.venv``), alternating which goes first, and prints for each the CPU seconds of the process
(user + system), its wall seconds until it exited, and the start-up the receipt measured (from
the process's start to the end of its first step); medians, and this checkout's ÷ the other's.
Every resume after a preemption and every rank of a distributed attempt pays this start-up.
``--nproc N``: N ranks under ``python -m pipeline.distributed.launch`` instead (the CPU of the
launcher and every rank; rank 0's start-up).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.kill_drill import make_snapshot, parse_events, write_config  # noqa: E402


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_once(
    checkout: Path, config: Path, store: Path, run_id: str, nproc: int = 1
) -> tuple[float, float, float]:
    """CPU seconds, wall seconds and the receipt's start-up total of one trainer process (or
    of a launch of ``nproc`` ranks: the launcher reaps its ranks, so their CPU is counted)."""
    launcher = ["-m", "pipeline.trainer"]
    if nproc > 1:
        launcher = ["-m", "pipeline.distributed.launch", "--nproc-per-node", str(nproc),
                    "--log-dir", str(store / "launch-logs" / run_id), "--", ]  # fmt: skip
    cpu, wall = _children_cpu(), time.monotonic()
    done = subprocess.run(
        [str(checkout / ".venv" / "bin" / "python"), *launcher,
         "--config", str(config), "--run-id", run_id, "--store", str(store)],
        cwd=checkout, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall, cpu = time.monotonic() - wall, _children_cpu() - cpu
    finished = [e for e in parse_events(done.stdout) if e.get("event") == "attempt_finished"]
    if done.returncode != 0 or not finished:
        raise SystemExit(f"{checkout}: the trainer failed:\n{done.stderr[-2000:]}")
    return cpu, wall, float(finished[-1]["timings"]["startup"]["total"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="another checkout of Tracks, with its .venv")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per launch (1: no launcher)")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tracks-trainer-start-"))
    snapshot = make_snapshot(work / "data")  # checked: no trainer here pays for the checks
    config = write_config(work, snapshot, max_steps=2, checkpoint_every_steps=2)
    checkouts = {"this": REPO, "other": args.other.resolve()}
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in checkouts}
    for repeat in range(args.repeats):
        order = list(checkouts) if repeat % 2 == 0 else list(checkouts)[::-1]
        for name in order:
            row = run_once(checkouts[name], config, work / "store", f"{name}-{repeat}", args.nproc)
            figures[name].append(row)
            print(f"{name:5} cpu {row[0]:.2f} s, wall {row[1]:.2f} s, start-up {row[2]:.2f} s")
    medians = {
        name: [statistics.median(row[k] for row in rows) for k in range(3)]
        for name, rows in figures.items()
    }
    print()
    for name, path in checkouts.items():
        cpu, wall, start = medians[name]
        print(f"{name:5} {path}: median cpu {cpu:.2f} s, wall {wall:.2f} s, start-up {start:.2f} s")
    ratios = [medians["this"][k] / medians["other"][k] for k in range(3)]
    print("this ÷ other: cpu {:.2f}, wall {:.2f}, start-up {:.2f}".format(*ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
