"""Receipts from evidence at any world size: each rank's signal, who failed first (or nobody),
the collateral rank, the step reached apart from the step committed, and the attempt a newer one
fenced out.

Unit tests feed the launcher's functions what torchrun's agent and the ranks really leave (the
agent's ``ProcessFailure``, each rank's outcome file and last words, as the trainer writes them)
and read the receipt the ledger keeps. Two real drills: two ranks under torchrun with one
SIGKILLed mid-training, and a trainer fenced out by a newer attempt begun in the ledger.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from pipeline.attempts import finish_attempt, prepare_attempt
from pipeline.cli import main as tracks
from pipeline.distributed import CollectiveError
from pipeline.distributed.launch import (
    OUTCOME_DIR_ENV,
    RankOutcome,
    decide_exit,
    end_deferred_attempt,
    parse_args,
    read_outcomes,
    write_rank_outcome,
    write_ranks_summary,
)
from pipeline.environment import placement
from pipeline.ledger import AttemptStart, Ledger
from pipeline.reasons import AttemptEvidence, classify
from pipeline.retry import RetryAction, RetryPolicyError, decide, load_retry_policy
from pipeline.settings import TracksSettings
from pipeline.states import RunStatus, TerminationReason
from pipeline.trainer import TrainConfig, exit_codes
from pipeline.trainer.attempt import Outcome, last_words_path, write_last_words
from pipeline.trainer.train import classify_exception
from tests.distributed_support import trainer_rank_pids

REPO = Path(__file__).resolve().parents[1]
RUN = "ranks"
TINY: dict[str, Any] = {
    "seed": 5, "max_steps": 400, "checkpoint_every_steps": 5, "batch_size": 32,
    "learning_rate": 0.003, "optimizer": "adam", "keep_last_k": 3,
    "model": {"channels": 4, "hidden": 16},
}  # fmt: skip


def _said_committed(sentence: str) -> list[int]:
    return [int(s) for s in re.findall(r"last committed checkpoint is step (\d+)", sentence)]


class _Attempt:
    """A self-owned attempt open in a SQLite ledger, and where its ranks leave their words."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.url = f"sqlite:///{tmp_path / 'ledger.db'}"
        self.store = tmp_path / "store"
        self.outcomes = tmp_path / "outcomes"
        self.outcomes.mkdir()  # the launcher makes it before any rank starts
        self.ledger = Ledger.open(self.url)
        self.ledger.create_run(
            run_id=RUN, model_family="digits-cnn", owner="test", purpose="baseline",
            config_sha256="c" * 64, snapshot_id="digits-0123",
        )  # fmt: skip
        self.record = self.ledger.begin_attempt(
            RUN,
            AttemptStart(
                config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
                container_digest="env:test",
            ),
        )  # fmt: skip
        monkeypatch.setenv(OUTCOME_DIR_ENV, str(self.outcomes))
        monkeypatch.delenv("TRACKS_LEDGER_URL", raising=False)
        self.args = ["--config", "c.yaml", "--run-id", RUN, "--store", str(self.store),
                     "--ledger-url", self.url]  # fmt: skip

    def commit(self, step: int) -> None:
        self.ledger.commit_checkpoint(
            run_id=RUN, attempt_no=1, path=str(self.store / RUN / f"step-{step:010d}-a01"),
            manifest_sha256="0" * 64, size_bytes=1, metrics=None,
            fencing_token=self.record.fencing_token, step=step,
        )  # fmt: skip

    def rank_ended(self, rank: int, outcome: Outcome) -> None:
        """What a rank leaves on its way out: last words, then its outcome for the launcher."""
        write_last_words(
            last_words_path(self.store, RUN, 1, rank=rank),
            run_id=RUN, attempt_no=1, outcome=outcome, last_checkpoint=None,
        )  # fmt: skip
        write_rank_outcome(
            rank, exit_code=outcome.exit_code, reason=str(outcome.reason), detail=outcome.detail,
            step=outcome.step, attempt_no=1, deferred_end=rank == 0, cpu_seconds=1.0,
        )  # fmt: skip

    def launcher_ends(self, world: int, failures: dict[int, Any]) -> dict[str, Any]:
        """The launcher's part: read every rank, decide, write the summary, close the attempt."""
        outcomes = read_outcomes(self.outcomes, world, failures)
        code, first = decide_exit(outcomes)
        path = write_ranks_summary(self.args, outcomes, code, first, world)
        assert path is not None
        end_deferred_attempt(self.args, outcomes, code, first)
        return json.loads(path.read_text())


RESET = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error: Connection reset by peer")
# How rank 0 ends when rank 1 dies at step 371: its all-reduce breaks (exit 74), or the agent's
# SIGTERM reaches it first and it stops, unable to agree on a step with its dead peer (exit 75).
BROKEN = classify_exception(CollectiveError("all_reduce", 0, RESET), step=371)
STOPPED = Outcome(
    TerminationReason.PREEMPTED, exit_codes.PREEMPTED,
    "Stopped on SIGTERM after step 371, but a peer rank died while agreeing when to stop: "
    f"{CollectiveError('agreeing when to stop', 0, RESET)}", step=371, signal="SIGTERM",
)  # fmt: skip


@pytest.mark.parametrize("rank0", [BROKEN, STOPPED], ids=["collective_broke", "agent_sigterm"])
def test_a_rank_sigkilled_at_two_ranks_is_named_with_its_signal_and_its_peer_as_collateral(
    rank0: Outcome, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt = _Attempt(tmp_path, monkeypatch)
    attempt.commit(350)
    attempt.rank_ended(0, rank0)  # rank 0 trained on to step 371
    # Rank 1 was SIGKILLed: no words, only the agent's record of a negative exit code.
    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGKILL, error_file="")
    summary = attempt.launcher_ends(2, {1: killed})

    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert ranks[1]["signal"] == "SIGKILL" and ranks[1]["exit_code"] == 137
    assert ranks[0]["collateral"] is True and not ranks[1]["collateral"]
    assert "Connection reset by peer" in ranks[0]["detail"]  # its own last words kept
    assert summary["first_failure"]["rank"] == 1
    ended = attempt.ledger.get_attempt(RUN, 1)
    assert ended.signal == "SIGKILL", ended.termination_detail
    assert ended.exit_code == 137 and ended.termination_reason == TerminationReason.PREEMPTED
    detail = ended.termination_detail
    assert "Rank 1 failed first: rank 1 was killed by SIGKILL" in detail, detail
    assert "Rank 0 was collateral" in detail and "Connection reset by peer" in detail, detail
    # Reached 371, committed 350: each fact under its own words.
    assert _said_committed(detail) == [350], detail
    assert "reached step 371; the last committed checkpoint is step 350" in detail, detail
    assert ended.last_step == 371


@pytest.mark.parametrize(("world", "ranks"), [(2, "both ranks"), (4, "all 4 ranks")])
def test_a_sigterm_delivered_to_every_rank_names_no_rank_as_failing_first(
    world: int, ranks: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt = _Attempt(tmp_path, monkeypatch)
    attempt.commit(552)  # the preemption checkpoint the ranks saved together
    for rank in range(world):
        said = "Stopped on SIGTERM after step 552 of 900 and committed a checkpoint at step 552."
        stopped = Outcome(
            TerminationReason.PREEMPTED, exit_codes.PREEMPTED, said, step=552, signal="SIGTERM"
        )
        attempt.rank_ended(rank, stopped)
    outcomes = read_outcomes(attempt.outcomes, world, {})
    assert decide_exit(outcomes) == (exit_codes.PREEMPTED, None)

    summary = attempt.launcher_ends(world, {})
    assert summary["first_failure"] is None
    assert [r["signal"] for r in summary["ranks"]] == ["SIGTERM"] * world
    ended = attempt.ledger.get_attempt(RUN, 1)
    assert ended.signal == "SIGTERM" and ended.exit_code == exit_codes.PREEMPTED
    assert f"{ranks} stopped on SIGTERM at step 552" in ended.termination_detail
    assert "failed first" not in ended.termination_detail, ended.termination_detail


def test_only_exit_times_further_apart_than_the_margin_say_which_rank_failed_first() -> None:
    oom = RankOutcome(0, exit_codes.OOM, "oom", "OutOfMemoryError at step 40", 40, 1000.3)
    # The agent stamps a death with int(time.time()): 1000 may be as late as 1001.1.
    said = "rank 1 was killed by SIGKILL without last words"
    close = RankOutcome(1, 137, None, said, None, 1000.0, signal="SIGKILL")
    assert decide_exit([oom, close]) == (137, None)
    far = RankOutcome(1, 137, None, said, None, 1003.0, signal="SIGKILL")
    assert decide_exit([oom, far]) == (exit_codes.OOM, oom)


def test_unordered_failures_are_told_as_unordered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt = _Attempt(tmp_path, monkeypatch)
    oom = Outcome(TerminationReason.OOM, exit_codes.OOM, "OutOfMemoryError at step 40", step=40)
    attempt.rank_ended(0, oom)
    killed = ProcessFailure(local_rank=1, pid=4243, exitcode=-signal.SIGKILL, error_file="")
    summary = attempt.launcher_ends(2, {1: killed})  # both within the same second
    assert summary["first_failure"] is None and summary["unordered"] == [0, 1]
    detail = attempt.ledger.get_attempt(RUN, 1).termination_detail
    assert "failed first" not in detail
    assert "Ranks 0 and 1 failed on their own too close together" in detail, detail


def test_a_fenced_attempt_names_who_took_over_and_the_newer_attempt_carries_the_run() -> None:
    # What a trainer fenced out at step 120 wrote before it exited 80.
    words = {
        "reason": "cancelled", "exit_code": exit_codes.FENCED, "step": 120,
        "exception_type": "StaleFencingTokenError",
        "detail": "StaleFencingTokenError at step 120: a newer attempt owns this run",
    }  # fmt: skip
    newer = {"attempt_no": 3, "via": "sensor:resume_training"}
    termination = classify(
        AttemptEvidence(
            exit_code=exit_codes.FENCED, last_words=words, last_committed_step=100,
            newer_attempt=newer,
        )
    )  # fmt: skip
    assert termination.reason == TerminationReason.FENCED
    assert termination.detail.startswith(
        "Fenced out at step 120 by attempt 3 (launched by sensor:resume_training), which holds "
        "a newer fencing token"
    ), termination.detail
    assert "cancel" not in termination.detail.lower()
    assert _said_committed(termination.detail) == [100]
    with pytest.raises(RetryPolicyError, match=r"retry_policy\.fenced: fenced is never retried"):
        load_retry_policy("fenced: {max_attempts: 3}")


def test_a_self_owned_trainer_fenced_out_ends_its_attempt_as_fenced_naming_the_newer_one(
    tmp_path: Path,
) -> None:
    from pipeline.ledger import StaleFencingTokenError
    from pipeline.trainer.attempt import AttemptHandle
    from pipeline.trainer.reporting import StdoutReporter

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    config = TrainConfig.from_dict({**TINY, "snapshot_dir": str(tmp_path)}, source="test")
    handle = AttemptHandle(
        run_id=RUN, run_dir=tmp_path / RUN, ledger=ledger, attempt_no=None, fencing_token=None,
        reporter=StdoutReporter(),
    )  # fmt: skip
    handle.begin(config, snapshot_id="digits-0123", data_manifest_sha256=None, resumed_from=None)
    newer = ledger.begin_attempt(
        RUN,
        AttemptStart(
            config_snapshot={}, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
            container_digest="env:test", launched_by={"via": "ui"},
        ),
    )  # fmt: skip
    refused = StaleFencingTokenError(RUN, 1, handle.fencing_token or 0, newer.fencing_token)
    handle.end(classify_exception(refused, step=120), cpu_seconds=1.0, gpu_seconds=0.0)
    ended = ledger.get_attempt(RUN, 1)
    assert ended.termination_reason == TerminationReason.FENCED
    assert ended.exit_code == exit_codes.FENCED
    assert "Fenced out at step 120 by attempt 2 (launched by ui)" in ended.termination_detail


def test_drill_hooks_are_recorded_with_the_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACKS_FAULT_SLEEP_AFTER_STEP", "60@12")
    monkeypatch.setenv("TRACKS_FAULT_ENOSPC_AT_STEP", "30")
    assert placement()["fault_hooks"] == {
        "TRACKS_FAULT_ENOSPC_AT_STEP": "30",
        "TRACKS_FAULT_SLEEP_AFTER_STEP": "60@12",
    }


_PET = ("PET_NPROC_PER_NODE", "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


@pytest.mark.parametrize(
    ("argv", "env", "said"),
    [
        (["--nproc-per-node", "0"], {"PET_NPROC_PER_NODE": "2"}, "at least 1, not 0"),
        (["--nproc-per-node", "-3"], {}, "--nproc-per-node must be at least 1, not -3"),
        ([], {"PET_NNODES": "abc"}, "PET_NNODES='abc'"),
        ([], {"PET_NNODES": "2", "PET_MASTER_ADDR": "10.0.0.1", "PET_NODE_RANK": "-1"},
         "PET_NODE_RANK='-1': expected a whole number from 0 to 1"),
        ([], {"PET_MASTER_PORT": "99999"}, "PET_MASTER_PORT='99999'"),
        ([], {"PET_NPROC_PER_NODE": "x"}, "PET_NPROC_PER_NODE='x'"),
    ],
)  # fmt: skip
def test_a_bad_rank_count_or_torchrun_variable_is_refused_with_exit_2(
    argv: list[str],
    env: dict[str, str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in _PET:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        parse_args([*argv, "--", "--config", "c.yaml"])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_the_launcher_refuses_a_malformed_variable_without_a_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if k not in _PET}
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.distributed.launch", "--", "--config", "c.yaml"],
        cwd=REPO, env={**env, "PET_NNODES": "abc"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "environment variable PET_NNODES='abc'" in result.stderr
    assert "Traceback" not in result.stderr


# -- real processes ------------------------------------------------------------------------------


def _prepared_run(max_steps: int, every: int) -> tuple[Ledger, Any, TracksSettings, Any]:
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot

    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    ledger = Ledger.open(settings.ledger_url)
    write_digits_landing(settings.landing_root)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    config = TrainConfig.from_dict(
        {**TINY, "max_steps": max_steps, "checkpoint_every_steps": every,
         "snapshot_dir": str(snapshot.path)},
        source="test",
    )  # fmt: skip
    prepared = prepare_attempt(
        ledger, snapshot=snapshot, train_config=config, work_root=settings.work_root,
        launched_by={"via": "cli"},
    )  # fmt: skip
    return ledger, prepared, settings, snapshot


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.mark.slow
def test_a_real_rank_sigkilled_under_torchrun_leaves_its_signal_and_rank_on_the_receipt(
    tracks_home: Path,
) -> None:
    ledger, prepared, settings, _ = _prepared_run(max_steps=400, every=5)
    run_id, store = prepared.run.run_id, settings.checkpoint_root
    hooks = {"TRACKS_FAULT_SLEEP_AFTER_STEP": "60@12"}  # both ranks pause after step 12
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.distributed.launch", "--nproc-per-node", "2",
         "--log-dir", str(settings.work_root / "ranks"), "--", *prepared.trainer_args(store)],
        cwd=REPO, env={**os.environ, **prepared.trainer_env(ledger.url), **hooks},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (latest := ledger.latest_committed_checkpoint(run_id)) is None or latest.step < 10:
            assert process.poll() is None and time.monotonic() < deadline, "no commit at step 10"
            time.sleep(0.1)
        while (ledger.get_attempt(run_id, 1).last_step or 0) < 12:  # the pause's heartbeat
            assert process.poll() is None and time.monotonic() < deadline, "no pause at 12"
            time.sleep(0.1)
        os.kill(trainer_rank_pids(process.pid)[1], signal.SIGKILL)
        returncode = process.wait(timeout=90)
    finally:
        _stop(process)
    assert returncode == 128 + signal.SIGKILL
    finished = finish_attempt(
        ledger, prepared, store=store, returncode=returncode, signal_name=None
    )
    attempt = finished.attempt
    assert attempt.signal == "SIGKILL", attempt.termination_detail
    assert "Rank 1 failed first" in attempt.termination_detail, attempt.termination_detail
    newest = ledger.latest_committed_checkpoint(run_id)
    assert newest is not None and newest.step == 10
    assert _said_committed(attempt.termination_detail) == [newest.step], attempt.termination_detail
    assert attempt.last_step == 12
    assert attempt.placement["fault_hooks"] == hooks, attempt.placement  # the trainer's own


@pytest.mark.slow
def test_a_real_attempt_fenced_out_by_a_newer_one_says_so_and_the_run_goes_on(
    tracks_home: Path,
) -> None:
    ledger, prepared, settings, snapshot = _prepared_run(max_steps=60, every=5)
    run_id, store = prepared.run.run_id, settings.checkpoint_root
    writing = store / run_id / "step-0000000010-a01"
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.trainer", *prepared.trainer_args(store)],
        cwd=REPO,
        # The commit of step 10 waits: attempt 2 begins in between and takes the token.
        env={**os.environ, **prepared.trainer_env(ledger.url),
             "TRACKS_FAULT_SLEEP_BEFORE_COMMIT": "4@10"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (writing / "MANIFEST.json").is_file():
            assert process.poll() is None and time.monotonic() < deadline, "no write at step 10"
            time.sleep(0.05)
        newer = prepare_attempt(
            ledger, snapshot=snapshot, train_config=prepared.train_config,
            work_root=settings.work_root, run_id=run_id,
            launched_by={"via": "sensor:resume_training"},
        )  # fmt: skip
        returncode = process.wait(timeout=90)
    finally:
        _stop(process)
    assert returncode == exit_codes.FENCED
    finished = finish_attempt(
        ledger, prepared, store=store, returncode=returncode, signal_name=None
    )
    fenced = finished.attempt
    assert fenced.termination_reason == TerminationReason.FENCED, fenced.termination_detail
    assert f"attempt {newer.attempt.attempt_no} (launched by sensor:resume_training)" in (
        fenced.termination_detail
    )
    assert "cancel" not in fenced.termination_detail.lower()
    assert finished.decision.action == RetryAction.NEWER_ATTEMPT
    # The newer attempt carries the run: it is not failed, and no budget stops it.
    assert ledger.get_run(run_id).status == RunStatus.RUNNING
    assert (
        decide(load_retry_policy(None), ledger.attempts(run_id), fenced).action
        == RetryAction.NEWER_ATTEMPT
    )
    # Its lost steps, reached past its own last commit, are counted under fenced.
    own = max(c.step for c in ledger.checkpoints(run_id) if c.attempt_no == 1 and c.committed_at)
    assert fenced.last_step is not None and fenced.last_step > own
    family = prepared.run.model_family
    assert ledger.cost_by_reason_lost_steps(family, 1) == {"fenced": fenced.last_step - own}
    shown = CliRunner().invoke(tracks, ["cost", "--family", family, "--days", "1"])
    assert shown.exit_code == 0, shown.output
    assert f"fenced {fenced.last_step - own}" in shown.output.splitlines()[-1], shown.output
