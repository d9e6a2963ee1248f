"""No URL password reaches a receipt: last words, the canary's report, the restore check."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets import checks
from pipeline.states import TerminationReason
from pipeline.trainer.attempt import Outcome, write_last_words
from sensors.canary import _step_failures

LEAKY_URL = "postgresql://tracks:hunter2@db/ledger"


def test_last_words_carry_no_password(tmp_path: Path) -> None:
    # Long enough that the 2000-character cut falls between the password and its '@'.
    message = "x" * 1956 + f" could not reach {LEAKY_URL}"
    assert message.index("@") == 2000 and message[:2000].endswith("hunter2")
    outcome = Outcome(
        TerminationReason.INFRA_TRANSIENT,
        74,
        f"the ledger at {LEAKY_URL} went away",
        step=40,
        exception=ConnectionError(message),
    )
    path = tmp_path / "attempt-1.last_words.json"
    write_last_words(path, run_id="run-x", attempt_no=1, outcome=outcome, last_checkpoint=None)
    words = json.loads(path.read_text())
    assert "hunter2" not in path.read_text()
    assert words["exception_type"] == "ConnectionError"
    assert words["exception_message"].endswith("postgresql://tracks:***@db/")
    assert "tracks:***@db/ledger" in words["detail"]


def test_canary_step_failures_quote_no_password() -> None:
    @dg.op
    def raises() -> None:
        raise RuntimeError(f"could not reach {LEAKY_URL}")

    @dg.op
    def fails() -> None:
        raise dg.Failure(description=f"gave up on {LEAKY_URL}")

    @dg.job
    def leaky() -> None:
        raises()
        fails()

    result = leaky.execute_in_process(raise_on_error=False)
    failures = _step_failures(result)
    assert set(failures) == {"raises", "fails"}
    assert not any("hunter2" in message for message in failures.values())
    assert "gave up on postgresql://tracks:***@db/ledger" in failures["fails"]


@pytest.mark.parametrize("where", ["stderr", "verdict"])
def test_restore_check_description_quotes_no_password(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check keeps stderr's last 2000 characters: that tail starts inside the URL, after
    # its scheme, so only redacting the whole of it first hides the password.
    stderr = f"Traceback: could not reach {LEAKY_URL}\n" + "y" * 1975
    assert "://" not in stderr[-2000:] and "hunter2" in stderr[-2000:]
    verdict: dict[str, Any] = {"ok": False}
    if where == "verdict":
        verdict["error"] = f"checkpoint does not restore: could not reach {LEAKY_URL}"

    def fake_run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, json.dumps(verdict) + "\n", stderr)

    monkeypatch.setattr(checks.subprocess, "run", fake_run)
    result = checks.judge_restores_in_new_process({"path": "/ckpt/step-00010"}, "p")
    assert not result.passed
    assert "does not restore" in (result.description or "")
    assert "hunter2" not in (result.description or "")
    assert "hunter2" not in json.dumps(result.metadata["verdict"].value)
