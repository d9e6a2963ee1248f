"""Shared fixtures: an isolated TRACKS_HOME, a real PostgreSQL database per test, digits data."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

PG_ADMIN_URL = os.environ.get(
    "TRACKS_TEST_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture
def tracks_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh TRACKS_HOME (and DAGSTER_HOME inside it) for one test."""
    home = tmp_path / "tracks"
    monkeypatch.setenv("TRACKS_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))
    for name in ("TRACKS_LEDGER_URL", "TRACKS_MLFLOW_URI", "TRACKS_ENV"):
        monkeypatch.delenv(name, raising=False)
    (home / "dagster").mkdir(parents=True)
    return home


def _admin_engine() -> sa.Engine:
    return sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")


def _drop(admin: sa.Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :name AND pid <> pg_backend_pid()"
            ),
            {"name": name},
        )
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))


@pytest.fixture
def make_pg_database() -> Iterator[Callable[[], str]]:
    """Creates brand-new PostgreSQL databases on the local server; drops them afterwards."""
    admin = _admin_engine()
    created: list[str] = []

    def _create() -> str:
        name = f"tracks_test_{secrets.token_hex(4)}"
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        except sa.exc.OperationalError as exc:  # pragma: no cover - environment problem
            pytest.fail(
                f"PostgreSQL at {PG_ADMIN_URL} is not reachable ({exc.orig}); "
                "start it with .ci/run or pg_ctlcluster"
            )
        created.append(name)
        url = sa.engine.make_url(PG_ADMIN_URL).set(database=name)
        return url.render_as_string(hide_password=False)

    yield _create
    for name in created:
        _drop(admin, name)
    admin.dispose()


@pytest.fixture
def pg_database(make_pg_database: Callable[[], str]) -> str:
    """One brand-new PostgreSQL database."""
    return make_pg_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_database")


@pytest.fixture(scope="session")
def snapshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits snapshot made once per session, its blocking checks passed and recorded as the
    data_snapshot asset leaves it (read it, never change it: tests share it). Recorded here, not
    by whichever trainer happens to run on it first: that one would pay for the checks (and
    import great-expectations) in a test that measures something else."""
    from pipeline.data.gate import ensure_checks_passed
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    root = tmp_path_factory.mktemp("digits")
    write_digits_landing(root / "landing")
    snapshot = create_snapshot(root / "landing", root / "snapshots")
    ensure_checks_passed(snapshot, snapshot_root=snapshot.path.parent)
    return snapshot.path


# Wall seconds of the longest tests, measured under load (2 cores, 3 workers, 2026-11-27 evening),
# by test function (every parametrization alike; each name is unique in tests/). Only the
# schedule reads them: a stale figure costs balance, never a result. The slow-marked tests not
# listed mostly share a module fixture that does the work once (test_asset_metadata_tables:
# 59 s in its first test, 13 s in the other ten, load 3.3): a file of them counts 60 s and 5 s
# for each more; any other test 1 s.
LONG_TESTS: dict[str, float] = {
    "test_an_incident_at_two_ranks_is_told_as_it_happened": 266,
    "test_kill_one_rank_at_random_moments_then_sigterm_all": 250,
    "test_the_ui_path_in_a_real_browser": 152,
    "test_thirty_sigterms_at_random_moments_each_end_in_one_preemption_checkpoint": 130,
    "test_sensor_resumes_a_killed_trainer_to_the_uninterrupted_result": 110,
    "test_a_sigkilled_trainer_is_continued_in_the_same_dagster_run_to_the_uninterrupted_result": 90,
    "test_ten_restarts_lose_nothing_and_every_attempt_tells_the_truth": 92,
    "test_new_landing_file_trains_and_a_drifted_one_stops_at_its_check": 70,
    "test_a_password_in_the_ledger_url_is_found_nowhere": 70,
    "test_materialize_button_runs_the_whole_graph_in_dagster_dev": 70,
    "test_scripted_scenario_leaves_a_ledger_that_explain_tells_completely": 69,
    "test_a_run_preempted_twice_has_one_value_per_step_in_one_live_mlflow_run": 67,
    "test_reshard_two_ranks_to_one_and_one_to_two": 52,
    "test_an_orchestrated_attempt_with_nothing_left_to_train_says_so_on_its_receipt": 44,
    "test_a_self_owned_trainer_with_nothing_left_to_train_records_its_attempt": 41,
    "test_whole_path_promotes_a_champion_whose_tags_lead_back": 24,
    "test_evaluator_crash_retries_the_evaluator_not_the_training": 20,
}
SLOW_FILE_S, SLOW_MORE_S, OTHER_S = 60.0, 5.0, 1.0
# Files whose listed tests are scheduled one by one, each to its own share, rather than with
# the rest of their file: their module fixtures are cheap (a snapshot made in a second), and
# their long tests are chunks of one drill meant to run side by side.
SPREAD_FILES = frozenset({"test_stop_drill.py"})


def _listed(item: pytest.Item) -> float:
    return LONG_TESTS.get(getattr(item, "originalname", item.name), 0.0)


def _file_estimate(tests: list[pytest.Item]) -> float:
    """Estimated wall seconds of one file's tests; 0 for a file of short tests only."""
    listed = [LONG_TESTS.get(getattr(t, "originalname", t.name)) for t in tests]
    slow = [
        t
        for t, known in zip(tests, listed, strict=True)
        if known is None and t.get_closest_marker("slow")
    ]
    if not slow and all(known is None for known in listed):
        return 0.0
    seconds = sum(known for known in listed if known is not None)
    if slow:
        seconds += SLOW_FILE_S + SLOW_MORE_S * (len(slow) - 1)
    return seconds + OTHER_S * (len(tests) - len(slow) - sum(k is not None for k in listed))


def _xdist_chunk_sizes(total: int, workers: int) -> list[int]:
    """The contiguous shares ``--dist worksteal`` first hands its idle workers, in order
    (xdist 3.8, WorkStealingScheduling.check_schedule: what is left over the workers left)."""
    sizes, left = [], total
    for remaining in range(workers, 0, -1):
        sizes.append(left // remaining)
        left -= sizes[-1]
    return sizes


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests first on every worker, spread so each worker's share takes as long.

    ``make test`` runs workers with ``--dist worksteal``, which hands each worker one contiguous
    share of the collection and lets an idle worker steal the tail of the longest queue. So the
    order is built share by share: files holding a long test (all of a file together, so its
    module fixtures start once) go longest first to the share with the least work so far, each
    share opening with them; the short tests fill each share to its size. Sorting the long
    tests to the front of the whole collection (as before) put every one of them in the first
    worker's share, one after another, while the others ran the short tests. The long tests of
    a file in ``SPREAD_FILES`` are placed one by one, as if each were a file.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    by_file: dict[Path | str, list[pytest.Item]] = {}
    for item in items:
        if item.path.name in SPREAD_FILES and _listed(item):
            by_file[item.nodeid] = [item]  # a group of its own
        else:
            by_file.setdefault(item.path, []).append(item)
    estimates = {path: _file_estimate(tests) for path, tests in by_file.items()}
    long_files = sorted((p for p, e in estimates.items() if e), key=lambda p: -estimates[p])
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for path in long_files:  # longest first, each to the share with the least so far
        least = load.index(min(load))
        # Its listed tests first (the stop drill's 30 SIGTERMs is its file's last test), the
        # rest in the file's own order.
        shares[least].extend(sorted(by_file[path], key=lambda t: -_listed(t)))
        load[least] += estimates[path]
    placed = {id(t) for share in shares for t in share}
    short = iter([t for t in items if id(t) not in placed])
    ordered: list[pytest.Item] = []
    for share, size in zip(shares, _xdist_chunk_sizes(len(items), workers), strict=True):
        ordered.extend(share)
        ordered.extend(t for _, t in zip(range(size - len(share)), short, strict=False))
    ordered.extend(short)
    items[:] = ordered


# Opt-in cost accounting (TRACKS_TEST_CPU=FILE): one JSON line per test (set-up, call and
# tear-down together) with its wall seconds and the CPU seconds spent by the worker and by the
# processes it started and waited for (RUSAGE_CHILDREN counts only reaped children), to tell a
# test that computes from one that waits. Off by default: a plain run pays nothing.
_CPU_LOG = os.environ.get("TRACKS_TEST_CPU")


if _CPU_LOG:
    import json
    import resource
    import time

    def _cpu_seconds() -> tuple[float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        wall, (own, children) = time.monotonic(), _cpu_seconds()
        yield
        own_after, children_after = _cpu_seconds()
        record = {
            "test": item.nodeid,
            "wall_s": round(time.monotonic() - wall, 2),
            "cpu_self_s": round(own_after - own, 2),
            "cpu_children_s": round(children_after - children, 2),
            "load1": round(os.getloadavg()[0], 2),
        }
        with open(_CPU_LOG, "a") as out:  # one line per write: workers append side by side
            out.write(json.dumps(record) + "\n")
