"""The termination classifier: evidence in, exactly one reason (and the retry decision) out."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from pipeline.ledger import AttemptRecord, AttemptStart, Ledger, schema
from pipeline.reasons import (
    AttemptEvidence,
    InsufficientEvidenceError,
    ObservedEnding,
    Termination,
    classify,
    classify_exit,
    classify_observed,
    evidence_for_attempt,
    oom_kills_since,
    read_cgroup_oom_kills,
    read_last_words,
)
from pipeline.retry import RetryAction, RetryPolicy, decide
from pipeline.states import TerminationReason as R
from pipeline.trainer import exit_codes

CONFIG = {"batch_size": 64, "learning_rate": 0.003, "max_steps": 600}


def _words(reason: str, detail: str, step: int | None = None, **extra: Any) -> dict[str, Any]:
    return {"reason": reason, "detail": detail, "step": step, **extra}


@dataclass(frozen=True)
class Case:
    name: str
    evidence: AttemptEvidence
    reason: R
    says: str  # a fragment the one sentence must contain (the step, signal or exception)
    action: RetryAction | None  # what the policy does next (with the same config)


CASES = [
    Case(
        "exit_0_is_success",
        AttemptEvidence(exit_code=0, last_committed_step=600),
        R.SUCCEEDED, "step 600", RetryAction.NONE,
    ),
    Case(
        "sigterm_with_last_words_is_preempted",
        AttemptEvidence(
            exit_code=exit_codes.PREEMPTED,
            last_words=_words("preempted", "Stopped on SIGTERM after step 300 of 600", 300),
            last_committed_step=300,
        ),
        R.PREEMPTED, "SIGTERM after step 300", RetryAction.RESUME,
    ),
    Case(
        "sigkill_without_last_words_is_preempted",
        AttemptEvidence(exit_code=-9, signal="SIGKILL", last_committed_step=200),
        R.PREEMPTED, "Killed by SIGKILL", RetryAction.RESUME,
    ),
    Case(
        "exit_137_from_a_container_is_sigkill",
        AttemptEvidence(exit_code=137, last_committed_step=200),
        R.PREEMPTED, "SIGKILL", RetryAction.RESUME,
    ),
    Case(
        "heartbeat_expired_is_preempted",
        AttemptEvidence(
            heartbeat_age_seconds=412, heartbeat_timeout_seconds=120, last_committed_step=500
        ),
        R.PREEMPTED, "heartbeat expired", RetryAction.RESUME,
    ),
    Case(
        "node_lost_is_preempted",
        AttemptEvidence(node_lost=True, last_committed_step=None),
        R.PREEMPTED, "no checkpoint was committed", RetryAction.RESUME,
    ),
    Case(
        "storage_oserror_is_infra_transient",
        AttemptEvidence(
            exit_code=exit_codes.INFRA_TRANSIENT,
            last_words=_words(
                "infra_transient", "OSError at step 40: [Errno 5] Input/output error", 40,
                exception_type="OSError",
            ),
        ),
        R.INFRA_TRANSIENT, "Input/output error", RetryAction.RETRY,
    ),
    Case(
        "nccl_watchdog_timeout_is_infra_transient",
        AttemptEvidence(
            exit_code=1,
            exception_type="RuntimeError",
            exception_message="[Rank 3] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=88, OpType=ALLREDUCE) ran for 600000 ms",
            last_committed_step=800,
        ),
        R.INFRA_TRANSIENT, "Watchdog caught collective operation timeout", RetryAction.RETRY,
    ),
    Case(
        "rendezvous_timeout_is_infra_transient",
        AttemptEvidence(
            exit_code=1,
            exception_type="torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
        ),
        R.INFRA_TRANSIENT, "RendezvousTimeoutError", RetryAction.RETRY,
    ),
    Case(
        "torch_out_of_memory_is_oom",
        AttemptEvidence(
            exit_code=exit_codes.OOM,
            last_words=_words(
                "oom", "OutOfMemoryError at step 250: CUDA out of memory. Tried to allocate "
                "2.00 GiB", 250, exception_type="OutOfMemoryError",
            ),
        ),
        R.OOM, "step 250", RetryAction.STOP,
    ),
    Case(
        "torch_oom_seen_only_as_exception_type_is_oom",
        AttemptEvidence(exit_code=1, exception_type="torch.OutOfMemoryError"),
        R.OOM, "torch.OutOfMemoryError", RetryAction.STOP,
    ),
    Case(
        "sigkill_with_cgroup_oom_kill_is_oom",
        AttemptEvidence(exit_code=-9, signal="SIGKILL", cgroup_oom_kills=1, last_committed_step=90),
        R.OOM, "oom_kill +1", RetryAction.STOP,
    ),
    Case(
        "snapshot_bytes_differ_is_bad_input",
        AttemptEvidence(
            exit_code=exit_codes.BAD_INPUT,
            last_words=_words(
                "bad_input", "SnapshotIntegrityError before the first step: snapshot s differs "
                "from its manifest: train.parquet: sha256 differs",
                exception_type="SnapshotIntegrityError",
            ),
        ),
        R.BAD_INPUT, "SnapshotIntegrityError", RetryAction.STOP,
    ),
    Case(
        "schema_contract_failure_is_bad_input",
        AttemptEvidence(
            exit_code=1,
            exception_type="pandera.errors.SchemaError",
            exception_message="column 'label' not in dataframe",
        ),
        R.BAD_INPUT, "column 'label'", RetryAction.STOP,
    ),
    Case(
        "nan_loss_is_diverged",
        AttemptEvidence(
            exit_code=exit_codes.DIVERGED,
            last_words=_words("diverged", "Loss became nan at step 412; stopped early", 412),
        ),
        R.DIVERGED, "nan at step 412", RetryAction.ROLLBACK,
    ),
    Case(
        "floating_point_error_is_diverged",
        AttemptEvidence(exit_code=1, exception_type="FloatingPointError", exception_message="inf"),
        R.DIVERGED, "FloatingPointError", RetryAction.ROLLBACK,
    ),
    Case(
        "max_wall_seconds_reached_is_timeout",
        AttemptEvidence(
            exit_code=exit_codes.TIMEOUT,
            last_words=_words("timeout", "Reached max_wall_seconds=3600 at step 410 of 600", 410),
        ),
        R.TIMEOUT, "step 410", RetryAction.RESUME,
    ),
    Case(
        "killed_past_the_wall_clock_limit_is_timeout",
        AttemptEvidence(
            exit_code=-15, signal="SIGTERM", wall_seconds=3700, max_wall_seconds=3600,
            last_committed_step=400,
        ),
        R.TIMEOUT, "wall-clock limit of 3600s", RetryAction.RESUME,
    ),
    Case(
        "evaluator_exception_is_evaluator_crash",
        AttemptEvidence(
            exit_code=1, evaluator="holdout_accuracy", exception_type="ValueError",
            exception_message="logits have shape (16, 9), expected 10 classes",
        ),
        R.EVALUATOR_CRASH, "holdout_accuracy crashed with ValueError", RetryAction.RETRY_EVALUATOR,
    ),
    Case(
        "model_code_exception_is_user_code_error",
        AttemptEvidence(
            exit_code=exit_codes.USER_CODE_ERROR,
            last_words=_words(
                "user_code_error", "KeyError at step 3: 'logits'", 3, exception_type="KeyError"
            ),
        ),
        R.USER_CODE_ERROR, "KeyError at step 3", RetryAction.STOP,
    ),
    Case(
        "segfault_is_user_code_error",
        AttemptEvidence(exit_code=-11, signal="SIGSEGV", last_committed_step=10),
        R.USER_CODE_ERROR, "SIGSEGV", RetryAction.STOP,
    ),
    Case(
        "unknown_exit_code_is_user_code_error",
        AttemptEvidence(exit_code=3),
        R.USER_CODE_ERROR, "exit code 3", RetryAction.STOP,
    ),
    Case(
        "a_person_cancelling_is_cancelled",
        AttemptEvidence(exit_code=exit_codes.PREEMPTED, cancelled=True, last_committed_step=120),
        R.CANCELLED, "step 120", RetryAction.STOP,
    ),
    Case(
        "fenced_by_a_newer_attempt_is_fenced_and_the_newer_attempt_carries_on",
        AttemptEvidence(exit_code=exit_codes.FENCED, newer_attempt={"attempt_no": 3, "via": "ui"}),
        R.FENCED, "by attempt 3 (launched by ui)", RetryAction.NEWER_ATTEMPT,
    ),
    Case(
        "a_rank_its_watchdog_saw_stuck_is_hung_and_resumed",
        AttemptEvidence(
            exit_code=exit_codes.HUNG,
            last_words=_words(
                "hung", "Rank 1 hung in data loading (loading the batch) at step 57 for 6.2 s "
                "(threshold max(5 \u00d7 p99 0.04 s, floor 3 s) = 3 s); top frames: read "
                "(loader.py:12). Rank 0 waited for it in compute at step 57", 56,
            ),
            last_committed_step=50,
        ),
        R.HUNG, "Rank 1 hung in data loading", RetryAction.RESUME,
    ),
    Case(
        "exit_81_without_last_words_is_hung",
        AttemptEvidence(exit_code=exit_codes.HUNG, last_committed_step=50),
        R.HUNG, "code 81 (finished no step past its hang watchdog's threshold)",
        RetryAction.RESUME,
    ),
]  # fmt: skip


def test_the_table_covers_every_termination_reason() -> None:
    assert {case.reason for case in CASES} == set(R)


def _ended(reason: R, *, attempt_no: int = 1, gpu_seconds: float = 0.0) -> AttemptRecord:
    now = datetime.now(UTC)
    return AttemptRecord(
        run_id="run-r", attempt_no=attempt_no, model_family="digits-cnn", dagster_run_id=None,
        started_at=now - timedelta(hours=1), heartbeat_at=now, ended_at=now, status="failed",
        termination_reason=str(reason), termination_detail="", exit_code=None, signal=None,
        config_snapshot=dict(CONFIG), config_sha256="c" * 64, data_manifest_sha256="d" * 64,
        container_digest="env:sha256:test", placement={}, code_commit=None,
        gpu_seconds=gpu_seconds, cpu_seconds=0.0, last_step=None, resumed_from_checkpoint=None,
        fencing_token=attempt_no, retry_decision=None,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_evidence_gives_one_reason_one_sentence_and_a_decision(case: Case) -> None:
    termination = classify(case.evidence)
    assert termination.reason == case.reason
    assert case.says in termination.detail
    assert termination.detail.endswith(".") and "\n" not in termination.detail
    decision = decide(RetryPolicy.default(), [], _ended(termination.reason), next_config=None)
    assert decision.action == case.action
    assert decision.termination_reason == case.reason


def test_last_words_that_contradict_the_exit_code_lose_to_it() -> None:
    stale = _words("user_code_error", "KeyError at step 3", 3)
    termination = classify(AttemptEvidence(exit_code=exit_codes.OOM, last_words=stale))
    assert termination.reason == R.OOM
    assert "code 77" in termination.detail


def test_last_words_win_over_torchruns_generic_exit_1() -> None:
    words = _words("preempted", "Stopped on SIGTERM after step 80 of 600 (rank 0)", 80)
    assert classify(AttemptEvidence(exit_code=1, last_words=words)).reason == R.PREEMPTED


def test_hung_words_under_a_stop_exit_code_lose_to_it() -> None:
    """A rank whose watchdog wrote hung but whose attempt exited 75 (every rank saved on a
    SIGTERM that reached them): the exit code is what happened to the attempt."""
    termination = classify(
        AttemptEvidence(
            exit_code=exit_codes.PREEMPTED,
            last_words=_words("hung", "Rank 0 hung in data loading at step 9", 8),
            last_committed_step=5,
        )
    )
    assert termination.reason == R.PREEMPTED


def test_sigkill_after_last_words_keeps_their_reason_and_says_so() -> None:
    words = _words("preempted", "Stopped on SIGTERM after step 300 of 600", 300)
    termination = classify(AttemptEvidence(exit_code=-9, signal="SIGKILL", last_words=words))
    assert termination.reason == R.PREEMPTED
    assert "killed by SIGKILL" in termination.detail


def test_an_attempt_with_a_fresh_heartbeat_and_no_exit_is_not_classified() -> None:
    alive = AttemptEvidence(heartbeat_age_seconds=3, heartbeat_timeout_seconds=120)
    with pytest.raises(InsufficientEvidenceError, match="has not visibly ended"):
        classify(alive)


def test_classify_exit_keeps_the_call_the_training_asset_makes(tmp_path: Path) -> None:
    path = tmp_path / "attempt-2.last_words.json"
    path.write_text('{"reason": "oom", "detail": "OutOfMemoryError at step 7: CUDA", "step": 7}')
    words = read_last_words(path)
    assert read_last_words(tmp_path / "missing.json") is None
    oom = classify_exit(returncode=77, signal_name=None, last_words=words, last_committed_step=5)
    assert (oom.reason, oom.detail) == (R.OOM, "OutOfMemoryError at step 7: CUDA.")
    cancelled = classify_exit(
        returncode=-1, signal_name=None, last_words=None, cancelled=True, last_committed_step=40
    )
    assert cancelled.reason == R.CANCELLED and "step 40" in cancelled.detail
    killed = classify_exit(
        returncode=-9, signal_name="SIGKILL", last_words=None, cgroup_oom_kills=2
    )
    assert killed.reason == R.OOM


def test_cgroup_oom_counter_is_read_from_memory_events(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 17\noom 3\noom_kill 2\noom_group_kill 0\n")
    assert read_cgroup_oom_kills(events) == 2
    before = read_cgroup_oom_kills(events)
    events.write_text("low 0\nhigh 0\nmax 19\noom 4\noom_kill 3\noom_group_kill 0\n")
    kills = oom_kills_since(before, events)
    assert kills == 1
    termination = classify(AttemptEvidence(signal="SIGKILL", exit_code=-9, cgroup_oom_kills=kills))
    assert termination.reason == R.OOM
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert read_cgroup_oom_kills(v1) == 5
    assert read_cgroup_oom_kills(tmp_path / "absent") is None
    assert oom_kills_since(None, events) is None


def test_a_silent_attempt_in_the_ledger_is_preempted_heartbeat_expired(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.create_run(
        run_id="run-silent", model_family="digits-cnn", owner="test", purpose="baseline",
        config_sha256="c" * 64, snapshot_id="digits-0123",
    )  # fmt: skip
    start = AttemptStart(
        config_snapshot={**CONFIG, "max_wall_seconds": 7200}, config_sha256="c" * 64,
        data_manifest_sha256="d" * 64, container_digest="env:sha256:test",
    )  # fmt: skip
    ledger.begin_attempt("run-silent", start)
    ledger.heartbeat("run-silent", 1, step=350)
    quiet_since = datetime.now(UTC) - timedelta(minutes=10)
    with ledger.engine.begin() as conn:
        conn.execute(sa.update(schema.training_attempts).values(heartbeat_at=quiet_since))
    assert ledger.silent_attempts(heartbeat_timeout_seconds=3600) == []
    (silent,) = ledger.silent_attempts(heartbeat_timeout_seconds=300)
    evidence = evidence_for_attempt(silent, heartbeat_timeout_seconds=300)
    assert evidence.max_wall_seconds == 7200 and evidence.step_reached == 350
    assert evidence.last_committed_step is None  # a heartbeat's step is reached, not committed
    termination = classify(evidence)
    assert termination.reason == R.PREEMPTED
    assert "heartbeat expired: none for 600s (timeout 300s)" in termination.detail
    assert "step 350" in termination.detail


# -- no URL password in a termination sentence ----------------------------------------------------

LEAKY_URL = "postgresql://tracks:hunter2@db/ledger"


def test_last_words_contradicted_by_the_exit_code_quote_no_password() -> None:
    # The reported leak: last words say infra_transient, exit 65 says bad input, so the sentence
    # is built from the raw exception message the words carried (written by an older trainer).
    words = {
        "reason": "infra_transient",
        "detail": f"the ledger at {LEAKY_URL} went away",
        "exception_type": "OperationalError",
        "exception_message": f"could not connect to {LEAKY_URL}: connection refused",
    }
    termination = classify_exit(returncode=65, signal_name=None, last_words=words)
    assert termination.reason == R.BAD_INPUT
    assert "OperationalError" in termination.detail
    assert "hunter2" not in termination.detail
    assert "postgresql://tracks:***@db/ledger" in termination.detail


def test_a_long_message_is_redacted_before_the_sentence_cuts_it() -> None:
    # 300 characters are kept: the cut falls between the password and its '@'.
    message = "x" * 272 + f" {LEAKY_URL}"
    assert message.index("@") == 300 and message[:300].endswith("hunter2")
    raised = {"exit_code": 1, "exception_type": "RuntimeError", "exception_message": message}
    assert "hunter2" not in classify(AttemptEvidence(**raised)).detail
    termination = classify(AttemptEvidence(**raised, evaluator="probe"))
    assert termination.reason == R.EVALUATOR_CRASH
    assert "hunter2" not in termination.detail


def test_last_words_detail_and_a_platform_verdict_quote_no_password() -> None:
    words = {"reason": "infra_transient", "detail": f"lost the ledger at {LEAKY_URL}"}
    said = classify_exit(returncode=exit_codes.INFRA_TRANSIENT, signal_name=None, last_words=words)
    assert said.reason == R.INFRA_TRANSIENT
    assert "hunter2" not in said.detail and "tracks:***@db" in said.detail

    observed = ObservedEnding(
        AttemptEvidence(exit_code=1),
        Termination(R.OOM, f"OOMKilled while reading {LEAKY_URL}"),
        decisive=True,
    )
    assert "hunter2" not in classify_observed(observed, AttemptEvidence()).detail
    # Not decisive, and nothing else known: the platform's verdict is returned as it stands.
    silent = ObservedEnding(AttemptEvidence(), Termination(R.PREEMPTED, f"lost {LEAKY_URL}"))
    assert "hunter2" not in classify_observed(silent, AttemptEvidence()).detail
