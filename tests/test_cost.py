"""``tracks cost`` and the seed question: where did the GPU time go, by termination reason."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.config import Config
from alembic.script import ScriptDirectory
from click.testing import CliRunner

from pipeline.cli import main as tracks
from pipeline.ledger import AttemptStart, CostRow, Ledger, schema
from pipeline.ledger.ledger import _MIGRATIONS, cost_by_reason_query, head_revision
from pipeline.states import TerminationReason as R

REPO = Path(__file__).resolve().parent.parent
SEED = """
select termination_reason, count(*) as attempts, sum(gpu_seconds) / 3600 as gpu_hours
from training_attempts
where model_family = 'reasoning' and started_at >= now() - interval '7 days'
group by termination_reason order by gpu_hours desc;
"""

# (family, days ago, reason or None for still running, GPU-seconds)
ATTEMPTS = [
    ("reasoning", 1, R.SUCCEEDED, 36_000),
    ("reasoning", 3, R.PREEMPTED, 3_600),
    ("reasoning", 3, R.PREEMPTED, 7_200),
    ("reasoning", 2, R.PREEMPTED, 1_800),
    ("reasoning", 2, R.OOM, 900),
    ("reasoning", 6, R.BAD_INPUT, 0),
    ("reasoning", 0, None, 0),
    ("reasoning", 10, R.PREEMPTED, 99_999),  # outside the 7-day window
    ("vision", 1, R.PREEMPTED, 50_000),  # another family
]
EXPECTED = [
    CostRow("succeeded", 1, 10.0, 5.0),
    CostRow("preempted", 3, 3.5, 1.75),
    CostRow("oom", 1, 0.25, 0.125),
    CostRow("bad_input", 1, 0.0, 0.0),
    CostRow(None, 1, 0.0, 0.0),
]


def fill(ledger: Ledger) -> None:
    """One run per attempt, each started ``days ago`` and ended with its reason and GPU time."""
    now = datetime.now(UTC)
    for i, (family, days_ago, reason, gpu) in enumerate(ATTEMPTS):
        run_id = f"run-{i}"
        ledger.create_run(
            run_id=run_id, model_family=family, owner="test", purpose="baseline",
            config_sha256="c" * 64, snapshot_id="snap",
        )  # fmt: skip
        ledger.begin_attempt(
            run_id,
            AttemptStart(
                config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
                container_digest="env",
            ),
        )  # fmt: skip
        if reason is not None:
            ledger.end_attempt(
                run_id, 1, termination_reason=reason, termination_detail="test", gpu_seconds=gpu,
                cpu_seconds=gpu / 2,
            )  # fmt: skip
        t = schema.training_attempts
        with ledger.engine.begin() as conn:
            conn.execute(
                sa.update(t)
                .where(t.c.run_id == run_id)
                .values(started_at=now - timedelta(days=days_ago, minutes=5))
            )


def test_cost_by_reason_answers_the_seed_question(ledger_url: str) -> None:
    ledger = Ledger.open(ledger_url)
    fill(ledger)
    assert ledger.cost_by_reason("reasoning", 7) == EXPECTED
    assert [r.termination_reason for r in ledger.cost_by_reason("reasoning", 30)][:2] == [
        "preempted",
        "succeeded",
    ]
    assert ledger.cost_by_reason("nobody", 7) == []


def test_tracks_cost_prints_the_table(
    ledger_url: str, tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(Ledger.open(ledger_url))
    monkeypatch.setenv("TRACKS_LEDGER_URL", ledger_url)
    result = CliRunner().invoke(tracks, ["cost", "--family", "reasoning", "--days", "7"])
    assert result.exit_code == 0, result.output
    assert result.output == (
        "reasoning attempts started in the last 7 day(s), by termination reason:\n"
        "termination_reason   attempts     gpu_hours   cpu_hours\n"
        "succeeded                   1         10.00       5.000\n"
        "preempted                   3          3.50       1.750\n"
        "oom                         1          0.25       0.125\n"
        "bad_input                   1          0.00       0.000\n"
        "(running)                   1          0.00       0.000\n"
        "total                       7         13.75       6.875\n"
    )
    empty = CliRunner().invoke(tracks, ["cost", "--family", "vision", "--days", "0.5"])
    assert empty.output == "No vision attempts started in the last 0.5 day(s).\n"
    # A window that is not a positive finite number is a usage error, not an empty answer.
    for bad in ("-1", "0", "nan", "inf", "seven"):
        refused = CliRunner().invoke(tracks, ["cost", "--family", "reasoning", "--days", bad])
        assert refused.exit_code == 2, (bad, refused.output)
        assert "--days" in refused.output and "Traceback" not in refused.output


def test_seed_query_runs_as_written_on_postgresql_with_data(pg_database: str) -> None:
    ledger = Ledger.open(pg_database)
    fill(ledger)
    with ledger.engine.connect() as conn:
        rows = conn.execute(sa.text(SEED)).all()
    # "order by gpu_hours desc" alone leaves ties unordered: compare as sets, then the order.
    assert {(r[0], r[1], round(r[2], 6)) for r in rows} == {
        (r.termination_reason, r.attempts, r.gpu_hours) for r in EXPECTED
    }
    assert [r[0] for r in rows][:3] == ["succeeded", "preempted", "oom"]


def test_the_cost_query_is_answered_from_the_covering_index(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    compiled = cost_by_reason_query("reasoning", datetime(2026, 1, 1)).compile(ledger.engine)
    with ledger.engine.connect() as conn:
        plan = conn.exec_driver_sql(
            f"EXPLAIN QUERY PLAN {compiled}", tuple(compiled.construct_params().values())
        ).all()
    assert "COVERING INDEX ix_training_attempts_family_started" in " ".join(str(r) for r in plan)


def test_head_revision_read_from_the_files_is_alembics_head(tmp_path: Path) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    assert ScriptDirectory.from_config(cfg).get_current_head() == head_revision() == "0008"
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    assert ledger.schema_revision() == head_revision()
    assert Ledger(f"sqlite:///{tmp_path / 'empty.db'}").schema_revision() is None


def test_cost_benchmark_runs_end_to_end_on_a_small_ledger() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cost_query.py"), "--rows", "2000", "--repeat", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "USING COVERING INDEX ix_training_attempts_family_started" in result.stdout
    assert "Ledger.cost_by_reason: median" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["attempts", "--since", "-3"],
        ["attempts", "--since", "nan"],
        ["attempts", "--limit", "-1"],
        ["attempts", "--run", "../x"],
        ["cost", "--family", "../x"],
        ["explain", "some-run", "--output", "/nonexistent-folder/page.md"],
        # Past what dates can hold: a usage error, not "date value out of range".
        ["attempts", "--since", "1e6"],
        ["cost", "--days", "1e10", "--family", "digits"],
        ["canary", "--max-minutes", "nan"],
        ["canary", "--max-minutes", "inf"],
        # Not an attempt number: "²" is a digit to str.isdigit, and 10**22 no SQLite integer.
        ["explain", "some-run#99999999999999999999999"],
        ["explain", "some-run#\u00b2"],
        ["explain", "../../etc/passwd"],
    ],
)
def test_bad_cli_input_is_one_line_naming_the_option(args: list[str], tracks_home: Path) -> None:
    result = CliRunner().invoke(tracks, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    option = next(a for a in args if a.startswith("--")) if "--" in " ".join(args) else args[0]
    assert option in result.output, result.output


def test_a_batch_stopped_by_its_checks_is_listed_by_cost_and_attempts(
    tracks_home: Path,
) -> None:
    from pipeline.data.gate import CheckVerdict, record_verdict
    from pipeline.data.landing import Drift, write_digits_landing
    from pipeline.data.snapshot import create_snapshot
    from pipeline.settings import TracksSettings

    settings = TracksSettings.from_env()
    write_digits_landing(settings.landing_root, drift=Drift.NULLS)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    verdict = CheckVerdict("schema_contract", blocking=True, passed=False, summary="nulls")
    record_verdict(
        snapshot, [verdict], snapshot_root=settings.snapshot_root,
        ledger=Ledger.open(settings.ledger_url),
    )  # fmt: skip
    for args in (["attempts"], ["cost", "--family", "digits-cnn"]):
        result = CliRunner().invoke(tracks, args)
        assert result.exit_code == 0, result.output
        assert "1 snapshot(s) stopped by their blocking checks" in result.output
        assert snapshot.snapshot_id in result.output


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("foo://u:SECRET@h/db", "Can't load plugin"),
        ("not a url", "not a database URL"),
        ("sqlite:////", "unable to open database file"),
    ],
)
def test_a_ledger_that_cannot_be_opened_is_named_by_its_variable(
    url: str, said: str, tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACKS_LEDGER_URL", url)
    result = CliRunner().invoke(tracks, ["attempts"])
    assert result.exit_code == 1, result.output
    assert "cannot open the ledger at" in result.output
    assert "(TRACKS_LEDGER_URL)" in result.output and said in result.output
    assert "SECRET" not in result.output and "Traceback" not in result.output
