"""A password-bearing ledger URL used end to end, then looked for everywhere: found nowhere.

The URL travels by environment only. While the whole graph runs (snapshot → training through
the launcher, a real subprocess → evaluation → promotion → serving), every process's argv is
sampled; afterwards every output, every file under the Tracks and Dagster homes (event logs,
SQLite stores, MLflow's store and artifacts, last words, checkpoints) and every text column of
every ledger table are searched for the password.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from pipeline.ledger import Ledger

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SCRIPT = """
import dagster as dg
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from definitions import build_definitions
from pipeline.serving.champion import load_champion
from pipeline.ledger import Ledger
from pipeline.settings import TracksSettings
from sensors import materialize_snapshot

settings = TracksSettings.from_env()
settings.ensure_dirs()
write_digits_landing(settings.landing_root)
snapshot = snapshot_id_for(settings.landing_root)
run_config = {"ops": {"training_attempt": {"config": {"train": {"max_steps": 300}}}}}
with dg.DagsterInstance.get() as instance:
    result = materialize_snapshot(build_definitions(settings), instance, snapshot,
                                  run_config=run_config)
print("success", result.success)
served = load_champion(settings, Ledger.open(settings.ledger_url))
print("served version", served.version)
"""


def _argv_sampler(stop: threading.Event, seen: list[str]) -> None:
    """What `ps` shows: every process's command line, read from /proc five times a second."""
    while not stop.is_set():
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                seen.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue  # the process ended between the listing and the read
        time.sleep(0.2)


def test_a_password_in_the_ledger_url_is_found_nowhere(tmp_path: Path, make_pg_database) -> None:
    password = f"secret-{secrets.token_hex(8)}"
    user = f"tracks_{secrets.token_hex(4)}"
    admin_url = make_pg_database()
    database = sa.engine.make_url(admin_url).database
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {user} LOGIN PASSWORD '{password}'"))
        conn.execute(sa.text(f'ALTER DATABASE "{database}" OWNER TO {user}'))
        conn.execute(sa.text(f"GRANT ALL ON SCHEMA public TO {user}"))
    url = f"postgresql+psycopg2://{user}:{password}@127.0.0.1:5432/{database}"
    home = tmp_path / "tracks"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKS_", "DAGSTER_"))}
    env.update(TRACKS_HOME=str(home), DAGSTER_HOME=str(home / "dagster"), TRACKS_LEDGER_URL=url)
    (home / "dagster").mkdir(parents=True)

    stop, argv = threading.Event(), []
    sampler = threading.Thread(target=_argv_sampler, args=(stop, argv), daemon=True)
    sampler.start()
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        upgrade = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "ledger-upgrade"], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        production = subprocess.run(
            [sys.executable, "-c", "import definitions"], cwd=REPO,
            env={**env, "TRACKS_ENV": "production", "TRACKS_MLFLOW_URI": url.replace(
                "postgresql+psycopg2", "mysql")},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert "success True" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "served version 1" in done.stdout
    assert upgrade.returncode == 0 and "***" in upgrade.stdout, upgrade.stdout + upgrade.stderr
    assert production.returncode != 0 and "production" in production.stderr

    trainers = [a for a in argv if "pipeline.trainer" in a]
    assert trainers, "the trainer process was never seen: the argv sample proves nothing"
    for name, text in (
        ("argv", "\n".join(argv)),
        ("stdout", done.stdout), ("stderr", done.stderr),
        ("ledger-upgrade", upgrade.stdout + upgrade.stderr),
        ("production error", production.stdout + production.stderr),
    ):  # fmt: skip
        assert password not in text, f"the password appears in {name}"

    found = [
        str(path)
        for path in home.rglob("*")
        if path.is_file() and password.encode() in path.read_bytes()
    ]
    assert found == [], f"the password is stored in {found}"

    ledger = Ledger.open(url)
    with ledger.engine.connect() as conn:
        for table in ("training_runs", "training_attempts", "checkpoints", "evaluations",
                      "promotions", "snapshots", "snapshot_checks"):  # fmt: skip
            for row in conn.execute(sa.text(f"SELECT * FROM {table}")):
                assert password not in str(tuple(row)), f"the password is in ledger table {table}"
    ledger.dispose()
    admin.dispose()
