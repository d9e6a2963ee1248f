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
    """A digits snapshot made once per session (read it, never change it: tests share it)."""
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    root = tmp_path_factory.mktemp("digits")
    write_digits_landing(root / "landing")
    return create_snapshot(root / "landing", root / "snapshots").path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests (real dagster, torchrun, drills) first, in their files' order.

    ``make test`` runs two workers with ``--dist worksteal``: started early, the long tests run
    beside each other and the short ones fill the gaps, instead of one long test finishing last
    on one worker while the other sits idle.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
