"""``tracks explain`` renders a scripted run's whole story, section by section.

The scenario: a run preempted twice (SIGTERM with last words, then SIGKILL found by an expired
heartbeat), an OOM stopped with an unchanged config and retried with a smaller batch, which
then succeeds, is evaluated (one evaluator crashes) and promoted; and a second run on drifted
data that stops on bad input without spending GPU time. Reasons come from the classifier and
decisions from the retry policy, written to a real ledger.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from pipeline.cli import main as tracks
from pipeline.explain import explain
from pipeline.ledger import AttemptStart, EvaluationRecord, Ledger, PromotionRecord, schema
from pipeline.reasons import AttemptEvidence, Termination, classify
from pipeline.retry import RetryAction, decide, policy_for_run, record_decision
from pipeline.states import CheckpointState, RunStatus, TerminationReason

RUN = "digits-cnn-5f3a-20261121T0900-ab12"
DRIFT_RUN = "digits-cnn-77aa-20261121T1000-cd34"
SNAPSHOT = "digits-5f3a9c0e11d24b7f"
MANIFEST = "5f3a" + "0" * 60
CONFIG: dict[str, Any] = {
    "model_family": "digits-cnn",
    "seed": 0,
    "max_steps": 600,
    "batch_size": 128,
    "learning_rate": 0.003,
    "model": {"channels": 16, "hidden": 64, "dropout": 0.0},
}
SMALLER = {**CONFIG, "batch_size": 64}


def _placement(host: str, node: str) -> dict[str, Any]:
    return {
        "host": host, "pod": f"{host}-pod", "node": node, "accelerator_type": "NVIDIA H100",
        "accelerator_count": 1, "torch_version": "2.13.0", "cuda_version": "12.8", "world_size": 1,
    }  # fmt: skip


def _start(config: dict[str, Any], host: str, resumed: str | None = None) -> AttemptStart:
    return AttemptStart(
        config_snapshot=config, config_sha256=("a" if config == CONFIG else "b") * 64,
        data_manifest_sha256=MANIFEST, container_digest="sha256:" + "e" * 64,
        placement=_placement(host, "gpu-node-7"), dagster_run_id="dagster-run-1",
        code_commit="0123abcd", resumed_from_checkpoint=resumed,
    )  # fmt: skip


def _ckpt(step: int, attempt_no: int) -> str:
    return f"/store/{RUN}/step-{step:010d}-a{attempt_no:02d}"


def _commit(ledger: Ledger, attempt: Any, step: int, parent: str | None = None) -> str:
    path = _ckpt(step, attempt.attempt_no)
    ledger.checkpoint_writing(
        run_id=RUN, attempt_no=attempt.attempt_no, step=step, path=path,
        fencing_token=attempt.fencing_token, parent_path=parent,
    )  # fmt: skip
    ledger.commit_checkpoint(
        run_id=RUN, attempt_no=attempt.attempt_no, path=path, manifest_sha256=f"{step:04d}" * 16,
        size_bytes=1_000_000, metrics={"eval_loss": 1.0 / step, "eval_accuracy": 0.5 + step / 2000},
        fencing_token=attempt.fencing_token,
    )  # fmt: skip
    return path


def _end(
    ledger: Ledger,
    run_id: str,
    attempt: Any,
    evidence: AttemptEvidence,
    *,
    gpu: float,
    next_config: dict[str, Any] | None = None,
) -> tuple[Termination, RetryAction]:
    termination = classify(evidence)
    ended = ledger.end_attempt(
        run_id, attempt.attempt_no, termination_reason=termination.reason,
        termination_detail=termination.detail, exit_code=evidence.exit_code,
        signal=evidence.signal_name, gpu_seconds=gpu, cpu_seconds=gpu * 2,
        last_step=evidence.last_committed_step,
    )  # fmt: skip
    decision = decide(
        policy_for_run(ledger.get_run(run_id)),
        ledger.attempts(run_id),
        ended,
        next_config,
        checkpoints=ledger.checkpoints(run_id),
    )
    record_decision(ledger, ended, decision)
    return termination, decision.action


def build_scenario(ledger: Ledger) -> None:
    ledger.create_run(
        run_id=RUN, model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="a" * 64, snapshot_id=SNAPSHOT, code_commit="0123abcd",
    )  # fmt: skip
    # 1: SIGTERM from the scheduler; the trainer saves, writes last words, exits 75.
    a1 = ledger.begin_attempt(RUN, _start(CONFIG, "host-a"))
    ledger.set_resumed_from(RUN, a1.attempt_no, None)  # the trainer reports its fresh start
    c100 = _commit(ledger, a1, 100)
    c200 = _commit(ledger, a1, 200, parent=c100)
    ledger.set_checkpoint_state(RUN, c100, CheckpointState.SUPERSEDED, "retention: keep_last_k=1")
    words = {"reason": "preempted", "step": 200,
             "detail": "Stopped on SIGTERM after step 200 of 600 and committed a checkpoint at "
                       "step 200."}  # fmt: skip
    got = _end(ledger, RUN, a1, AttemptEvidence(exit_code=75, last_words=words,
               last_committed_step=200), gpu=1800)  # fmt: skip
    assert got[0].reason == "preempted" and got[1] == RetryAction.RESUME
    # 2: the node vanished: SIGKILL, no last words, found by its expired heartbeat.
    a2 = ledger.begin_attempt(RUN, _start(CONFIG, "host-b", resumed=c200))
    ledger.checkpoint_writing(
        run_id=RUN, attempt_no=2, step=300, path=_ckpt(300, 2), fencing_token=a2.fencing_token
    )
    got = _end(ledger, RUN, a2, AttemptEvidence(heartbeat_age_seconds=610,
               heartbeat_timeout_seconds=300, last_committed_step=200), gpu=900)  # fmt: skip
    assert got[0].reason == "preempted"
    # 3: moved to a smaller accelerator and ran out of memory; the same config would again.
    a3 = ledger.begin_attempt(RUN, _start(CONFIG, "host-c", resumed=c200))
    oom_words = {"reason": "oom", "step": 231, "exception_type": "OutOfMemoryError",
                 "detail": "OutOfMemoryError at step 231: CUDA out of memory. Tried to allocate "
                           "2.00 GiB"}  # fmt: skip
    got = _end(ledger, RUN, a3, AttemptEvidence(exit_code=77, last_words=oom_words,
               last_committed_step=200), gpu=300)  # fmt: skip
    assert got[1] == RetryAction.STOP
    ledger.set_run_status(RUN, RunStatus.FAILED)
    # A person halves the batch: the policy now allows a retry, from scratch.
    ended3 = ledger.get_attempt(RUN, 3)
    retry = decide(policy_for_run(ledger.get_run(RUN)), ledger.attempts(RUN), ended3, SMALLER)
    assert retry.action == RetryAction.RETRY
    record_decision(ledger, ended3, retry)
    # 4: batch 64, fresh start; a bad checkpoint is caught; trains to the end.
    a4 = ledger.begin_attempt(RUN, _start(SMALLER, "host-c"))
    ledger.set_resumed_from(RUN, a4.attempt_no, None)
    c400 = _commit(ledger, a4, 400)
    ledger.set_checkpoint_state(
        RUN, c400, CheckpointState.CORRUPT, "model.safetensors: sha256 differs from MANIFEST.json"
    )
    final = _commit(ledger, a4, 600, parent=c400)
    got = _end(ledger, RUN, a4, AttemptEvidence(exit_code=0, last_committed_step=600), gpu=2400)
    assert got[1] == RetryAction.NONE
    ledger.set_run_status(RUN, RunStatus.TRAINED)
    now = datetime.now(UTC)
    evaluation: dict[str, Any] = {
        "run_id": RUN, "attempt_no": 4, "checkpoint_path": final,
        "checkpoint_manifest_sha256": "0600" * 16, "evaluator_version": "code:sha256:77aa",
        "evaluator_env_digest": "env:sha256:1", "task_set_version": "digits-holdout:sha256:9",
        "decoding_params": {"argmax": True}, "judge_model": "not applicable",
        "rubric_version": "not applicable", "started_at": now, "ended_at": now,
    }  # fmt: skip
    ledger.record_evaluation(
        EvaluationRecord(
            evaluation_id="ev-robust-1", evaluator_name="noise_robustness", status="failed",
            termination_reason="evaluator_crash",
            detail="Evaluator noise_robustness crashed with ValueError: noise level -1.",
            **evaluation,
        )
    )  # fmt: skip
    ledger.record_evaluation(
        EvaluationRecord(
            evaluation_id="ev-holdout-1", evaluator_name="holdout_accuracy", status="complete",
            metrics={"accuracy": 0.9712}, slice_metrics={"digit=8": {"accuracy": 0.93}},
            raw_outputs_uri="mlflow:/raw", failures_uri="mlflow:/failures", mlflow_run_id="ml1",
            **evaluation,
        )
    )  # fmt: skip
    ledger.record_promotion(
        PromotionRecord(
            promotion_id="pr-1", run_id=RUN, attempt_no=4, checkpoint_path=final,
            checkpoint_manifest_sha256="0600" * 16, snapshot_id=SNAPSHOT, decision="promoted",
            reason="Passed: holdout_accuracy.accuracy 0.9712 >= 0.9.",
            evaluation_ids=["ev-holdout-1"], gate={}, model_name="digits-cnn",
            decided_at=now, model_version="3", previous_champion_version="2",
        )
    )  # fmt: skip

    # The drifted snapshot: the schema contract fails before the first step.
    ledger.create_run(
        run_id=DRIFT_RUN, model_family="digits-cnn", owner="ana", purpose="scheduled",
        config_sha256="a" * 64, snapshot_id="digits-77aa00000000beef",
    )  # fmt: skip
    d1 = ledger.begin_attempt(DRIFT_RUN, _start(CONFIG, "host-a"))
    drift = AttemptEvidence(
        exit_code=65,
        last_words={"reason": "bad_input", "exception_type": "SchemaError", "step": None,
                    "detail": "SchemaError before the first step: column 'label' is missing "
                              "from snapshot digits-77aa00000000beef"},
    )  # fmt: skip
    got = _end(ledger, DRIFT_RUN, d1, drift, gpu=0.0)
    assert (got[0].reason, got[1]) == ("bad_input", RetryAction.STOP)
    ledger.set_run_status(DRIFT_RUN, RunStatus.FAILED)


def _section(page: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    assert match, f"section {title!r} missing from:\n{page}"
    return match.group(1)


@pytest.fixture
def scenario_ledger(ledger_url: str) -> Ledger:
    ledger = Ledger.open(ledger_url)
    build_scenario(ledger)
    return ledger


def test_explain_tells_the_whole_story_of_the_run(scenario_ledger: Ledger) -> None:
    page = explain(scenario_ledger, RUN)
    assert page.startswith(f"# Run {RUN}\n")
    # The promotion recorded at the end moved the run from trained to promoted.
    assert (
        "Status **promoted** (its checkpoint became the champion; the Promotion section says"
        in page
    )
    assert "1.50 GPU-hours" in page
    assert (
        "The latest attempt, 4, ended **succeeded** and the retry policy decided **none**" in page
    )

    tried = _section(page, "What was tried")
    assert '"batch_size": 64' in tried  # the latest attempt's config is shown
    assert "- attempt 1: the first attempt" in tried
    assert "- attempt 2: nothing (same config)" in tried
    assert "- attempt 4: `batch_size: 128 → 64`" in tried

    data = _section(page, "Data snapshot")
    assert f"Snapshot `{SNAPSHOT}`. Every attempt read manifest sha256 `{MANIFEST}`." in data

    where = _section(page, "Where it ran")
    for n, host in ((1, "host-a"), (2, "host-b"), (3, "host-c"), (4, "host-c")):
        assert (
            f"| {n} | {host} | {host}-pod | gpu-node-7 | 1 x NVIDIA H100 | 2.13.0 | 12.8 |" in where
        )

    lineage = _section(page, "Checkpoint lineage")
    assert "- Attempt 1 started fresh; committed steps 100, 200." in lineage
    assert (
        "- Attempt 2 resumed from `step-0000000200-a01` (step 200, written by attempt 1, "
        "now committed); committed no checkpoint." in lineage
    )
    assert "- Attempt 4 started fresh; committed steps 400, 600." in lineage
    assert "| 100 | 1 | superseded | retention: keep_last_k=1 |" in lineage
    assert "| 300 | 2 | never finished writing" in lineage
    assert "| 400 | 4 | corrupt (failed verification; never resumed from) | model.safetensors" in (
        lineage
    )
    assert "| 600 | 4 | committed | — | step-0000000400-a04 |" in lineage

    attempts = _section(page, "Attempts and retries")
    rows = [line for line in attempts.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) == 4
    assert rows[0].endswith(
        "| preempted | 0.50 | resume | `preempted_resume` | 4 attempt(s), no GPU-seconds limit |"
    )
    assert rows[1].endswith(
        "| preempted | 0.25 | resume | `preempted_resume` | 3 attempt(s), no GPU-seconds limit |"
    )
    assert rows[2].endswith(
        "| oom | 0.08 | retry | `oom_config_changed` | 1 attempt(s), no GPU-seconds limit |"
    )
    assert rows[3].endswith("| succeeded | 0.67 | none | `succeeded_evaluate` | — |")
    assert "Stopped on SIGTERM after step 200 of 600" in attempts
    assert "The heartbeat expired: none for 610s (timeout 300s)" in attempts
    assert "OutOfMemoryError at step 231" in attempts
    assert "the next config changes batch_size: 128 → 64" in attempts
    assert (
        "This replaced an earlier decision, **stop** (`oom_config_unchanged`): Stop: attempt 3 "
        "ran out of memory and the next config changes nothing that bears on memory" in attempts
    )
    assert (
        "Spent per reason: preempted 2 attempt(s), 0.75 GPU-h; succeeded 1 attempt(s), "
        "0.67 GPU-h; oom 1 attempt(s), 0.08 GPU-h." in attempts
    )

    evaluation = _section(page, "Evaluation")
    assert "1 complete and 1 failed evaluation(s)." in evaluation
    assert "holdout_accuracy" in evaluation and "accuracy=0.9712" in evaluation
    assert "failed (evaluator_crash: Evaluator noise_robustness crashed" in evaluation

    promotion = _section(page, "Promotion")
    assert "**promoted** as digits-cnn version 3 (previous champion: version 2)" in promotion
    assert "`step-0000000600-a04` of attempt 4" in promotion
    assert "## Attempt" not in page.split("## Attempts and retries")[0]


def test_naming_an_attempt_highlights_it_and_shows_its_receipt(scenario_ledger: Ledger) -> None:
    page = explain(scenario_ledger, f"{RUN}#3")
    assert page.startswith(f"# Run {RUN}, attempt 3\n")
    assert "This page highlights **attempt 3** (▶), which ended **oom**" in page
    assert '"batch_size": 128' in _section(page, "What was tried")
    assert "| **▶ 3** | host-c |" in _section(page, "Where it ran")
    assert "| **▶ 3** |" in _section(page, "Attempts and retries")
    detail = _section(page, "Attempt 3 in detail")
    assert (
        "- **Exit**: code 77, signal —; reached step 200, restored step 200; fencing token 3"
        in (detail)
    )
    assert "retry by rule `oom_config_changed`" in detail
    assert '"count": 1' in detail


def test_a_bad_input_run_stops_without_gpu_time_and_is_not_evaluated(
    scenario_ledger: Ledger,
) -> None:
    page = explain(scenario_ledger, DRIFT_RUN)
    assert "Status **failed** (stopped by the retry policy), after 1 attempt(s)" in page
    attempts = _section(page, "Attempts and retries")
    assert "| bad_input | 0.00 | stop | `bad_input_stops` |" in attempts
    assert "column 'label' is missing" in attempts
    assert "retrying bad data is wishful thinking" in attempts
    assert "Not evaluated: no attempt succeeded" in _section(page, "Evaluation")
    assert "No promotion decision yet." in _section(page, "Promotion")
    assert "No checkpoint was ever started." in _section(page, "Checkpoint lineage")


def test_tracks_explain_and_attempts_on_the_command_line(
    tmp_path: Path, tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger.open(url)
    build_scenario(ledger)
    monkeypatch.setenv("TRACKS_LEDGER_URL", url)
    runner = CliRunner()

    out = tmp_path / "page.md"
    result = runner.invoke(tracks, ["explain", f"{RUN}#2", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output == out.read_text() == explain(ledger, f"{RUN}#2")
    missing = runner.invoke(tracks, ["explain", f"{RUN}#9"])
    assert missing.exit_code != 0 and f"{RUN}#9" in missing.output

    result = runner.invoke(tracks, ["attempts", "--run", RUN])
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [f"{RUN}#{n}" for n in (4, 3, 2, 1)]
    oom = runner.invoke(tracks, ["attempts", "--reason", "oom"]).output.splitlines()
    assert len(oom) == 2 and "retry (oom_config_changed)" in oom[1]
    failed = runner.invoke(tracks, ["attempts", "--status", "failed", "--family", "digits-cnn"])
    assert len(failed.output.splitlines()) == 1 + 4
    with ledger.engine.begin() as conn:  # the drifted run was two weeks ago
        conn.execute(
            sa.update(schema.training_attempts)
            .where(schema.training_attempts.c.run_id == DRIFT_RUN)
            .values(started_at=datetime.now(UTC) - timedelta(days=14))
        )
    recent = runner.invoke(tracks, ["attempts", "--since", "7"]).output
    assert DRIFT_RUN not in recent and f"{RUN}#4" in recent
    assert runner.invoke(tracks, ["attempts", "--family", "nope"]).output == "No attempts match.\n"


def test_a_password_quoted_in_an_attempts_detail_is_never_stored_or_shown(
    tmp_path: Path, tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error that quotes a URL with its password reaches the receipt: the ledger stores it
    without the password, and a row stored before that rule is shown without it."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger.open(url)
    build_scenario(ledger)
    quoted = "OperationalError at step 3: could not connect to postgresql://tracks:{}@db:5432/x"
    attempt = ledger.begin_attempt(RUN, _start(CONFIG, "host-e"))
    ledger.end_attempt(
        RUN, attempt.attempt_no, termination_reason=TerminationReason.INFRA_TRANSIENT,
        termination_detail=quoted.format("HUNTER2"),
    )  # fmt: skip
    ledger.set_checkpoint_state(
        RUN, _ckpt(200, 1), CheckpointState.CORRUPT, "read from https://h/x?access_token=HUNTER3"
    )
    t = schema.training_attempts
    with ledger.engine.begin() as conn:
        stored = conn.execute(sa.select(t.c.termination_detail).where(t.c.run_id == RUN)).all()
        assert quoted.format("***") in {row[0] for row in stored}
        assert "HUNTER3" not in str(conn.execute(sa.select(schema.checkpoints)).all())
        conn.execute(  # as an older Tracks stored it
            sa.update(t)
            .where(t.c.run_id == RUN, t.c.attempt_no == 1)
            .values(termination_detail=quoted.format("OLDSECRET"))
        )
    monkeypatch.setenv("TRACKS_LEDGER_URL", url)
    runner = CliRunner()
    for args in (["attempts", "--run", RUN], ["explain", RUN], ["explain", f"{RUN}#1"]):
        result = runner.invoke(tracks, args)
        assert result.exit_code == 0, result.output
        assert "tracks:***@db:5432" in result.output, args
        assert "HUNTER" not in result.output and "OLDSECRET" not in result.output, args


def test_the_status_line_quotes_the_newest_refusal_and_a_promotion_is_not_undone(
    ledger_url: str,
) -> None:
    ledger = Ledger.open(ledger_url)
    ledger.create_run(
        run_id="r-gated", model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="a" * 64, snapshot_id=SNAPSHOT,
    )  # fmt: skip
    now = datetime.now(UTC)

    def gate(n: int, decision: str, reason: str) -> None:
        ledger.record_promotion(
            PromotionRecord(
                promotion_id=f"pr-{n}", run_id="r-gated", attempt_no=1, checkpoint_path="/c",
                checkpoint_manifest_sha256="0" * 64, snapshot_id=SNAPSHOT, decision=decision,
                reason=reason, evaluation_ids=[], gate={}, model_name="digits-cnn",
                decided_at=now + timedelta(minutes=n),
            )
        )  # fmt: skip

    gate(1, "refused", "Refused: the older reason.")
    gate(2, "refused", "Refused: the newer reason.")
    assert "**promotion refused**: Refused: the newer reason." in explain(ledger, "r-gated")
    gate(3, "promoted", "Passed.")
    gate(4, "refused", "Refused: a newer champion is better.")
    assert ledger.get_run("r-gated").status == "promoted"
    page = explain(ledger, "r-gated")
    assert "Status **promoted**" in page and "a newer champion is better" in page


def test_an_attempt_that_never_reported_a_restore_does_not_claim_a_fresh_start(
    ledger_url: str,
) -> None:
    ledger = Ledger.open(ledger_url)
    build_scenario(ledger)
    page = explain(ledger, f"{DRIFT_RUN}#1")  # stopped by its data checks before the first step
    assert "started fresh" not in page
    assert "ended before it restored a checkpoint or reported a fresh start" in page


def test_on_a_terminal_explain_lays_the_markdown_out(
    tmp_path: Path, tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A person at a terminal reads headings and tables, not ``## `` and ``| --- |``."""
    import os
    import pty
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger.open(url)
    build_scenario(ledger)
    leader, follower = pty.openpty()
    env = {**os.environ, "TRACKS_LEDGER_URL": url, "COLUMNS": "160", "TERM": "xterm"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "explain", f"{RUN}#2"],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process is done writing
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=60) == 0
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    page = explain(ledger, f"{RUN}#2")
    assert "## Attempts and retries" in page and "|---" in page.replace(":", "")
    assert "Attempts and retries" in shown
    assert "## " not in shown and "|---" not in shown.replace(":", "")
