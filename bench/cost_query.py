"""How fast is ``tracks cost`` on a million attempts? Fills a throwaway ledger and times it.

    .venv/bin/python bench/cost_query.py                                  # SQLite in a temp dir
    .venv/bin/python bench/cost_query.py --url postgresql://postgres@127.0.0.1:5432/postgres

For PostgreSQL the URL names the server (and a database to connect to for administration); the
benchmark creates ``tracks_bench_<hex>`` there and drops it afterwards (``--keep`` keeps it).
It prints the insert time, the plan (showing whether the cost index is used), and the median of
``--repeat`` runs of ``Ledger.cost_by_reason`` (and, on PostgreSQL, of the seed SQL as written).
``--no-index`` drops the index first, to show what it buys.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import envvars
from pipeline.ledger import Ledger
from pipeline.ledger.ledger import cost_by_reason_query, normalise_url

INDEX = "ix_training_attempts_family_started"
SEED_SQL = """
select termination_reason, count(*) as attempts, sum(gpu_seconds) / 3600 as gpu_hours
from training_attempts
where model_family = '{family}' and started_at >= now() - interval '{days} days'
group by termination_reason order by gpu_hours desc;
"""

# family: (share of runs, accelerators per attempt)
FAMILIES = {
    "reasoning": (0.30, 8),
    "vision": (0.25, 8),
    "recsys": (0.20, 2),
    "speech": (0.15, 4),
    "digits-cnn": (0.10, 0),
}
# reason: (share of attempts, median wall seconds)
REASONS = {
    "succeeded": (0.42, 4 * 3600),
    "preempted": (0.25, 2 * 3600),
    "infra_transient": (0.10, 600),
    "oom": (0.07, 300),
    "user_code_error": (0.06, 120),
    "timeout": (0.04, 6 * 3600),
    "diverged": (0.03, 3600),
    "bad_input": (0.02, 0),
    "cancelled": (0.01, 900),
}
ATTEMPT_COLUMNS = (
    "run_id", "attempt_no", "model_family", "started_at", "heartbeat_at", "ended_at", "status",
    "termination_reason", "termination_detail", "config_snapshot", "config_sha256",
    "data_manifest_sha256", "container_digest", "placement", "gpu_seconds", "cpu_seconds",
    "fencing_token",
)  # fmt: skip
RUN_COLUMNS = (
    "run_id", "model_family", "owner", "purpose", "config_sha256", "snapshot_id", "created_at",
    "status", "fencing_token",
)  # fmt: skip
ATTEMPTS_PER_RUN = 5


def _sqlite_time(value: datetime) -> str:
    # SQLAlchemy's SQLite DATETIME storage format (UTC, no offset): comparisons are textual.
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")


def generate(rows: int, seed: int, now: datetime) -> tuple[list[tuple], list[tuple]]:
    """Runs and attempts with a realistic spread of families, reasons and 30 days of starts."""
    rng = np.random.default_rng(seed)
    n_runs = (rows + ATTEMPTS_PER_RUN - 1) // ATTEMPTS_PER_RUN
    names = list(FAMILIES)
    run_family = rng.choice(len(names), size=n_runs, p=[FAMILIES[f][0] for f in names])
    run_start = rng.uniform(0, 30 * 86400, size=n_runs)  # seconds before now
    reasons = list(REASONS)
    reason_idx = rng.choice(len(reasons), size=rows, p=[REASONS[r][0] for r in reasons])
    wall = rng.lognormal(mean=0.0, sigma=0.6, size=rows)
    runs, attempts = [], []
    for r in range(n_runs):
        family = names[run_family[r]]
        created = now - timedelta(seconds=float(run_start[r]))
        runs.append(
            (f"bench-{r:07d}", family, "bench", "baseline", "c" * 64, "snap", created, "failed", 0)
        )
    for i in range(rows):
        r, attempt_no = divmod(i, ATTEMPTS_PER_RUN)
        family = names[run_family[r]]
        reason = reasons[reason_idx[i]]
        seconds = REASONS[reason][1] * float(wall[i])
        started = now - timedelta(seconds=float(run_start[r])) + timedelta(hours=attempt_no)
        ended = started + timedelta(seconds=seconds)
        attempts.append(
            (
                f"bench-{r:07d}", attempt_no + 1, family, started, ended, ended,
                "succeeded" if reason == "succeeded" else "failed", reason,
                f"bench {reason}", "{}", "c" * 64, "d" * 64, "env:sha256:bench", "{}",
                seconds * FAMILIES[family][1], seconds, attempt_no + 1,
            )
        )  # fmt: skip
    return runs, attempts


def _chunks(items: list[tuple], size: int) -> Iterator[list[tuple]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def insert_postgres(engine: sa.Engine, runs: list[tuple], attempts: list[tuple]) -> None:
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        for table, columns, rows in (
            ("training_runs", RUN_COLUMNS, runs),
            ("training_attempts", ATTEMPT_COLUMNS, attempts),
        ):
            for chunk in _chunks(rows, 200_000):
                buffer = io.StringIO()
                writer = csv.writer(buffer)
                for row in chunk:
                    writer.writerow([v.isoformat() if isinstance(v, datetime) else v for v in row])
                buffer.seek(0)
                cursor.copy_expert(
                    f"COPY {table} ({', '.join(columns)}) FROM STDIN WITH (FORMAT csv)", buffer
                )
        raw.commit()
    finally:
        raw.close()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # VACUUM sets the visibility map: without it an index-only scan still visits the heap.
        conn.execute(sa.text("VACUUM ANALYZE training_runs"))
        conn.execute(sa.text("VACUUM ANALYZE training_attempts"))


def insert_sqlite(engine: sa.Engine, runs: list[tuple], attempts: list[tuple]) -> None:
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        for table, columns, rows in (
            ("training_runs", RUN_COLUMNS, runs),
            ("training_attempts", ATTEMPT_COLUMNS, attempts),
        ):
            marks = ", ".join("?" for _ in columns)
            sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
            for chunk in _chunks(rows, 100_000):
                cursor.executemany(
                    sql, [[_sqlite_time(v) if isinstance(v, datetime) else v for v in row]
                          for row in chunk]
                )  # fmt: skip
        raw.commit()
        cursor.execute("ANALYZE")
        raw.commit()
    finally:
        raw.close()


def plan(engine: sa.Engine, family: str, since: datetime) -> str:
    query = cost_by_reason_query(family, since)
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            compiled = query.compile(engine, compile_kwargs={"literal_binds": True})
            rows = conn.execute(sa.text(f"EXPLAIN (ANALYZE, BUFFERS) {compiled}")).all()
            return "\n".join(r[0] for r in rows)
        compiled = query.compile(engine)
        params = [
            _sqlite_time(v) if isinstance(v, datetime) else v
            for v in compiled.construct_params().values()
        ]
        rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", tuple(params)).all()
        return "\n".join(str(r[-1]) for r in rows)


def timed(fn, repeat: int) -> list[float]:
    fn()  # warm: caches, prepared plans, the connection pool
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def summary(label: str, ms: list[float]) -> str:
    ordered = sorted(ms)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (
        f"{label}: median {statistics.median(ms):.1f} ms, min {ordered[0]:.1f} ms, "
        f"p95 {p95:.1f} ms over {len(ms)} runs"
    )


def throwaway_postgres(server_url: str) -> tuple[str, sa.Engine, str]:
    server_url = normalise_url(server_url)
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    name = f"tracks_bench_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(server_url).set(database=name).render_as_string(hide_password=False)
    return url, admin, name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="Ledger URL; default a SQLite file in a temp dir.")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--family", default="reasoning")
    parser.add_argument("--days", type=float, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-index", action="store_true", help="Drop the cost index first.")
    parser.add_argument("--cli", action="store_true", help="Also time `tracks cost` end to end.")
    parser.add_argument("--keep", action="store_true", help="Keep the database afterwards.")
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="tracks-bench-")
    admin, dbname = None, None
    url = args.url or f"sqlite:///{Path(tmp.name) / 'ledger.db'}"
    if url.startswith("postgresql"):
        url, admin, dbname = throwaway_postgres(url)
    try:
        ledger = Ledger.open(url)
        engine = ledger.engine
        dialect = engine.dialect.name
        if args.no_index:
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP INDEX {INDEX}"))
        now = datetime.now(UTC)
        start = time.perf_counter()
        runs, attempts = generate(args.rows, args.seed, now)
        generated = time.perf_counter() - start
        start = time.perf_counter()
        (insert_postgres if dialect == "postgresql" else insert_sqlite)(engine, runs, attempts)
        inserted = time.perf_counter() - start
        del runs, attempts
        print(f"ledger: {dialect} ({'no index' if args.no_index else 'with ' + INDEX})")
        print(
            f"rows: {args.rows:,} attempts in {args.rows // ATTEMPTS_PER_RUN:,} runs; "
            f"generated in {generated:.1f}s, inserted in {inserted:.1f}s"
        )
        since = now - timedelta(days=args.days)
        answer = ledger.cost_by_reason(args.family, args.days)
        print(f"\ntracks cost --family {args.family} --days {args.days:g}:")
        for row in answer:
            print(f"  {row.termination_reason:<16} {row.attempts:>8,} {row.gpu_hours:>14,.1f}")
        print(f"\nplan:\n{plan(engine, args.family, since)}\n")
        results = {
            "Ledger.cost_by_reason": timed(
                lambda: ledger.cost_by_reason(args.family, args.days), args.repeat
            )
        }
        # `tracks attempts` with no family: newest 20 of everything, and of one reason.
        results["Ledger.list_attempts(limit=20)"] = timed(
            lambda: ledger.list_attempts(limit=20), args.repeat
        )
        results["Ledger.list_attempts(reason=oom, limit=20)"] = timed(
            lambda: ledger.list_attempts(termination_reason="oom", limit=20), args.repeat
        )
        results["Ledger.silent_attempts(300)"] = timed(
            lambda: ledger.silent_attempts(300), args.repeat
        )
        if dialect == "postgresql":
            seed = SEED_SQL.format(family=args.family, days=int(args.days))

            def run_seed() -> None:
                with engine.connect() as conn:
                    conn.execute(sa.text(seed)).all()

            results["seed SQL as written"] = timed(run_seed, args.repeat)
        if args.cli:
            env = {
                **os.environ,
                envvars.TRACKS_LEDGER_URL.name: url,
                envvars.TRACKS_HOME.name: tmp.name,
            }
            cmd = [sys.executable, "-m", "pipeline.cli", "cost", "--family", args.family]
            results["tracks cost (process, end to end)"] = timed(
                lambda: subprocess.run(
                    [*cmd, "--days", str(args.days)], env=env, check=True, capture_output=True
                ),
                max(3, args.repeat // 5),
            )
        for label, ms in results.items():
            print(summary(label, ms))
        print(
            json.dumps(
                {
                    "dialect": dialect,
                    "rows": args.rows,
                    "index": not args.no_index,
                    **{label: round(statistics.median(ms), 2) for label, ms in results.items()},
                }
            )
        )
        ledger.dispose()
    finally:
        if admin is not None:
            if args.keep:
                print(f"kept database {url}")
            else:
                with admin.connect() as conn:
                    conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
            admin.dispose()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
