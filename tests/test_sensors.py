"""Sensors and the schedule, evaluated with Dagster's build_*_context against real stores."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets.data import data_snapshot
from definitions import _resources
from pipeline.data.landing import Drift, write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from pipeline.ledger import Ledger
from pipeline.retry import RetryPolicy
from pipeline.settings import TracksSettings
from pipeline.states import RunStatus, TerminationReason
from resources import StorageResource
from sensors import snapshots
from sensors.schedules import newest_checked_snapshots, nightly_retrain
from sensors.snapshots import new_snapshot
from tests.sensor_support import ended_attempt, resume_tick, silent_attempt


@pytest.fixture
def settings(tracks_home: Path) -> TracksSettings:
    s = TracksSettings.from_env()
    s.ensure_dirs()
    return s


def _storage(settings: TracksSettings) -> StorageResource:
    return _resources(settings)["storage"]  # type: ignore[return-value]


def _age(path: Path, seconds: float = 60) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_new_snapshot_registers_partition_and_requests_one_run(settings: TracksSettings) -> None:
    storage = _storage(settings)
    with dg.instance_for_test() as instance:
        empty = new_snapshot(
            dg.build_sensor_context(instance=instance, resources={"storage": storage})
        )
        assert isinstance(empty, dg.SkipReason) and "no landing files" in empty.skip_message

        _age(write_digits_landing(settings.landing_root))
        snapshot_id = snapshot_id_for(settings.landing_root)
        with dg.build_sensor_context(instance=instance, resources={"storage": storage}) as context:
            result = new_snapshot(context)
        assert isinstance(result, dg.SensorResult)
        [request] = result.run_requests
        assert request.partition_key == snapshot_id and request.run_key == snapshot_id
        [add] = result.dynamic_partitions_requests
        assert list(add.partition_keys) == [snapshot_id]

        # Same files on the next tick: nothing to do.
        again = new_snapshot(
            dg.build_sensor_context(
                instance=instance, cursor=result.cursor, resources={"storage": storage}
            )
        )
        assert isinstance(again, dg.SkipReason)


def test_new_snapshot_waits_for_landing_files_to_settle(
    settings: TracksSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window no loaded machine outlasts between writing the file and the tick (2 s did).
    monkeypatch.setattr(
        snapshots, "AUTOMATION", replace(snapshots.AUTOMATION, landing_settle_seconds=600.0)
    )
    write_digits_landing(settings.landing_root)  # mtime is now
    with dg.instance_for_test() as instance:
        result = new_snapshot(
            dg.build_sensor_context(instance=instance, resources={"storage": _storage(settings)})
        )
    assert isinstance(result, dg.SkipReason) and "settle" in result.skip_message


def test_preempted_attempt_is_resumed_once_with_the_same_run(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, TerminationReason.PREEMPTED)
    result = resume_tick(ledger)
    assert isinstance(result, dg.SensorResult)
    [request] = result.run_requests
    assert request.run_key == "r1:attempt-2"
    assert request.partition_key == "digits-00000000000000aa"
    assert request.run_config["ops"]["training_attempt"]["config"] == {"run_id": "r1"}
    assert request.tags["tracks/decision"] == "resume"
    # The run key is stable across ticks: Dagster launches it once.
    [again] = resume_tick(ledger).run_requests  # type: ignore[union-attr]
    assert again.run_key == request.run_key


def test_no_resume_when_the_budget_is_zero_and_the_attempt_says_why(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    policy = RetryPolicy.from_json({"preempted": {"max_attempts": 0}})
    ended_attempt(ledger, TerminationReason.PREEMPTED, policy=policy)
    assert isinstance(resume_tick(ledger), dg.SkipReason)
    attempt = ledger.get_attempt("r1", 1)
    assert attempt.retry_decision["action"] == "stop"
    assert "budget" in attempt.retry_decision["reason"]
    assert ledger.get_run("r1").status == RunStatus.FAILED


@pytest.mark.parametrize(
    "reason",
    [TerminationReason.BAD_INPUT, TerminationReason.USER_CODE_ERROR, TerminationReason.SUCCEEDED],
)
def test_stopping_reasons_are_never_resumed(tmp_path: Path, reason: TerminationReason) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, reason)
    assert isinstance(resume_tick(ledger), dg.SkipReason)


def test_silent_attempt_is_closed_as_preempted_and_resumed(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    silent_attempt(ledger)  # its heartbeat is an hour old: the node is gone
    result = resume_tick(ledger)
    attempt = ledger.get_attempt("r1", 1)
    assert attempt.termination_reason == "preempted"
    assert "heartbeat" in attempt.termination_detail
    assert isinstance(result, dg.SensorResult)
    assert [r.run_key for r in result.run_requests] == ["r1:attempt-2"]


def test_silent_attempt_is_closed_with_the_reason_its_last_words_give(tmp_path: Path) -> None:
    """A trainer that lost the ledger wrote `infra_transient` to disk: that is its story."""
    import json

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    silent_attempt(ledger)
    words = tmp_path / "tracks" / "checkpoints" / "r1" / "attempt-1.last_words.json"
    words.parent.mkdir(parents=True)
    words.write_text(json.dumps({
        "run_id": "r1", "attempt_no": 1, "reason": "infra_transient", "exit_code": 74,
        "step": 140, "signal": None, "detail": "the ledger stayed unreachable for 60 s",
        "exception_type": "OperationalError", "exception_module": "sqlalchemy.exc",
        "exception_message": "the database system is shutting down",
    }))  # fmt: skip
    resume_tick(ledger)
    attempt = ledger.get_attempt("r1", 1)
    assert attempt.termination_reason == "infra_transient", attempt.termination_detail
    assert attempt.last_step == 140


def test_one_bad_continuation_does_not_hold_up_the_others(tmp_path: Path) -> None:
    """A CLI run's snapshot in the store becomes a partition; one found nowhere is skipped."""
    from pipeline.data.snapshot import create_snapshot

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    root = tmp_path / "tracks"
    write_digits_landing(root / "landing")
    cli_snapshot = create_snapshot(root / "landing", root / "snapshots").snapshot_id
    ended_attempt(ledger, TerminationReason.PREEMPTED, run_id="from-cli")
    ended_attempt(ledger, TerminationReason.PREEMPTED, run_id="nowhere")
    ended_attempt(ledger, TerminationReason.PREEMPTED, run_id="dagster")
    import sqlalchemy as sa

    from pipeline.ledger.schema import training_runs

    with ledger.engine.begin() as conn:
        for run_id, snapshot in (
            ("from-cli", cli_snapshot),
            ("nowhere", "digits-00000000000000bb"),
        ):
            conn.execute(
                sa.update(training_runs)
                .where(training_runs.c.run_id == run_id)
                .values(snapshot_id=snapshot)
            )
    result = resume_tick(ledger, root=root)
    assert isinstance(result, dg.SensorResult)
    assert sorted(r.run_key for r in result.run_requests) == [
        "dagster:attempt-2",
        "from-cli:attempt-2",
    ]
    [add] = result.dynamic_partitions_requests
    assert list(add.partition_keys) == [cli_snapshot]


def test_nightly_retrain_picks_each_familys_newest_snapshot_that_passed_its_checks(
    settings: TracksSettings,
) -> None:
    from pipeline.textlm.landing import write_text_landing

    resources = _resources(settings)
    good_dir, text_dir, bad_dir = (settings.home / n for n in ("good", "text", "bad"))
    write_digits_landing(good_dir)
    write_text_landing(text_dir)
    write_digits_landing(bad_dir, drift=Drift.LABEL_OUT_OF_RANGE)
    good, bad = snapshot_id_for(good_dir), snapshot_id_for(bad_dir)
    text = snapshot_id_for(text_dir, family="text-lm")
    with dg.instance_for_test() as instance:
        with dg.build_schedule_context(instance=instance) as context:
            assert isinstance(nightly_retrain(context), dg.SkipReason)
        # The failing digits snapshot is the newest of all: neither family retrains on it.
        for snapshot_id, landing in ((good, good_dir), (text, text_dir), (bad, bad_dir)):
            instance.add_dynamic_partitions("snapshots", [snapshot_id])
            dg.materialize(
                [data_snapshot],
                partition_key=snapshot_id,
                instance=instance,
                resources={"storage": resources["storage"], "ledger": resources["ledger"]},
                run_config={"ops": {"data_snapshot": {"config": {"landing_dir": str(landing)}}}},
                raise_on_error=False,
            )
        assert newest_checked_snapshots(instance) == {"digits-cnn": good, "text-lm": text}
        requests = nightly_retrain(
            dg.build_schedule_context(
                instance=instance, scheduled_execution_time=datetime(2026, 11, 22, 3, 0, tzinfo=UTC)
            )
        )
    assert isinstance(requests, list)
    assert [(r.partition_key, r.run_key) for r in requests] == [
        (good, "nightly:2026-11-22T03:00:digits-cnn"),
        (text, "nightly:2026-11-22T03:00:text-lm"),
    ]
    for request in requests:
        assert request.run_config["ops"]["training_attempt"]["config"]["purpose"] == "scheduled"


def test_a_continuation_runs_with_as_many_ranks_as_the_attempt_it_continues() -> None:
    from types import SimpleNamespace

    from sensors.resume import _continuation_config

    def continuation(placement: dict) -> Any:
        return SimpleNamespace(
            run=SimpleNamespace(run_id="run-1"),
            ended=SimpleNamespace(placement=placement, dagster_run_id=None),
        )

    with dg.instance_for_test() as instance:
        one = _continuation_config(continuation({"world_size": 1}), instance)
        two = _continuation_config(
            continuation({"world_size": 2, "ranks_per_node": 2, "nodes": 1}), instance
        )
    assert one == {"ops": {"training_attempt": {"config": {"run_id": "run-1"}}}}
    assert two["resources"] == {"trainer": {"config": {"backend": "torchrun", "nproc_per_node": 2}}}


def test_a_continuation_runs_on_the_trainer_its_dagster_run_had_or_is_refused(
    tmp_path: Path,
) -> None:
    """Kubernetes and several nodes are carried over from the Dagster run, never guessed."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    on_kube = {"launcher": "kubernetes", "nodes": 2, "ranks_per_node": 4, "world_size": 8}
    trainer = {"config": {"backend": "kubernetes", "nnodes": 2, "nproc_per_node": 4,
                          "image": "registry.example/tracks@sha256:" + "a" * 64}}  # fmt: skip
    runs = [
        dg.DagsterRun(job_name="__ASSET_JOB", run_id="dr-kube",
                      run_config={"resources": {"trainer": trainer}}),
        # Launched on the deployment's own trainer resource: nothing to carry over.
        dg.DagsterRun(job_name="__ASSET_JOB", run_id="dr-local", run_config={}),
    ]  # fmt: skip
    P = TerminationReason.PREEMPTED
    ended_attempt(ledger, P, run_id="kube", placement=on_kube, dagster_run_id="dr-kube")
    ended_attempt(ledger, P, run_id="kube-lost", placement=on_kube, dagster_run_id="dr-gone")
    ended_attempt(ledger, P, run_id="two-nodes", placement={"nodes": 2, "ranks_per_node": 2})
    ended_attempt(
        ledger, P, run_id="local", placement={"nodes": 1, "ranks_per_node": 2},
        dagster_run_id="dr-local",
    )  # fmt: skip
    logged: list[str] = []
    result = resume_tick(ledger, dagster_runs=runs, logged=logged)
    assert isinstance(result, dg.SensorResult)
    requests = {r.run_key: r.run_config.get("resources") for r in result.run_requests}
    assert requests == {
        "kube:attempt-2": {"trainer": trainer},
        "local:attempt-2": {"trainer": {"config": {"backend": "torchrun", "nproc_per_node": 2}}},
    }
    refused = [line for line in logged if ": not launched: " in line]
    assert len(refused) == 2, logged
    assert any(
        line.startswith("kube-lost:attempt-2: not launched: attempt kube-lost#1 ran on Kubernetes")
        and "dr-gone is not on this instance" in line
        for line in refused
    ), refused
    assert any(
        line.startswith("two-nodes:attempt-2: not launched: attempt two-nodes#1 ran on 2 nodes")
        for line in refused
    ), refused


def _corrupt_backoff(ledger: Ledger, run_id: str, seconds: float) -> None:
    """A row edited behind the ledger's back (no ledger method writes such a wait)."""
    import sqlalchemy as sa

    from pipeline.ledger import schema

    stored = dict(ledger.get_attempt(run_id, 1).retry_decision)
    t = schema.training_attempts
    with ledger.engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.run_id == run_id, t.c.attempt_no == 1)
            .values(retry_decision={**stored, "backoff_seconds": seconds})
        )


def test_a_decision_whose_wait_is_no_time_is_skipped_and_the_others_resume(
    tmp_path: Path,
) -> None:
    from pipeline.continuation import pending_continuations

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    for run_id in ("healthy", "nan-wait", "huge-wait", "far-wait"):
        ended_attempt(ledger, TerminationReason.PREEMPTED, run_id=run_id)
    _corrupt_backoff(ledger, "nan-wait", float("nan"))
    _corrupt_backoff(ledger, "huge-wait", 1e300)  # past timedelta
    _corrupt_backoff(ledger, "far-wait", 1e12)  # a timedelta, but past datetime.max
    skipped: list[tuple[str, str]] = []
    pending = pending_continuations(ledger, on_skip=lambda key, why: skipped.append((key, why)))
    assert [c.run_key for c in pending] == ["healthy:attempt-2"]
    assert sorted(key for key, _ in skipped) == [
        "far-wait:attempt-2",
        "huge-wait:attempt-2",
        "nan-wait:attempt-2",
    ]
    assert all("retry decision stored on attempt" in why for _, why in skipped)

    logged: list[str] = []
    result = resume_tick(ledger, logged=logged)
    assert isinstance(result, dg.SensorResult)
    assert [r.run_key for r in result.run_requests] == ["healthy:attempt-2"]
    assert any(line.startswith("nan-wait:attempt-2: not launched: ") for line in logged), logged


def test_a_silent_attempt_of_a_run_whose_stored_policy_does_not_load_stops_alone(
    tmp_path: Path,
) -> None:
    import sqlalchemy as sa

    from pipeline.ledger.schema import training_runs

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    silent_attempt(ledger, run_id="legacy")
    silent_attempt(ledger, run_id="fine")
    with ledger.engine.begin() as conn:
        conn.execute(
            sa.update(training_runs)
            .where(training_runs.c.run_id == "legacy")
            .values(retry_policy={"preempted": {"backoff": {"initial_seconds": 1e12}}})
        )
    result = resume_tick(ledger)
    assert isinstance(result, dg.SensorResult)
    assert [r.run_key for r in result.run_requests] == ["fine:attempt-2"]
    decision = ledger.get_attempt("legacy", 1).retry_decision
    assert decision["action"] == "stop" and decision["rule"] == "retry_policy_unreadable"
    assert "preempted.backoff.initial_seconds" in decision["reason"]
    assert ledger.get_run("legacy").status == RunStatus.FAILED


def test_an_error_that_stops_a_continuation_is_logged_without_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sensors.resume

    def unreachable(instance: dg.DagsterInstance, key: str) -> str:
        raise ConnectionError("postgresql://tracks:hunter2@db.internal/dagster is unreachable")

    monkeypatch.setattr(sensors.resume, "_run_key", unreachable)
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, TerminationReason.PREEMPTED)
    logged: list[str] = []
    assert isinstance(resume_tick(ledger, logged=logged), dg.SkipReason)
    [line] = [line for line in logged if "r1:attempt-2: not launched" in line]
    assert "hunter2" not in line and "db.internal/dagster is unreachable" in line


def test_only_the_sensors_own_runs_use_up_a_continuations_relaunches(tmp_path: Path) -> None:
    """A continuation whose Dagster runs died before opening the attempt is relaunched under a
    fresh key, at most MAX_RELAUNCHES times; runs a person tagged with its key do not count."""
    from sensors.resume import CONTINUATION_TAG, MAX_RELAUNCHES, SENSOR_NAME

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ended_attempt(ledger, TerminationReason.PREEMPTED)
    key = "r1:attempt-2"

    def died(n: int, *, by_sensor: bool) -> dg.DagsterRun:
        tags = {CONTINUATION_TAG: key}
        if by_sensor:
            tags["dagster/sensor_name"] = SENSOR_NAME
        return dg.DagsterRun(
            job_name="__ASSET_JOB", run_id=f"dr-{by_sensor}-{n}", tags=tags,
            status=dg.DagsterRunStatus.FAILURE,
        )  # fmt: skip

    by_hand = [died(n, by_sensor=False) for n in range(5)]
    [request] = resume_tick(ledger, dagster_runs=by_hand).run_requests  # type: ignore[union-attr]
    assert request.run_key == key
    once = [died(0, by_sensor=True)]
    [request] = resume_tick(ledger, dagster_runs=by_hand + once).run_requests  # type: ignore[union-attr]
    assert request.run_key == f"{key}#relaunch-1"
    spent = [died(n, by_sensor=True) for n in range(MAX_RELAUNCHES)]
    assert isinstance(resume_tick(ledger, dagster_runs=spent), dg.SkipReason)


_DEFAULT_STATUSES = """
from sensors import ALL_SCHEDULES, ALL_SENSORS
for item in [*ALL_SENSORS, *ALL_SCHEDULES]:
    print(item.name, item.default_status.value)
"""


def _default_statuses(automation: str | None) -> dict[str, str]:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRACKS_AUTOMATION"}
    if automation is not None:
        env["TRACKS_AUTOMATION"] = automation
    # A process each: the statuses are read from the environment when sensors/ is imported.
    out = subprocess.run(
        [sys.executable, "-c", _DEFAULT_STATUSES],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    return dict(line.split() for line in out.splitlines())


def test_automation_a_person_chooses_is_off_until_turned_on(tracks_home: Path) -> None:
    """Out of the box only the resume sensor runs; TRACKS_AUTOMATION=on starts the others."""
    assert _default_statuses(None) == {
        "resume_after_preemption": "RUNNING",
        "new_snapshot": "STOPPED",
        "nightly_retrain": "STOPPED",
    }
    assert set(_default_statuses("on").values()) == {"RUNNING"}
