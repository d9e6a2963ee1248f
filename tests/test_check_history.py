"""Every data-check verdict of a snapshot is kept; the gate reads the newest.

Reproduced before the fix: a check run again replaced its row, so a snapshot that was blocked
and later passed (or the reverse) kept no trace of the earlier verdict anywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from pipeline.data.errors import BlockedSnapshotError
from pipeline.data.gate import CheckVerdict, ensure_checks_passed, record_verdict
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import create_snapshot
from pipeline.explain import explain
from pipeline.ledger import Ledger, schema


def _quality(passed: bool, summary: str) -> list[CheckVerdict]:
    return [CheckVerdict(check="data_quality", blocking=True, passed=passed, summary=summary)]


def test_every_check_verdict_is_kept_and_the_gate_reads_the_newest(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    write_digits_landing(tmp_path / "landing")
    snapshot = create_snapshot(tmp_path / "landing", tmp_path / "snapshots")
    root = tmp_path / "snapshots"
    # 1: the real checks, run by the gate on the spot.
    ensure_checks_passed(snapshot, snapshot_root=root, ledger=ledger, dagster_run_id="dr-1")
    # 2: checked again (a stricter suite, say): data_quality fails; the gate blocks.
    record_verdict(snapshot, _quality(False, "label 7 holds 2% of rows"), snapshot_root=root,
                   ledger=ledger, dagster_run_id="dr-2")  # fmt: skip
    with pytest.raises(BlockedSnapshotError, match="label 7 holds 2% of rows"):
        ensure_checks_passed(snapshot, snapshot_root=root, ledger=ledger)
    # 3: and again, passing: the newest verdict is what the gate reads.
    record_verdict(snapshot, _quality(True, "every expectation met"), snapshot_root=root,
                   ledger=ledger, dagster_run_id="dr-3")  # fmt: skip
    ensure_checks_passed(snapshot, snapshot_root=root, ledger=ledger)

    history = ledger.snapshot_check_history(snapshot.snapshot_id)
    assert [(c.check_name, c.passed, c.dagster_run_id) for c in history] == [
        ("schema_contract", True, "dr-1"),
        ("data_quality", True, "dr-1"),
        ("data_quality", False, "dr-2"),
        ("data_quality", True, "dr-3"),
    ]
    page = explain(ledger, snapshot.snapshot_id)
    assert "## Check history" in page
    assert "oldest first (4)" in page
    rows = [line for line in page.splitlines() if "| data_quality |" in line]
    assert "**failed**" in rows[-2] and "dr-2" in rows[-2] and "label 7 holds 2%" in rows[-2]
    assert "passed" in rows[-1] and "dr-3" in rows[-1]

    # The run page's snapshot section lists the history too.
    ledger.create_run(
        run_id="r1", model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="c" * 64, snapshot_id=snapshot.snapshot_id,
    )  # fmt: skip
    run_page = explain(ledger, "r1")
    assert "Check history (oldest first): " in run_page
    assert run_page.count("data_quality failed") == 1 and run_page.count("data_quality passed") == 2


def test_upgrading_a_ledger_keeps_the_verdicts_it_already_had(ledger_url: str) -> None:
    old = Ledger(ledger_url)
    old.upgrade("0003")
    with old.engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO snapshots (snapshot_id, manifest_sha256, created_at, verdict) "
            "VALUES ('digits-00000000000000aa', :m, CURRENT_TIMESTAMP, 'passed')"
        ), {"m": "m" * 64})  # fmt: skip
        conn.execute(sa.text(
            "INSERT INTO snapshot_checks (snapshot_id, manifest_sha256, check_name, blocking, "
            "passed, checked_at, dagster_run_id) VALUES ('digits-00000000000000aa', :m, "
            "'schema_contract', :yes, :yes, CURRENT_TIMESTAMP, 'dr-old')"
        ), {"m": "m" * 64, "yes": True})  # fmt: skip
    old.dispose()
    ledger = Ledger.open(ledger_url)
    [kept] = ledger.snapshot_check_history("digits-00000000000000aa")
    assert (kept.check_name, kept.passed, kept.dagster_run_id) == (
        "schema_contract",
        True,
        "dr-old",
    )
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(
            schema.snapshot_check_history)).scalar() == 1  # fmt: skip
    ledger.dispose()
