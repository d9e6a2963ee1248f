"""Where a command's CPU goes, every process included: ``make test`` on a 2-vCPU machine.

    .venv/bin/python bench/suite_cpu.py [--json out.json] [--interval 0.5] -- make test

``time`` and pytest's own figures count only the processes someone waits for: the CPU of
``dagster dev``'s daemon, webserver, code servers and run workers (which their parents reap
after the test that started them has gone, or never) is missing from both. This runs the
command and, until it ends, reads every process's own CPU (``utime + stime`` in
``/proc/PID/stat``) every ``--interval`` seconds, keeping the last figure of each process (a
pid and its start time) with its command line and parent. A process that lives less than one
interval is missed; the report says how much of the machine's busy time (``/proc/stat``) the
processes seen account for.

The report: the machine's busy share over the run; CPU by kind of process (trainer ranks,
launchers, Dagster's processes, the pytest workers, PostgreSQL, chromium, ...); and each
``dagster dev`` tree's CPU, named by the test home its daemon serves. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
# The kind of a process, by its command line: the first pattern that matches names it.
KINDS: tuple[tuple[str, str], ...] = (
    ("trainer rank", r"-m pipeline\.trainer\b"),
    ("trainer launcher", r"-m pipeline\.distributed\.launch\b|torchrun"),
    ("dagster run worker", r"multiprocessing\.spawn import spawn_main"),
    ("dagster code server", r"-m dagster (api grpc|code-server)"),
    ("dagster daemon", r"-m dagster\._daemon|dagster-daemon"),
    ("dagster webserver", r"dagster_webserver|dagster-webserver"),
    ("dagster dev", r"-m dagster dev\b"),
    ("checkpoint restore check", r"pipeline\.checkpoint\.restore_check"),
    ("pytest worker", r"exec\(eval\(sys\.stdin\.readline"),  # execnet's bootstrap (xdist)
    ("pytest", r"bin/pytest\b"),
    ("tracks cli", r"bin/tracks\b"),
    ("mlflow server", r"mlflow"),
    ("postgres", r"^postgres"),
    ("chromium", r"chrom"),
    ("install", r"compileall|pip install|apt-get|dpkg"),
)


@dataclass
class Process:
    """One process as last seen: its own CPU seconds during the run, never its children's."""

    pid: int
    ppid: int
    command: str
    cpu_s: float
    first_seen_s: float
    last_seen_s: float
    # Its CPU before the run, for a process already running when it started (PostgreSQL's).
    before_s: float = 0.0

    @cached_property
    def kind(self) -> str:
        """What it is, by its command line (:data:`KINDS`): worked out once, read by each table."""
        return kind_of(self.command)


def kind_of(command: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, command):
            return kind
    return "other"


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks of all CPUs since boot (``/proc/stat``; iowait is idle)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields[:8]) - idle, idle


def sample(seen: dict[str, Process], since: float, *, before_run: bool = False) -> None:
    """Every process's CPU now; ``before_run``: the processes already there (counted from now)."""
    now = time.monotonic() - since
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                text = stat.read()
            # The command name may hold spaces and parentheses: the fields follow the last ")".
            fields = text[text.rindex(")") + 2 :].split()
            key = f"{name}:{fields[19]}"  # pid and start time: a reused pid is another process
            cpu = (int(fields[11]) + int(fields[12])) / TICK
            process = seen.get(key)
            if process is None:
                with open(f"/proc/{name}/cmdline", "rb") as raw:
                    command = raw.read().replace(b"\0", b" ").decode(errors="replace").strip()
                before = cpu if before_run else 0.0
                process = seen[key] = Process(
                    int(name), int(fields[1]), command[:4000], 0.0, now, now, before
                )
            process.cpu_s, process.last_seen_s = cpu - process.before_s, now
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue  # it ended between the listing and the read


def dagster_trees(processes: list[Process]) -> list[dict[str, Any]]:
    """Each ``dagster dev`` with every process below it, named by the home its daemon serves."""
    children: dict[int, list[Process]] = defaultdict(list)
    for process in processes:
        children[process.ppid].append(process)

    def below(root: Process) -> list[Process]:
        out, todo = [], [root]
        while todo:
            node = todo.pop()
            out.append(node)
            # A reused pid's children came after it: only those seen after the node started.
            todo.extend(c for c in children[node.pid] if c.first_seen_s >= node.first_seen_s - 1)
        return out

    trees = []
    for root in processes:
        if root.kind != "dagster dev":
            continue
        tree = below(root)
        # The daemon's --instance-ref names the instance's storage: DAGSTER_HOME/storage.
        home = next(
            (m.group(1) for p in tree if (m := re.search(r"base_dir: (/[^\s\\\",}]+)", p.command))),
            "?",
        )
        home = re.sub(r"(/dagster)?/storage$", "", home)
        kinds = Counter()
        for process in tree:
            kinds[process.kind] += process.cpu_s
        trees.append(
            {
                "home": home,
                "cpu_s": round(sum(p.cpu_s for p in tree), 1),
                "processes": len(tree),
                "lived_s": round(root.last_seen_s - root.first_seen_s),
                "by_kind": {k: round(v, 1) for k, v in kinds.most_common()},
            }
        )
    return sorted(trees, key=lambda t: -t["cpu_s"])


def report(processes: list[Process], busy_s: float, idle_s: float, wall_s: float) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for process in processes:
        by_kind[process.kind].append(process.cpu_s)
    seen_s = sum(p.cpu_s for p in processes)
    return {
        "wall_s": round(wall_s, 1),
        "machine_busy_s": round(busy_s, 1),
        "machine_idle_s": round(idle_s, 1),
        "processes_seen_cpu_s": round(seen_s, 1),
        "kinds": {
            kind: {
                "cpu_s": round(sum(cpus), 1),
                "processes": len(cpus),
                "median_s": round(statistics.median(cpus), 2),
            }
            for kind, cpus in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))
        },
        "dagster_dev_trees": dagster_trees(processes),
    }


def print_report(out: dict[str, Any]) -> None:
    busy, idle = out["machine_busy_s"], out["machine_idle_s"]
    print(
        f"wall {out['wall_s']:.0f} s; the machine busy {busy:.0f} CPU-s, idle {idle:.0f} "
        f"({busy / (busy + idle):.0%} busy); processes seen {out['processes_seen_cpu_s']:.0f} "
        f"CPU-s ({out['processes_seen_cpu_s'] / busy:.0%} of busy)"
    )
    print(f"{'kind':<26} {'CPU-s':>8} {'share':>6} {'procs':>6} {'median':>7}")
    for kind, row in out["kinds"].items():
        share = row["cpu_s"] / out["processes_seen_cpu_s"]
        print(
            f"{kind:<26} {row['cpu_s']:>8.0f} {share:>6.1%} {row['processes']:>6} "
            f"{row['median_s']:>7.2f}"
        )
    trees = out["dagster_dev_trees"]
    if trees:
        print(f"dagster dev trees: {len(trees)}, {sum(t['cpu_s'] for t in trees):.0f} CPU-s")
        for tree in trees:
            print(f"  {tree['cpu_s']:>6.0f} CPU-s, {tree['lived_s']:>4} s: {tree['home']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--json", type=Path, help="also write the report (and every process)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the command to run after --")
    seen: dict[str, Process] = {}
    started, (busy0, idle0) = time.monotonic(), machine_ticks()
    sample(seen, started, before_run=True)
    child = subprocess.Popen(command)
    while child.poll() is None:
        sample(seen, started)
        time.sleep(args.interval)
    busy1, idle1 = machine_ticks()
    processes = [p for p in seen.values() if p.pid != os.getpid()]
    out = report(
        processes,
        (busy1 - busy0) / TICK,
        (idle1 - idle0) / TICK,
        time.monotonic() - started,
    )
    out["command"], out["returncode"] = command, child.returncode
    print_report(out)
    if args.json:
        out["processes"] = [asdict(p) for p in processes]
        args.json.write_text(json.dumps(out, indent=1))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
