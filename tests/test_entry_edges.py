"""Edges at the entry points: the ledger URL a `tracks` command is given, and the landing folder.

Each case was reproduced on the code before the fix: a ledger URL SQLAlchemy cannot parse
(``postgresql:/u:pw@h/db``) was printed whole, password included, by every command; a password
holding a space, tab or newline escaped the mask; a port of ``abc`` gave ``invalid literal for
int()`` naming no variable; the production check and ``repr(TracksSettings)`` showed such a
URL whole; a symlinked ``landing/`` folder was resolved and its target snapshotted; and
``tracks snapshot-id`` and the new-snapshot sensor gave an id to half a Parquet file, or text.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner

from pipeline import redact
from pipeline.cli import main
from pipeline.data.errors import LandingFileError
from pipeline.data.landing import landing_files, write_digits_landing
from pipeline.data.snapshot import create_snapshot
from pipeline.safepath import UnsafePathError
from pipeline.settings import TracksSettings

REPO = Path(__file__).resolve().parent.parent
TRACKS = Path(sys.executable).with_name("tracks")

# -- the ledger URL ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "said"),
    [
        # One slash, or none: SQLAlchemy cannot parse it, so its own rendering cannot mask it.
        ("postgresql:/tracks:{pw}@127.0.0.1/ledger", "not a database URL"),
        ("postgresql:tracks:{pw}@127.0.0.1/ledger", "not a database URL"),
        ("postgresql:/tracks:{pw}\tand-more@127.0.0.1/ledger", "not a database URL"),
        # Ports that are not one: SQLAlchemy's int() error, or the driver's, much later.
        ("postgresql://tracks:{pw}@127.0.0.1:abc/ledger", "port is not a number"),
        ("postgresql://tracks:{pw} and/more@127.0.0.1:99999/ledger", "port 99999"),
        ("postgresql://tracks:{pw}\nmore@127.0.0.1:0/ledger", "port 0"),
    ],
)
def test_a_ledger_url_that_cannot_be_used_is_named_never_its_password(
    tmp_path: Path, template: str, said: str
) -> None:
    password = f"pw{secrets.token_hex(6)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKS_", "DAGSTER_"))}
    env.update(
        TRACKS_HOME=str(tmp_path / "home"),
        TRACKS_LEDGER_URL=template.format(pw=password),
        TRACKS_LEDGER_RETRY_SECONDS="0",
    )
    done = subprocess.run(
        [str(TRACKS), "attempts"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert password not in output, output
    assert "TRACKS_LEDGER_URL" in done.stderr and said in done.stderr, output
    assert "Traceback" not in output


def test_the_production_check_never_prints_the_password_of_a_url_it_cannot_parse(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKS_", "DAGSTER_"))}
    env.update(
        TRACKS_HOME=str(tmp_path / "home"),
        TRACKS_ENV="production",
        TRACKS_LEDGER_URL="mysql:/tracks:hunter2@db/ledger",
    )
    done = subprocess.run(
        [sys.executable, "-c", "import definitions"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and "TRACKS_LEDGER_URL" in done.stderr, done.stderr[-2000:]
    assert "hunter2" not in done.stdout + done.stderr


@pytest.mark.parametrize("gap", [" ", "\t", "\n"])
def test_a_password_holding_whitespace_is_masked_whole(gap: str) -> None:
    raw = f"postgresql://tracks:se{gap}cr/et@db:5432/ledger"
    for shown in (redact.url(raw), redact.database_url(raw)):
        assert shown == "postgresql://tracks:***@db:5432/ledger"


def test_settings_repr_masks_the_ledger_and_mlflow_passwords() -> None:
    settings = TracksSettings.from_env(
        {
            "TRACKS_LEDGER_URL": "postgresql:/tracks:hunter2@db/ledger",
            "TRACKS_MLFLOW_URI": "postgresql://mlflow:swordfish@db/mlflow",
        }
    )
    shown = repr(settings)
    assert "hunter2" not in shown and "swordfish" not in shown
    assert "ledger_url='postgresql:/***@db/ledger'" in shown
    assert "postgresql://mlflow:***@db/mlflow" in shown


# -- the landing folder --------------------------------------------------------------------------


def test_a_symlinked_landing_folder_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator's own link to TRACKS_HOME is theirs to make: followed.
    real_home, home = tmp_path / "real-home", tmp_path / "home"
    real_home.mkdir()
    home.symlink_to(real_home)
    monkeypatch.setenv("TRACKS_HOME", str(home))
    monkeypatch.delenv("TRACKS_LANDING", raising=False)
    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root)
    assert [p.name for p in landing_files(settings.landing_root)] == ["digits.parquet"]

    # A link made under TRACKS_HOME, in place of landing/, is not.
    elsewhere = tmp_path / "elsewhere"
    write_digits_landing(elsewhere)
    (real_home / "landing" / "digits.parquet").unlink()
    (real_home / "landing").rmdir()
    (real_home / "landing").symlink_to(elsewhere)
    settings = TracksSettings.from_env()
    folder = str(real_home / "landing")
    with pytest.raises(UnsafePathError, match="the landing folder is a symlink") as refused:
        landing_files(settings.landing_root)
    assert str(refused.value).startswith(folder)
    with pytest.raises(UnsafePathError, match="the landing folder is a symlink"):
        create_snapshot(settings.landing_root, settings.snapshot_root)
    for args in (["snapshot-id"], ["landing", "digits", "--file-name", "more.parquet"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, result.output
        assert f"{folder}: the landing folder is a symlink" in result.output
    assert sorted(p.name for p in elsewhere.iterdir()) == ["digits.parquet"]


def test_a_symlink_above_the_landing_folder_under_tracks_home_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, outside = tmp_path / "home", tmp_path / "outside"
    home.mkdir()
    write_digits_landing(outside / "landing")
    (home / "data").symlink_to(outside)
    monkeypatch.setenv("TRACKS_HOME", str(home))
    monkeypatch.setenv("TRACKS_LANDING", str(home / "data" / "landing"))
    result = CliRunner().invoke(main, ["snapshot-id"])
    assert result.exit_code == 1, result.output
    assert f"{home / 'data'}: a symlink on the way to the landing folder" in result.output


def _half_a_parquet_file(path: Path) -> None:
    whole = write_digits_landing(path.parent, file_name=path.name)
    data = whole.read_bytes()
    whole.write_bytes(data[: len(data) // 2])


def _text(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("sample_id,label\n0,3\n")


@pytest.mark.parametrize("spoil", [_half_a_parquet_file, _text], ids=["truncated", "text"])
def test_a_landing_file_that_is_not_parquet_is_named_by_snapshot_id_and_the_sensor(
    tmp_path: Path, spoil: object
) -> None:
    from resources import StorageResource
    from sensors.snapshots import new_snapshot

    landing = tmp_path / "landing"
    write_digits_landing(landing)
    bad = landing / "broken.parquet"
    spoil(bad)  # type: ignore[operator]
    # Settled long ago: the sensor hashes the landing files only once they stop changing.
    for path in landing.iterdir():
        os.utime(path, (1_000_000_000, 1_000_000_000))

    result = CliRunner().invoke(main, ["snapshot-id", "--landing-dir", str(landing)])
    assert result.exit_code == 1, result.output
    assert f"landing file {bad}: is not a readable Parquet file" in result.output

    storage = StorageResource(
        landing_root=str(landing),
        snapshot_root=str(tmp_path / "snapshots"),
        checkpoint_root=str(tmp_path / "checkpoints"),
        work_root=str(tmp_path / "work"),
    )
    with dg.DagsterInstance.ephemeral() as instance:
        context = dg.build_sensor_context(instance=instance, resources={"storage": storage})
        with pytest.raises(LandingFileError) as refused:
            new_snapshot(context)
    assert str(bad) in str(refused.value)
