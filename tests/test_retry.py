"""Reason-aware retry budgets: each reason spends its own count and GPU-seconds per run."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from pipeline.ledger import AttemptRecord, AttemptStart, CheckpointRecord, EvaluationRecord, Ledger
from pipeline.retry import (
    Backoff,
    RetryAction,
    RetryDecision,
    RetryPolicy,
    RetryPolicyError,
    decide,
    decide_evaluation,
    load_retry_policy,
    policy_for_run,
    record_decision,
    split_retry_policy,
)
from pipeline.states import CheckpointState
from pipeline.states import TerminationReason as R

CONFIG: dict[str, Any] = {
    "batch_size": 128,
    "learning_rate": 0.003,
    "model": {"channels": 16, "hidden": 64},
    "device": "cuda",
}


def _attempt(
    n: int, reason: R | str, *, gpu: float = 0.0, config: dict[str, Any] | None = None
) -> AttemptRecord:
    now = datetime(2026, 11, 20, tzinfo=UTC) + timedelta(hours=n)
    return AttemptRecord(
        run_id="run-b", attempt_no=n, model_family="digits-cnn", dagster_run_id=None,
        started_at=now, heartbeat_at=now, ended_at=now + timedelta(minutes=30), status="failed",
        termination_reason=str(reason), termination_detail="", exit_code=None, signal=None,
        config_snapshot=config or CONFIG, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
        container_digest="env", placement={}, code_commit=None, gpu_seconds=gpu,
        cpu_seconds=0.0, last_step=None, resumed_from_checkpoint=None, fencing_token=n,
        retry_decision=None,
    )  # fmt: skip


def _history(*reasons: R, gpu: float = 0.0) -> list[AttemptRecord]:
    return [_attempt(i, r, gpu=gpu) for i, r in enumerate(reasons, start=1)]


def _checkpoint(step: int, attempt_no: int = 1, state: str = "committed") -> CheckpointRecord:
    return CheckpointRecord(
        path=f"/ckpt/run-b/step-{step:010d}-a{attempt_no:02d}", run_id="run-b",
        attempt_no=attempt_no, step=step, manifest_sha256="m" * 64, state=state,
        state_detail=None, bytes=1, created_at=datetime.now(UTC), committed_at=datetime.now(UTC),
        metrics=None, parent_path=None, fencing_token=attempt_no,
    )  # fmt: skip


def test_each_reason_spends_only_its_own_count_budget() -> None:
    policy = RetryPolicy.default()  # preempted: 5
    history = _history(R.PREEMPTED, R.INFRA_TRANSIENT, R.PREEMPTED, R.INFRA_TRANSIENT, R.PREEMPTED)
    third_preemption = decide(policy, history, history[-1])
    assert third_preemption.action == RetryAction.RESUME
    assert third_preemption.rule == "preempted_resume"
    assert third_preemption.spent == {"count": 3, "gpu_seconds": 0.0}
    assert third_preemption.budget_left == {"count": 2, "gpu_seconds": None}
    second_transient = decide(policy, history, history[3])
    assert second_transient.spent["count"] == 2
    assert second_transient.budget_left["count"] == 1


def test_budget_exhausted_stops_with_a_sentence_naming_the_count_budget() -> None:
    history = _history(*[R.PREEMPTED] * 6)
    fifth = decide(RetryPolicy.default(), history, history[4])
    assert fifth.action == RetryAction.RESUME and fifth.budget_left["count"] == 0
    sixth = decide(RetryPolicy.default(), history, history[5])
    assert sixth.action == RetryAction.STOP
    assert sixth.rule == "preempted_budget_spent"
    assert sixth.reason == (
        "Stop: attempt 6 is the 6th of this run to end preempted, and the preempted budget "
        "allows 5 attempt(s); the count budget is spent."
    )


def test_gpu_seconds_budget_is_spent_per_reason() -> None:
    policy = load_retry_policy({"infra_transient": {"max_gpu_seconds": 1000}})
    history = [
        _attempt(1, R.INFRA_TRANSIENT, gpu=600),
        _attempt(2, R.PREEMPTED, gpu=50_000),  # a different reason's spend does not count
        _attempt(3, R.INFRA_TRANSIENT, gpu=600),
    ]
    first = decide(policy, history, history[0])
    assert first.action == RetryAction.RETRY
    assert first.budget_left == {"count": 2, "gpu_seconds": 400.0}
    second = decide(policy, history, history[2])
    assert second.action == RetryAction.STOP
    assert second.rule == "infra_transient_gpu_budget_spent"
    assert "burned 1200 GPU-seconds" in second.reason
    assert "budget of 1000 GPU-seconds; the GPU-seconds budget is spent" in second.reason
    assert second.budget_left == {"count": 1, "gpu_seconds": 0.0}


def test_infra_transient_backoff_grows_and_is_capped() -> None:
    policy = load_retry_policy(
        {"infra_transient": {"max_attempts": 6, "backoff": {"initial_seconds": 30}}}
    )  # max 600, multiplier 2 from the defaults
    history = _history(*[R.INFRA_TRANSIENT] * 6)
    waits = [decide(policy, history, a).backoff_seconds for a in history]
    assert waits == [30, 60, 120, 240, 480, 600]
    assert "Retry after 60s" in decide(policy, history, history[1]).reason
    assert Backoff(initial_seconds=0).delay(3) == 0.0


def test_oom_with_an_unchanged_config_stops() -> None:
    ended = _attempt(1, R.OOM)
    for next_config in (None, dict(CONFIG), {**CONFIG, "learning_rate": 0.001}):
        decision = decide(RetryPolicy.default(), [ended], ended, next_config)
        assert decision.action == RetryAction.STOP
        assert decision.rule == "oom_config_unchanged"
        assert "changes nothing that bears on memory" in decision.reason


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"batch_size": 64}, "batch_size: 128 → 64"),
        ({"activation_checkpointing": True}, "activation_checkpointing: None → True"),
        ({"device": "cpu"}, "device: 'cuda' → 'cpu'"),
    ],
)
def test_oom_with_a_memory_relevant_change_retries_fresh(change: dict[str, Any], said: str) -> None:
    ended = _attempt(1, R.OOM)
    decision = decide(RetryPolicy.default(), [ended], ended, {**CONFIG, **change})
    assert decision.action == RetryAction.RETRY
    assert decision.rule == "oom_config_changed"
    assert said in decision.reason
    assert decision.resume_from is None  # a checkpoint is bound to its config sha256


def test_oom_budget_still_applies_to_changed_configs() -> None:
    history = [_attempt(n, R.OOM, config={**CONFIG, "batch_size": 256 >> n}) for n in (1, 2, 3)]
    smaller = {**CONFIG, "batch_size": 8}
    assert decide(RetryPolicy.default(), history, history[1], smaller).action == RetryAction.RETRY
    third = decide(RetryPolicy.default(), history, history[2], smaller)
    assert (third.action, third.rule) == (RetryAction.STOP, "oom_budget_spent")


def test_diverged_rolls_back_once_to_an_earlier_checkpoint_then_stops() -> None:
    checkpoints = [_checkpoint(100), _checkpoint(200), _checkpoint(300, state="superseded")]
    history = _history(R.DIVERGED, R.DIVERGED)
    first = decide(RetryPolicy.default(), history, history[0], checkpoints=checkpoints)
    assert first.action == RetryAction.ROLLBACK
    assert first.rule == "diverged_rollback_once"
    assert first.resume_from == checkpoints[0].path  # before the newest committed one
    assert decide(RetryPolicy.default(), history, history[0]).resume_from == "previous committed"
    second = decide(RetryPolicy.default(), history, history[1], checkpoints=checkpoints)
    assert (second.action, second.rule) == (RetryAction.STOP, "diverged_budget_spent")


def test_hung_resumes_from_the_newest_commit_on_its_own_budget_then_stops() -> None:
    """A hang spends the hung budget (3 by default), never the preemptions' or a policy's other
    reasons; each one resumes from the newest committed checkpoint, at once."""
    checkpoints = [_checkpoint(100), _checkpoint(200)]
    history = _history(R.HUNG, R.PREEMPTED, R.HUNG, R.HUNG, R.HUNG)
    first = decide(RetryPolicy.default(), history, history[0], checkpoints=checkpoints)
    assert (first.action, first.rule) == (RetryAction.RESUME, "hung_resume")
    assert first.resume_from == checkpoints[-1].path and first.backoff_seconds == 0
    assert "hung (a rank's watchdog saw no step finish" in first.reason
    assert first.budget_left == {"count": 2, "gpu_seconds": None}
    third = decide(RetryPolicy.default(), history, history[3], checkpoints=checkpoints)
    assert (third.action, third.spent["count"]) == (RetryAction.RESUME, 3)
    fourth = decide(RetryPolicy.default(), history, history[4], checkpoints=checkpoints)
    assert (fourth.action, fourth.rule) == (RetryAction.STOP, "hung_budget_spent")
    once = RetryPolicy.from_mapping({"hung": {"max_attempts": 1}})
    assert decide(once, history, history[2]).rule == "hung_budget_spent"
    assert once.to_json()["preempted"]["max_attempts"] == 5  # the others keep their defaults


@pytest.mark.parametrize("reason", [R.BAD_INPUT, R.USER_CODE_ERROR, R.CANCELLED])
def test_bad_input_user_code_error_and_cancelled_stop_at_once(reason: R) -> None:
    ended = _attempt(1, reason)
    decision = decide(RetryPolicy.default(), [ended], ended, {**CONFIG, "batch_size": 1})
    assert (decision.action, decision.rule) == (RetryAction.STOP, f"{reason}_stops")
    assert decision.budget_left == {"count": 0, "gpu_seconds": 0.0}


def test_evaluator_crash_retries_the_evaluator_never_the_training() -> None:
    ended = _attempt(1, R.EVALUATOR_CRASH)
    decision = decide(RetryPolicy.default(), [ended], ended)
    assert decision.action == RetryAction.RETRY_EVALUATOR
    assert "never the training" in decision.reason

    def evaluation(i: int, reason: str | None) -> EvaluationRecord:
        return EvaluationRecord(
            evaluation_id=f"e{i}", run_id="run-b", attempt_no=1, checkpoint_path="/c",
            checkpoint_manifest_sha256="m" * 64, evaluator_name="holdout_accuracy",
            evaluator_version="1", evaluator_env_digest="env", task_set_version="t",
            decoding_params={}, judge_model="n/a", rubric_version="n/a",
            status="failed" if reason else "complete", termination_reason=reason,
            started_at=datetime(2026, 11, 20, tzinfo=UTC) + timedelta(minutes=i),
        )  # fmt: skip

    crashes = [evaluation(i, "evaluator_crash") for i in range(3)]
    first = decide_evaluation(RetryPolicy.default(), crashes, crashes[0])
    assert (first.action, first.backoff_seconds) == (RetryAction.RETRY_EVALUATOR, 10)
    assert decide_evaluation(RetryPolicy.default(), crashes, crashes[1]).backoff_seconds == 20
    third = decide_evaluation(RetryPolicy.default(), crashes, crashes[2])
    assert (third.action, third.rule) == (RetryAction.STOP, "evaluator_crash_budget_spent")
    done = decide_evaluation(RetryPolicy.default(), crashes, evaluation(4, None))
    assert done.action == RetryAction.NONE


def test_succeeded_needs_nothing_and_a_running_attempt_cannot_be_decided() -> None:
    ended = _attempt(1, R.SUCCEEDED)
    assert decide(RetryPolicy.default(), [ended], ended).action == RetryAction.NONE
    running = AttemptRecord(**{**ended.__dict__, "termination_reason": None})
    with pytest.raises(ValueError, match="run-b#1 has not ended"):
        decide(RetryPolicy.default(), [running], running)


def test_decision_json_round_trips() -> None:
    ended = _attempt(1, R.PREEMPTED, gpu=10)
    decision = decide(RetryPolicy.default(), [ended], ended, checkpoints=[_checkpoint(100)])
    data = json.loads(json.dumps(decision.to_json()))
    assert set(data) >= {"action", "rule", "reason", "budget_left", "backoff_seconds"}
    assert data["resume_from"] == "/ckpt/run-b/step-0000000100-a01"
    assert RetryDecision.from_json(data) == decision


def test_policy_yaml_section_fills_gaps_from_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "batch_size: 64\n"
        "retry_policy:\n"
        "  preempted: {max_attempts: 2, max_gpu_seconds: 36000}\n"
        "  infra_transient:\n"
        "    backoff: {initial_seconds: 5, max_seconds: 40}\n"
        "  oom_memory_keys: [batch_size]\n"
    )
    policy = load_retry_policy(path)
    assert policy.budgets[R.PREEMPTED].max_attempts == 2
    assert policy.budgets[R.PREEMPTED].max_gpu_seconds == 36000
    assert policy.budgets[R.INFRA_TRANSIENT].max_attempts == 3  # default kept
    assert policy.budgets[R.INFRA_TRANSIENT].backoff == Backoff(5, 40, 2)
    assert policy.oom_memory_keys == ("batch_size",)
    assert RetryPolicy.from_json(policy.to_json()) == policy
    assert load_retry_policy(None) == RetryPolicy.default()
    rest, same = split_retry_policy(
        {"batch_size": 64, "retry_policy": {"oom": {"max_attempts": 1}}}
    )
    assert rest == {"batch_size": 64} and same.budgets[R.OOM].max_attempts == 1


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"preemted": {"max_attempts": 1}}, r"retry_policy\.preemted: unknown key"),
        ({"oom": {"max_attemps": 1}}, r"retry_policy\.oom\.max_attemps: unknown key"),
        ({"bad_input": {"max_attempts": 3}}, r"bad_input always stops"),
        ({"timeout": {"max_attempts": -1}}, r"retry_policy\.timeout\.max_attempts: must be"),
        ({"timeout": {"backoff": {"initial": 1}}}, r"timeout\.backoff\.initial: unknown key"),
    ],
)
def test_a_bad_policy_names_the_file_and_key(
    tmp_path: Path, section: dict[str, Any], message: str
) -> None:
    import yaml

    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"retry_policy": section}))
    with pytest.raises(RetryPolicyError, match=message) as info:
        load_retry_policy(path)
    assert str(path) in str(info.value)


def test_policy_stored_on_the_run_and_decisions_on_the_attempt(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    policy = load_retry_policy({"diverged": {"max_attempts": 1}, "preempted": {"max_attempts": 1}})
    run = ledger.create_run(
        run_id="run-b", model_family="digits-cnn", owner="test", purpose="baseline",
        config_sha256="c" * 64, snapshot_id="s", retry_policy=policy.to_json(),
    )  # fmt: skip
    assert policy_for_run(run) == policy
    start = AttemptStart(
        config_snapshot=CONFIG, config_sha256="c" * 64, data_manifest_sha256="d" * 64,
        container_digest="env",
    )  # fmt: skip
    attempt = ledger.begin_attempt("run-b", start)
    for step in (100, 200, 300):
        ledger.commit_checkpoint(
            run_id="run-b", attempt_no=1, path=f"/ckpt/step-{step}", manifest_sha256="m" * 64,
            size_bytes=1, metrics=None, fencing_token=attempt.fencing_token, step=step,
        )  # fmt: skip
    ended = ledger.end_attempt(
        "run-b", 1, termination_reason=R.DIVERGED, termination_detail="Loss became nan at 350."
    )
    decision = decide(
        policy_for_run(ledger.get_run("run-b")),
        ledger.attempts("run-b"),
        ended,
        checkpoints=ledger.checkpoints("run-b"),
    )
    assert (decision.action, decision.resume_from) == (RetryAction.ROLLBACK, "/ckpt/step-200")
    record_decision(ledger, ended, decision)
    states = {c.path: (c.state, c.state_detail) for c in ledger.checkpoints("run-b")}
    assert states["/ckpt/step-200"][0] == CheckpointState.COMMITTED
    assert states["/ckpt/step-300"][0] == CheckpointState.SUPERSEDED
    assert "rolled back past it to step 200 after attempt 1 diverged" in states["/ckpt/step-300"][1]
    assert ledger.latest_committed_checkpoint("run-b").path == "/ckpt/step-200"
    # Deciding again (a person changed something) keeps the first decision beside the new one.
    again = decide(policy, ledger.attempts("run-b"), ended, checkpoints=[])
    record_decision(ledger, ended, again)
    stored = ledger.get_attempt("run-b", 1).retry_decision
    assert stored["rule"] == "diverged_rollback_once"
    assert stored["previous"]["resume_from"] == "/ckpt/step-200"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("preempted: {backoff: {initial_seconds: .nan}}", "preempted.backoff.initial_seconds"),
        ("preempted: {backoff: {initial_seconds: .inf}}", "preempted.backoff.initial_seconds"),
        ("preempted: {backoff: {initial_seconds: 1.0e+12}}", "preempted.backoff.initial_seconds"),
        ("infra_transient: {backoff: {max_seconds: .inf}}", "infra_transient.backoff.max_seconds"),
        ("infra_transient: {backoff: {max_seconds: 86401}}", "infra_transient.backoff.max_seconds"),
        ("timeout: {backoff: {multiplier: .nan}}", "timeout.backoff.multiplier"),
        ("timeout: {backoff: {multiplier: 101}}", "timeout.backoff.multiplier"),
        ("preempted: {max_attempts: .inf}", "preempted.max_attempts"),
        ("preempted: {max_attempts: .nan}", "preempted.max_attempts"),
        ("preempted: {max_attempts: 1001}", "preempted.max_attempts"),
        ("oom: {max_gpu_seconds: .inf}", "oom.max_gpu_seconds"),
        ("oom: {max_gpu_seconds: 1.0e+12}", "oom.max_gpu_seconds"),
        ("diverged: {max_gpu_seconds: -.inf}", "diverged.max_gpu_seconds"),
    ],
)
def test_a_policy_number_that_is_not_finite_or_past_its_bound_is_refused_by_key(
    text: str, key: str
) -> None:
    import re

    import yaml

    # From run config (YAML text) and from a stored policy alike: both go through one check.
    where = re.escape(f"retry_policy.{key}: must be a number from 0 to")
    with pytest.raises(RetryPolicyError, match=where):
        load_retry_policy(text)
    with pytest.raises(RetryPolicyError, match=f"run r1: {where}"):
        RetryPolicy.from_json(yaml.safe_load(text), source="run r1")


def test_a_policy_at_its_bounds_loads_and_its_longest_wait_is_a_day() -> None:
    policy = load_retry_policy(
        "infra_transient:\n"
        "  max_attempts: 1000\n"
        "  max_gpu_seconds: 31536000\n"
        "  backoff: {initial_seconds: 86400, max_seconds: 0, multiplier: 100}\n"
    )
    backoff = policy.budgets[R.INFRA_TRANSIENT].backoff
    assert policy.budgets[R.INFRA_TRANSIENT].max_attempts == 1000
    # 100**999 is past the float range; the wait is still a day, not an OverflowError.
    assert backoff.delay(1000) == 86400.0
    assert Backoff(initial_seconds=30, max_seconds=0, multiplier=2).delay(30) == 86400.0


def test_run_config_retry_policy_is_inline_yaml_never_a_file(tmp_path: Path) -> None:
    """A string from run config never names a file to read, wherever it points."""
    secret = tmp_path / "policy.yaml"
    secret.write_text("preempted: {max_attempts: 2}\nlearning_rate: hunter2\n")
    for text in (str(secret), "policy.yml", "/etc/passwd", "  ../../etc/tracks.yaml\n"):
        with pytest.raises(RetryPolicyError, match=r"inline YAML.*not a file name") as info:
            load_retry_policy(text)
        assert "hunter2" not in str(info.value)
    # Code may still hand over a file, as a Path.
    given = tmp_path / "given.yaml"
    given.write_text("retry_policy:\n  preempted: {max_attempts: 2}\n")
    assert load_retry_policy(given).budgets[R.PREEMPTED].max_attempts == 2
