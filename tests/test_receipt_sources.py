"""Where an attempt came from is told from the ledger's facts, never from tags anyone can copy.

Each case was reproduced before the fix: a launch carrying another run's ``tracks/run_id`` and
``tracks/continuation`` kept those tags in the UI and its receipt said nothing of them; a
continuation on two ranks after an attempt on one read like any other attempt; "Re-execute
from failure" of a run's first Dagster run started a NEW ledger run with the parent's config
(which ran out of memory again after the policy had said stop); drill hooks, the sensor tick
and the schedule's execution time appeared nowhere on the page; the model's champions could
only be read with SQL.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.storage.tags import SCHEDULED_EXECUTION_TIME_TAG

from assets.launch import launched_by, trainer_config_source
from pipeline.explain import explain
from pipeline.ledger import AttemptStart, Ledger, PromotionRecord
from pipeline.retry import RetryPolicy
from pipeline.settings import TracksSettings
from pipeline.states import TerminationReason
from sensors.resume import resume_after_preemption
from sensors.schedules import nightly_retrain
from tests.receipt_support import (
    SMALL,
    make_snapshot,
    seed_ended_run,
    step_failure_message,
    train_alone,
)

SNAPSHOT = "digits-00000000000000aa"


@pytest.fixture
def settings(tracks_home: Path) -> TracksSettings:
    return TracksSettings.from_env()


def _run(ledger: Ledger, run_id: str) -> None:
    ledger.create_run(
        run_id=run_id, model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="a" * 64, snapshot_id=SNAPSHOT, retry_policy=RetryPolicy().to_json(),
    )  # fmt: skip


def _begin(
    ledger: Ledger,
    run_id: str,
    *,
    launched: dict[str, Any] | None = None,
    placement: dict[str, Any] | None = None,
    dagster_run_id: str | None = None,
) -> int:
    return ledger.begin_attempt(
        run_id,
        AttemptStart(
            config_snapshot={"max_steps": 10, "device": "cpu"}, config_sha256="c" * 64,
            data_manifest_sha256="d" * 64, container_digest="env", placement=placement or {},
            dagster_run_id=dagster_run_id, launched_by=launched,
        ),
    ).attempt_no  # fmt: skip


@pytest.mark.slow
def test_tags_copied_from_another_run_never_make_a_launch_part_of_it(
    settings: TracksSettings,
) -> None:
    """A person's fresh launch carrying run D's tags: the ledger's run E wins everywhere."""
    snapshot = make_snapshot(settings)
    ledger = Ledger.open(settings.ledger_url)
    other = "digits-cnn-other-run"
    seed_ended_run(ledger, snapshot, other, TerminationReason.PREEMPTED, dagster_run_id="dr-d")
    copied = {
        "tracks/run_id": other,
        "tracks/continuation": f"{other}:attempt-2",
        "tracks/continues_attempt": "1",
    }
    with dg.DagsterInstance.get() as instance:
        result = train_alone(settings, instance, snapshot.snapshot_id, SMALL, tags=copied)
        assert result.success, step_failure_message(result)
        tags = instance.get_run_by_id(result.run_id).tags
    [attempt] = ledger.attempts_for_dagster_run(result.run_id)
    new = attempt.run_id
    assert new != other and attempt.attempt_no == 1
    assert [a.attempt_no for a in ledger.attempts(other)] == [1]
    # The UI: the run tags Tracks sets state the ledger's run, and the claim is named.
    assert tags["tracks/run_id"] == new
    assert tags["tracks/attempt"] == f"{new}#1"
    assert tags["tracks/continuation"] == f"none (new run {new})"
    assert tags["tracks/continues_attempt"] == "none"
    assert other in tags["tracks/tags_contradicted"]
    # The asset's metadata: the ledger's run, and the mismatch stated.
    [materialization] = result.asset_materializations_for_node("training_attempt")
    metadata = materialization.metadata
    assert metadata["run_id"].value == new
    said = (
        f"Its Dagster tags claim run {other} / continuation {other}:attempt-2 / that it "
        f"continues attempt 1; the ledger says run {new}, a new run's first attempt"
    )
    assert said in metadata["tags_contradicted"].value
    # explain: the same sentence on the new run's page, nothing of this launch on run D's.
    assert said in explain(ledger, new)
    assert result.run_id not in explain(ledger, other)


@pytest.mark.slow
def test_reexecution_continues_the_ledger_run_of_its_parent_as_a_new_attempt(
    settings: TracksSettings,
) -> None:
    """Re-executing a fresh run's Dagster run (its config names no run id) continues it."""
    snapshot = make_snapshot(settings)
    ledger = Ledger.open(settings.ledger_url)
    run_id = "digits-cnn-reexecuted"
    # Attempt 1 ran on two ranks in Dagster run "parent" and was preempted (decision: resume).
    seed_ended_run(
        ledger, snapshot, run_id, TerminationReason.PREEMPTED, dagster_run_id="parent",
        placement={"host": "test", "world_size": 2, "ranks_per_node": 2, "nodes": 1},
        launched_by={"via": "ui", "trainer_config": {"from": "run_config",
                                                      "dagster_run_id": "parent"}},
    )  # fmt: skip
    runs_before = {r.run_id for r in ledger.find_runs()}
    with dg.DagsterInstance.get() as instance:
        result = train_alone(
            settings, instance, snapshot.snapshot_id, SMALL,
            tags={"dagster/parent_run_id": "parent", "dagster/root_run_id": "parent"},
        )  # fmt: skip
        assert result.success, step_failure_message(result)
    assert {r.run_id for r in ledger.find_runs()} == runs_before  # no new ledger run
    [attempt] = ledger.attempts_for_dagster_run(result.run_id)
    assert (attempt.run_id, attempt.attempt_no) == (run_id, 2)
    assert attempt.termination_reason == "succeeded", attempt.termination_detail
    assert attempt.launched_by["via"] == "reexecution:parent"
    assert attempt.admission["rule"] == "preempted_resume"
    assert attempt.placement["backend"] == "local" and attempt.placement["world_size"] == 1
    # The placement changed and the page says why: the re-execution set no trainer config.
    page = explain(ledger, run_id)
    assert (
        "Attempt 2 ran on 1 rank where attempt 1 ran on 2: launched by reexecution:parent on "
        "this deployment's trainer resource (its run config sets no resources.trainer)."
    ) in page, page


@pytest.mark.slow
def test_reexecution_of_a_run_the_policy_stopped_is_refused_saying_how_to_continue(
    settings: TracksSettings,
) -> None:
    snapshot = make_snapshot(settings)
    ledger = Ledger.open(settings.ledger_url)
    run_id = "digits-cnn-ran-out-of-memory"
    seed_ended_run(ledger, snapshot, run_id, TerminationReason.OOM, dagster_run_id="oom-parent")
    assert ledger.get_attempt(run_id, 1).retry_decision["action"] == "stop"
    with dg.DagsterInstance.get() as instance:
        result = train_alone(
            settings, instance, snapshot.snapshot_id, SMALL,
            tags={"dagster/parent_run_id": "oom-parent", "dagster/root_run_id": "oom-parent"},
        )  # fmt: skip
    assert not result.success
    message = step_failure_message(result)
    assert f"Re-executing Dagster run oom-parent continues run {run_id}" in message, message
    assert f"run {run_id} gets no attempt 2" in message and "oom_config_unchanged" in message
    assert f"config: {{run_id: {run_id}, train: {{batch_size: 32}}}}" in message, message
    assert [r.run_id for r in ledger.find_runs()] == [run_id]  # no new run
    assert [a.attempt_no for a in ledger.attempts(run_id)] == [1]  # no attempt opened


def test_a_sensor_continuation_on_another_placement_says_whose_trainer_config_it_carried(
    tmp_path: Path,
) -> None:
    """Attempt 1 ran on two ranks (Dagster run "dr-1"); a person's attempt 2 on one; the
    sensor's continuation, decided after attempt 1, carries dr-1's trainer config back."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    _run(ledger, "r1")
    two = {"world_size": 2, "ranks_per_node": 2, "nodes": 1, "backend": "torchrun"}
    _begin(ledger, "r1", placement=two, dagster_run_id="dr-1", launched={"via": "ui"})
    ended = ledger.end_attempt("r1", 1, termination_reason=TerminationReason.PREEMPTED,
                               termination_detail="SIGTERM")  # fmt: skip
    from pipeline.retry import decide, policy_for_run, record_decision

    record_decision(ledger, ended, decide(policy_for_run(ledger.get_run("r1")), [ended], ended))
    trainer = {"config": {"backend": "torchrun", "nproc_per_node": 2}}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("snapshots", [SNAPSHOT])
        instance.add_run(dg.DagsterRun(job_name="__ASSET_JOB", run_id="dr-1",
                                       run_config={"resources": {"trainer": trainer}}))  # fmt: skip
        from resources import LedgerResource, StorageResource

        root = tmp_path / "tracks"
        storage = StorageResource(
            landing_root=str(root / "landing"), snapshot_root=str(root / "snapshots"),
            checkpoint_root=str(root / "checkpoints"), work_root=str(root / "work"),
        )  # fmt: skip
        with dg.build_sensor_context(
            instance=instance,
            resources={"ledger": LedgerResource(url=ledger.url), "storage": storage},
        ) as context:
            result = resume_after_preemption(context)
    assert isinstance(result, dg.SensorResult)
    [request] = result.run_requests
    assert request.tags["tracks/trainer_config_from"] == "dagster_run:dr-1"
    # Meanwhile a person continued the run on one rank.
    one = {"world_size": 1, "ranks_per_node": 1, "nodes": 1, "backend": "local"}
    _begin(ledger, "r1", placement=one, dagster_run_id="dr-2",
           launched={"via": "ui", "trainer_config": {"from": "deployment"}})  # fmt: skip
    # The daemon launches the request: its tags, plus the ones Dagster adds.
    tags = {**request.tags, "dagster/sensor_name": "resume_after_preemption", "dagster/tick": "77"}
    launch = launched_by(tags)
    launch["trainer_config"] = trainer_config_source(tags, request.run_config, "dr-3",
                                                     launch["via"])  # fmt: skip
    _begin(ledger, "r1", placement=two, dagster_run_id="dr-3", launched=launch)
    page = explain(ledger, "r1")
    assert (
        "Attempt 2 ran on 1 rank where attempt 1 ran on 2; attempt 2 used backend local where "
        "attempt 1 had torchrun: launched by ui on this deployment's trainer resource"
    ) in page, page
    assert (
        "Attempt 3 ran on 2 ranks where attempt 2 ran on 1; attempt 3 used backend torchrun "
        "where attempt 2 had local: the resume sensor carried over the trainer config of "
        "Dagster run dr-1 (attempt 1's)."
    ) in page, page
    # The sensor's tick is on the receipt; its tags named the continuation it decided after
    # attempt 1, and the page says why the ledger's attempt number differs.
    assert "Launched by **sensor:resume_after_preemption** (tick 77" in page
    assert (
        "Its Dagster tags claim continuation r1:attempt-2 / that it continues attempt 1; the "
        "ledger says run r1, attempt 3: attempt 2 of this run opened between the decision the "
        "tags continue and this attempt."
    ) in page, page


def test_a_scheduled_launch_names_the_schedule_and_its_execution_time(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    _run(ledger, "r1")
    # The tags Dagster 1.13's scheduler leaves on the run it launches for a tick.
    tags = {
        **dg.DagsterRun.tags_for_schedule(nightly_retrain),
        SCHEDULED_EXECUTION_TIME_TAG: "2026-11-22T03:00:00+00:00",
        "dagster/run_key": "nightly:2026-11-22T03:00",
    }
    # As prepare_attempt records it: the evidence, and the Dagster run it launched.
    launched = {**launched_by(tags), "dagster_run_id": "dr-nightly"}
    _begin(ledger, "r1", launched=launched, dagster_run_id="dr-nightly")
    page = explain(ledger, "r1#1")
    assert (
        "Launched by **schedule:nightly_retrain** (scheduled for 2026-11-22T03:00:00+00:00, "
        "run key `nightly:2026-11-22T03:00`, Dagster run dr-nightly)."
    ) in page, page


def test_drill_hooks_active_on_an_attempt_are_on_its_receipt(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    _run(ledger, "r1")
    hooks = {"TRACKS_FAULT_OOM_ABOVE_BATCH": "48", "TRACKS_FAULT_SLEEP_AFTER_STEP": "6@150"}
    _begin(ledger, "r1", placement={"world_size": 1, "fault_hooks": hooks})
    _begin(ledger, "r1", placement={"world_size": 1})
    page = explain(ledger, "r1#1")
    said = (
        "Drill hooks active: TRACKS_FAULT_OOM_ABOVE_BATCH=48, TRACKS_FAULT_SLEEP_AFTER_STEP=6@150."
    )
    assert said in page, page
    assert page.count("Drill hooks active") == 2  # the attempt's line and its receipt; not #2's


def test_explain_shows_the_models_champions_and_who_dethroned_whom(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    start = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
    for n, run_id in enumerate(("run-a", "run-b", "run-c"), start=1):
        _run(ledger, run_id)
        _begin(ledger, run_id)
        decided = "refused" if run_id == "run-c" else "promoted"
        ledger.record_promotion(
            PromotionRecord(
                promotion_id=f"pr-{n}", run_id=run_id, attempt_no=1,
                checkpoint_path=f"/store/{run_id}/step-0000000010-a01",
                checkpoint_manifest_sha256=f"{n}" * 64, snapshot_id=SNAPSHOT, decision=decided,
                reason="test", evaluation_ids=[], gate={}, model_name="digits-classifier",
                decided_at=start + timedelta(days=n),
                model_version=None if decided == "refused" else str(n),
                previous_champion_version=str(n - 1) if n > 1 else None,
            )
        )  # fmt: skip
    page = explain(ledger, "run-a")
    assert "## Model history" in page
    assert (
        "Champion of `digits-classifier` now: **version 2** from run `run-b`, attempt 1, "
        "since 2026-11-22 09:00:00 UTC."
    ) in page, page
    assert (
        "| 2026-11-21 09:00:00 UTC | 1 | `run-a` (this run) | 1 | by version 2 (run `run-b`) "
        "on 2026-11-22 09:00:00 UTC |"
    ) in page, page
    assert "| 2026-11-22 09:00:00 UTC | 2 | `run-b` | 1 | champion now |" in page
    # A refused run is no champion; its page still shows who is.
    assert "**version 2** from run `run-b`" in explain(ledger, "run-c")
