"""The logbook: ``tracks note RUN[#N] "text"`` and a launch's ``note`` add dated, attributed
notes to a run or an attempt; ``tracks explain`` shows them among the run's events; nothing
edits or deletes one.

Reproduced before the change: ``tracks note`` was "No such command", the ledger had no
``notes`` table, and ``training_attempt``'s run config refused a ``note`` key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from assets.training_config import TrainingRunConfig, train_config_for_attempt
from pipeline.data.gate import BLOCKING_CHECKS, CheckVerdict, record_verdict
from pipeline.explain import explain
from pipeline.ledger import (
    AttemptStart,
    InvalidNoteError,
    Ledger,
    UnknownAttemptError,
    UnknownRunError,
    schema,
)
from pipeline.ledger.ledger import _MIGRATIONS
from pipeline.settings import TracksSettings
from pipeline.states import TerminationReason
from pipeline.trainer.config import ConfigError
from tests.receipt_support import SMALL, make_snapshot, train_alone

REPO = Path(__file__).resolve().parent.parent
TRACKS = Path(sys.executable).with_name("tracks")
RUN = "digits-cnn-note-20261128T0900-ab12"


def _seed(ledger: Ledger) -> None:
    """A run whose attempt 1 was preempted and whose attempt 2 is running."""
    ledger.create_run(
        run_id=RUN, model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="a" * 64, snapshot_id="digits-0123456789abcdef",
    )  # fmt: skip
    start = AttemptStart(
        config_snapshot={"learning_rate": 0.003}, config_sha256="a" * 64,
        data_manifest_sha256="b" * 64, container_digest="env:sha256:test",
        launched_by={"via": "ui"},
    )  # fmt: skip
    ledger.begin_attempt(RUN, start)
    ledger.end_attempt(
        RUN, 1, termination_reason=TerminationReason.PREEMPTED, termination_detail="SIGTERM"
    )
    ledger.begin_attempt(RUN, start)


def _tracks(home: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKS_", "DAGSTER_"))}
    env.update(TRACKS_HOME=str(home), TRACKS_LEDGER_URL=url, USER="bo")
    return subprocess.run(
        [str(TRACKS), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def _refused(done: subprocess.CompletedProcess[str], said: str) -> None:
    """Exit 1, one line on stderr naming the problem, no traceback, nothing on stdout."""
    assert done.returncode == 1, done
    assert done.stderr.strip().splitlines() == [f"Error: {said}; no note was recorded"], done
    assert done.stdout == "" and "Traceback" not in done.stderr


def _logbook(page: str) -> str:
    return page.split("## Logbook\n", 1)[1].split("\n## ", 1)[0]


def test_tracks_note_records_dated_attributed_notes_that_explain_shows_in_time_order(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    _seed(Ledger.open(url))
    home = tmp_path / "home"

    on_run = _tracks(
        home, url, "note", RUN, "lowered lr to 1e-3 after the spike", "--author", "ana"
    )
    assert on_run.returncode == 0, on_run
    head, body = on_run.stdout.splitlines()
    assert head.startswith(f"note 1 on {RUN}, 20") and head.endswith(" UTC, by ana (cli):")
    assert body == "  lowered lr to 1e-3 after the spike"
    # The OS user by default; a URL's password never reaches the ledger or the screen.
    said = "restarted: node drained\nledger was postgresql://u:HUNTER2@db/x"
    on_attempt = _tracks(home, url, "note", f"{RUN}#2", said)
    assert on_attempt.returncode == 0, on_attempt
    assert on_attempt.stdout.splitlines()[0].endswith(" UTC, by bo (cli):")
    assert "HUNTER2" not in on_attempt.stdout and "postgresql://u:***@db/x" in on_attempt.stdout
    assert _tracks(home, url, "note", f"{RUN}#1", "spot node reclaimed").returncode == 0

    _refused(
        _tracks(home, url, "note", "digits-cnn-nope", "x"),
        "run 'digits-cnn-nope' is not in the ledger",
    )
    ledger = Ledger.open(url)
    notes = ledger.notes(RUN)
    assert [(n.note_id, n.target, n.author, n.source) for n in notes] == [
        (1, RUN, "ana", "cli"), (2, f"{RUN}#2", "bo", "cli"), (3, f"{RUN}#1", "bo", "cli"),
    ]  # fmt: skip
    assert notes[1].text == "restarted: node drained\nledger was postgresql://u:***@db/x"

    page = _tracks(home, url, "explain", RUN)
    assert page.returncode == 0, page
    logbook = _logbook(page.stdout)
    lines = [line for line in logbook.splitlines() if line.startswith("- ")]
    # The run's events and every note, in time order; a note's lines quoted as written.
    assert [line.split(" — ", 1)[1] for line in lines] == [
        "run created for ana (baseline)",
        "attempt 1 started (launched by ui)",
        "attempt 1 ended **preempted**",
        "attempt 2 started (launched by ui)",
        "**note 1** on the run by **ana** (cli):",
        "**note 2** on attempt 2 by **bo** (cli):",
        "**note 3** on attempt 1 by **bo** (cli):",
    ]
    assert "  > restarted: node drained\n  > ledger was postgresql://u:***@db/x\n" in logbook
    # An attempt's page: the run's notes and its own, and where the others are.
    focused = _logbook(explain(ledger, f"{RUN}#2"))
    assert "**note 1**" in focused and "**note 2**" in focused
    assert "**note 3**" not in focused and f"notes of their own: `{RUN}#1`" in focused


def test_tracks_note_on_postgresql(pg_database: str, tmp_path: Path) -> None:
    _seed(Ledger.open(pg_database))
    home = tmp_path / "home"
    done = _tracks(home, pg_database, "note", f"{RUN}#1", "preempted by the spot market")
    assert done.returncode == 0, done
    _refused(
        _tracks(home, pg_database, "note", "other-run", "x"), "run 'other-run' is not in the ledger"
    )
    page = explain(Ledger.open(pg_database), RUN)
    assert "**note 1** on attempt 1 by **bo** (cli):\n  > preempted by the spot market" in page


@pytest.mark.parametrize(
    ("text", "author", "said"),
    [
        ("   \n ", "ana", "note refused: it is empty"),
        ("x" * 2001, "ana", "note refused: 2001 characters, at most 2000"),
        ("ring\x07", "ana", "note refused: character 5 is U+0007"),
        ("evil \u202e txt", "ana", "note refused: character 6 is U+202E"),
        ("fine", "", "author refused: it is empty"),
        ("fine", "ana\nroot", "author refused: character 4 is U+000A"),
    ],
)
def test_a_note_the_logbook_refuses_names_why_and_writes_nothing(
    tmp_path: Path, text: str, author: str, said: str
) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    _seed(ledger)
    with pytest.raises(InvalidNoteError, match=said.replace("+", r"\+")):
        ledger.add_note(RUN, text, author=author, source="cli")
    assert ledger.notes(RUN) == []


def test_notes_are_append_only_and_name_an_existing_run_or_attempt(ledger_url: str) -> None:
    """On both databases: unknown targets are refused by name, and the database itself refuses
    to change or delete a note; the migration's triggers go with a downgrade and come back."""
    ledger = Ledger.open(ledger_url)
    _seed(ledger)
    with pytest.raises(UnknownRunError, match="run 'nope' is not in the ledger"):
        ledger.add_note("nope", "x", author="ana", source="cli")
    with pytest.raises(UnknownAttemptError, match=f"attempt {RUN}#3 is not in the ledger"):
        ledger.add_note(RUN, "x", author="ana", source="cli", attempt_no=3)
    note = ledger.add_note(RUN, "  keep me \r\nas written  ", author="ana", source="cli")
    assert note.text == "keep me \nas written" and note.attempt_no is None
    t = schema.notes
    for change in (sa.update(t).values(text="rewritten"), sa.delete(t)):
        with (
            pytest.raises(sa.exc.DBAPIError, match="notes are append-only"),
            ledger.engine.begin() as conn,
        ):
            conn.execute(change)
    assert ledger.notes(RUN) == [note]
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with ledger.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0005")
        assert not sa.inspect(conn).has_table("notes")
        command.upgrade(cfg, "head")
    ledger.add_note(RUN, "again", author="ana", source="cli", attempt_no=2)
    with (
        pytest.raises(sa.exc.DBAPIError, match="notes are append-only"),
        ledger.engine.begin() as conn,
    ):
        conn.execute(sa.delete(t))


@pytest.mark.slow
def test_a_launch_note_is_recorded_on_its_attempt_by_who_launched_it(
    tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch from the UI with a ``note`` in its run config: the note lands on the attempt it
    opened, by the launching user, from that Dagster run. The trainer's program is missing, so
    the attempt ends at once after its receipt opens. A note the logbook refuses is a run
    config error naming the key, before any run or attempt opens."""
    settings = TracksSettings.from_env()
    snapshot = make_snapshot(settings)
    with pytest.raises(ConfigError, match="run config of training_attempt: note: character 4 is"):
        train_config_for_attempt(
            None, TrainingRunConfig(owner="ana", purpose="baseline", note="bad\x1b[31m"),
            snapshot, None,
        )  # fmt: skip
    passed = [
        CheckVerdict(check=c, blocking=True, passed=True, summary="") for c in BLOCKING_CHECKS
    ]
    record_verdict(snapshot, passed, snapshot_root=settings.snapshot_root)
    monkeypatch.setenv("TRACKS_TRAINER_PYTHON", str(tracks_home / "no-such-python"))
    with dg.DagsterInstance.get() as instance:
        launched = train_alone(
            settings, instance, snapshot.snapshot_id,
            {**SMALL, "note": "trying the cosine schedule; see ticket 42"},
            tags={"dagster/user": "ana@example.com"},
        )  # fmt: skip
    ledger = Ledger.open(settings.ledger_url)
    [attempt] = ledger.list_attempts()
    assert attempt.dagster_run_id == launched.run_id
    [note] = ledger.notes(attempt.run_id)
    assert (note.attempt_no, note.author, note.source, note.text) == (
        1, "ana@example.com", f"dagster launch {launched.run_id}",
        "trying the cosine schedule; see ticket 42",
    )  # fmt: skip
