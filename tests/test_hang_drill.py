"""Hang drill: one rank stops for good at a random step while its process stays alive.

``TRACKS_FAULT_HANG_AT_STEP`` blocks the rank in its data loading (or in a collective its peers
never join); the rank's watchdog sees no step finish for max(5 x p99 step time, floor), dumps
every thread's stack beside the last words and ends the attempt ``hung`` (exit 81), naming the
stuck rank, its phase, step and top frames. At two ranks the healthy rank, waiting for it, fires
too and is named as the one that waited. The retry policy resumes a hung run from its last
commit, and the resume sensor continues it to completion.

Before this change the trainer waited forever: these tests time out on the old code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from pipeline.explain import explain
from pipeline.ledger import Ledger
from pipeline.reasons import read_last_words
from pipeline.trainer import exit_codes
from pipeline.trainer.attempt import last_words_path, stacks_path
from pipeline.trainer.config import WatchdogConfig
from pipeline.trainer.timing import StepTimer
from pipeline.trainer.watchdog import HangFault, HangRecord, Stall, Watchdog, hang_story
from tests.trainer_support import Trainer, write_config

# The drills' floor: short enough for the suite, far above a step of this tiny model.
FLOOR = 3.0
# The watchdog polls a tenth of the floor (at most 0.25 s); a loaded machine may be late to
# run its thread, never by this much.
LATE = 1.5
SEED = 20261127


def _hang_step(low: int, high: int) -> int:
    """A step drawn from the seeded generator, printed so a failing run can be repeated."""
    step = random.Random(f"{SEED}:{low}:{high}").randint(low, high)
    print(f"hang drill: hanging at step {step} (seed {SEED})")
    return step


def _assert_detected_in_time(hang: dict[str, Any]) -> None:
    """From the recorded timestamps: the last finished step, and when the watchdog fired."""
    p99 = hang["p99_step_seconds"]
    threshold = max(5 * p99, FLOOR)
    assert hang["threshold_seconds"] == pytest.approx(threshold, abs=1e-3), hang
    waited = hang["fired_at"] - hang["last_progress_at"]
    assert threshold <= waited + 0.01, hang  # never before the threshold: no false alarm
    assert waited <= threshold + LATE, f"detected {waited:.2f} s after the last step: {hang}"


@pytest.mark.slow
def test_one_rank_hung_in_its_data_loading_ends_the_attempt_hung(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    """World size 1, self-owned: the trainer's own watchdog closes the attempt in the ledger."""
    step = _hang_step(12, 28)
    config = write_config(
        tmp_path / "config", snapshot_dir, max_steps=40, log_every_steps=5,
        watchdog={"floor_seconds": FLOOR},
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    store, run_id = tmp_path / "store", "hang-one"
    trainer = Trainer(config, store, run_id, "--ledger-url", url,
                      env={"TRACKS_FAULT_HANG_AT_STEP": str(step)})  # fmt: skip
    finished = trainer.wait(timeout=240)
    assert finished.returncode == exit_codes.HUNG, finished.stderr[-3000:]

    words = read_last_words(last_words_path(store, run_id, 1))
    assert words is not None and words["reason"] == "hung" and words["step"] == step - 1
    hang = words["hang"]
    assert (hang["rank"], hang["step"], hang["phase"]) == (0, step, "data"), hang
    _assert_detected_in_time(hang)
    assert any("hang_if_due" in frame for frame in hang["top_frames"]), hang
    stacks = stacks_path(store, run_id, 1).read_text()
    assert "Current thread" in stacks and "in hang_if_due" in stacks and "in train_step" in stacks

    attempt = Ledger.open(url).get_attempt(run_id, 1)
    assert (attempt.termination_reason, attempt.exit_code) == ("hung", exit_codes.HUNG)
    assert attempt.last_step == step - 1
    detail = attempt.termination_detail
    assert detail.startswith(f"Rank 0 hung in data loading (loading the batch) at step {step} ")
    assert "top frames: " in detail and "hang_if_due (pipeline/trainer/watchdog.py:" in detail
    assert "attempt-1.stacks.txt" in detail
    steps = attempt.timings["steps"]["0"]
    assert steps["steps"] == step - 1
    assert 0 < steps["compute"]["median"] <= steps["compute"]["p99"] <= steps["total"]["p99"]
    # The spike detector's share of a step is timed apart (the gradient norm and the verdict).
    assert 0 < steps["health"]["median"] <= steps["health"]["p99"] < steps["total"]["p99"]
    # Step messages carried the window's means; the receipt names the stuck rank and frames.
    timing = [e["timing"] for e in finished.events if e["event"] == "step"]
    assert timing and all(t["total"] >= t["compute"] > 0 for t in timing[1:]), timing
    page = explain(Ledger.open(url), f"{run_id}#1")
    assert "**hung**" in page and "Rank 0 hung in data loading" in page
    assert "**Step timing, rank 0**" in page and "**Hang**: stuck rank(s) 0" in page
    assert "spike detector " in page


def _trainer_resources(home: Path) -> dict[str, Any]:
    from resources import LedgerResource, MlflowResource, StorageResource, TrainerLauncherResource

    return {
        "ledger": LedgerResource(url=f"sqlite:///{home / 'ledger.db'}"),
        "storage": StorageResource(
            landing_root=str(home / "landing"),
            snapshot_root=str(home / "snapshots"),
            checkpoint_root=str(home / "checkpoints"),
            work_root=str(home / "work"),
        ),
        # No MLflow: the receipt is the ledger's, and MLflow's own start-up is not under test.
        "mlflow": MlflowResource(tracking_uri="", artifact_root=""),
        "trainer": TrainerLauncherResource(),
    }


def _materialize(
    instance: dg.DagsterInstance,
    home: Path,
    partition: str,
    run_config: dict[str, Any],
    tags: dict[str, str] | None = None,
) -> dg.ExecuteInProcessResult:
    from assets.training import training_attempt

    return dg.materialize(
        [training_attempt],
        instance=instance,
        partition_key=partition,
        resources=_trainer_resources(home),
        run_config=run_config,
        tags=tags,
        raise_on_error=False,
    )


@pytest.mark.slow
def test_a_rank_of_two_hung_is_named_and_the_sensor_resumes_the_run_to_completion(
    tracks_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """World size 2 under torchrun, launched by training_attempt as the UI would: rank 1 hangs
    in its data loading while rank 0 waits for it in the gradients' all-reduce. Both watchdogs
    fire; the receipt names rank 1 from their records. The resume sensor's request, run as the
    daemon would run it, resumes from the last commit and finishes the run."""
    from pipeline.data.gate import BLOCKING_CHECKS, CheckVerdict, record_verdict
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot
    from resources import LedgerResource
    from sensors.resume import resume_after_preemption

    step = _hang_step(7, 16)
    write_digits_landing(tracks_home / "landing")
    snapshot = create_snapshot(tracks_home / "landing", tracks_home / "snapshots")
    passed = [
        CheckVerdict(check=c, blocking=True, passed=True, summary="") for c in BLOCKING_CHECKS
    ]
    record_verdict(snapshot, passed, snapshot_root=tracks_home / "snapshots")
    train = {
        "max_steps": 20, "checkpoint_every_steps": 5, "log_every_steps": 5,
        "model": {"channels": 4, "hidden": 16}, "watchdog": {"floor_seconds": FLOOR},
    }  # fmt: skip
    two_ranks = {"trainer": {"config": {"backend": "torchrun", "nproc_per_node": 2}}}
    ledger = Ledger.open(f"sqlite:///{tracks_home / 'ledger.db'}")
    monkeypatch.setenv("TRACKS_FAULT_HANG_AT_STEP", f"{step}:rank=1:in=data")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("snapshots", [snapshot.snapshot_id])
        first = _materialize(
            instance, tracks_home, snapshot.snapshot_id,
            # The resume sensor's continuation is the point: no continuing in place.
            {"ops": {"training_attempt": {"config": {"train": train, "continue_in_run": False}}},
             "resources": two_ranks},
        )  # fmt: skip
        assert not first.success
        [hung] = ledger.list_attempts()
        run_id = hung.run_id
        assert (hung.termination_reason, hung.exit_code) == ("hung", exit_codes.HUNG), (
            hung.termination_detail
        )
        detail = hung.termination_detail
        assert detail.startswith(
            f"Rank 1 hung in data loading (loading the batch) at step {step} "
        ), detail
        assert "hang_if_due (pipeline/trainer/watchdog.py:" in detail, detail
        assert (
            f"Rank 0 waited for it in a collective (averaging the gradients) at step {step}"
            in detail
        ), detail
        assert "attempt-1.rank-00001.stacks.txt (rank 1)" in detail, detail
        store = tracks_home / "checkpoints"
        for rank in (0, 1):
            words = read_last_words(last_words_path(store, run_id, 1, rank=rank))
            assert words is not None and words["hang_story"]["stuck"] == [1], words
            _assert_detected_in_time(words["hang"])
        assert "in hang_if_due" in stacks_path(store, run_id, 1, rank=1).read_text()
        assert set(hung.timings["steps"]) == {"0", "1"}, hung.timings
        assert hung.retry_decision["action"] == "resume", hung.retry_decision
        assert hung.retry_decision["rule"] == "hung_resume"
        committed = ledger.latest_committed_checkpoint(run_id)
        assert committed is not None and committed.step == 5 * ((step - 1) // 5)

        # The daemon's tick: the sensor reads the ledger and asks for attempt 2, once.
        monkeypatch.delenv("TRACKS_FAULT_HANG_AT_STEP")
        storage = _trainer_resources(tracks_home)["storage"]
        with dg.build_sensor_context(
            instance=instance,
            resources={"ledger": LedgerResource(url=ledger.url), "storage": storage},
        ) as context:
            result = resume_after_preemption(context)
        assert isinstance(result, dg.SensorResult), result
        [request] = result.run_requests
        assert request.run_key == f"{run_id}:attempt-2"
        assert request.tags["tracks/decision"] == "resume"
        assert request.run_config["resources"]["trainer"] == two_ranks["trainer"]
        tags = {**request.tags, "dagster/sensor_name": "resume_after_preemption"}
        second = _materialize(
            instance, tracks_home, request.partition_key, request.run_config, tags
        )
        assert second.success, [e.message for e in second.all_events if e.is_failure]
    resumed = ledger.get_attempt(run_id, 2)
    assert resumed.termination_reason == "succeeded", resumed.termination_detail
    assert resumed.resumed_from_checkpoint == committed.path
    assert ledger.get_run(run_id).status == "trained"
    final = ledger.latest_committed_checkpoint(run_id)
    assert final is not None and final.step == 20 and final.attempt_no == 2
    # Both ranks' step timing of the finished attempt reached its receipt.
    assert set(resumed.timings["steps"]) == {"0", "1"}, json.dumps(resumed.timings)
    page = explain(ledger, run_id)
    assert "Rank 1 hung in data loading" in page and "hung_resume" in page


def _record(rank: int, step: int, phase: str, what: str, mark: int) -> HangRecord:
    return HangRecord(
        rank=rank, world_size=3, step=step, phase=phase, what=what, mark=mark,
        stalled_seconds=6.2, threshold_seconds=3.0, multiple=5.0, floor_seconds=3.0,
        p99_step_seconds=0.04, steps_timed=56, last_progress_at=0.0, fired_at=6.2,
        top_frames=(f"read (loader.py:{rank})", "train_step (train.py:9)"),
        stacks_file=f"attempt-1.rank-{rank:05d}.stacks.txt",
    )  # fmt: skip


def test_the_rank_furthest_behind_in_the_step_is_the_one_named_stuck() -> None:
    """Ranks run the same phases in order: whoever is behind is what the others wait for."""
    story = hang_story(
        [
            _record(0, 57, "collective", "averaging the loss", 5),
            _record(2, 57, "data", "loading the batch", 1),
            _record(1, 57, "collective", "averaging the loss", 5),
        ],
        world_size=4,
    )
    assert (story.stuck, story.waiting, story.silent) == ((2,), (0, 1), (3,))
    assert story.sentence.startswith(
        "Rank 2 hung in data loading (loading the batch) at step 57 for 6.2 s (threshold "
        "max(5 \u00d7 p99 0.04 s, floor 3 s) = 3 s); top frames: read (loader.py:2) ← train_step"
    ), story.sentence
    assert "Ranks 0 and 1 waited for it in a collective (averaging the loss) at step 57" in (
        story.sentence
    )
    assert "Rank 3 left no hang record in time." in story.sentence
    # A rank a step behind is behind whatever its phase.
    late = hang_story(
        [_record(0, 58, "data", "loading the batch", 1), _record(1, 57, "save", "saving", 9)], 2
    )
    assert late.stuck == (1,)


def test_ranks_level_in_one_collective_blame_the_collective_not_a_rank() -> None:
    story = hang_story(
        [_record(r, 12, "collective", "agreeing when to stop", 7) for r in (0, 1)], world_size=2
    )
    assert story.stuck == (0, 1) and story.waiting == ()
    assert "none was behind another, so the collective itself" in story.sentence


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ("x", "expected N[:rank=R][:in=data|collective]"),
        ("5:rank=2", "needs a step >= 1 and a rank below 2"),
        ("5:in=disk", "in= must be data or collective"),
        ("5:when=now", "has 'when=now'"),
    ],
)
def test_a_bad_hang_hook_is_refused_naming_the_variable(
    raw: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACKS_FAULT_HANG_AT_STEP", raw)
    with pytest.raises(ValueError, match="TRACKS_FAULT_HANG_AT_STEP") as refused:
        HangFault.from_env(world_size=2)
    assert said in str(refused.value)
    monkeypatch.setenv("TRACKS_FAULT_HANG_AT_STEP", "7:in=collective")
    with pytest.raises(ValueError, match="a collective needs two ranks or more"):
        HangFault.from_env(world_size=1)
    monkeypatch.setenv("TRACKS_FAULT_HANG_AT_STEP", "7:rank=1:in=collective")
    assert HangFault.from_env(world_size=2) == HangFault(7, 1, "collective")


def test_a_save_or_a_drill_pause_is_no_hang_but_a_step_that_never_ends_is() -> None:
    """A real watchdog thread over a real timer: suspended work restarts its clock; a stall
    past the floor fires it once, with where the rank was."""
    import threading
    import time

    fired: list[Stall] = []
    seen = threading.Event()

    def on_hang(stall: Stall) -> None:
        fired.append(stall)
        seen.set()
        threading.Event().wait()  # the real one ends the process; this one just stays

    timer = StepTimer()
    watchdog = Watchdog(WatchdogConfig(floor_seconds=0.4), timer, on_hang, poll_seconds=0.02)
    for step in range(1, 4):
        timer.begin(step)
        with timer.phase("compute", "forward"):
            time.sleep(0.005)
        timer.end()
    watchdog.arm()
    with watchdog.suspended():  # a save twice the floor
        time.sleep(0.8)
    timer.begin(4)
    with timer.phase("save", "saving a checkpoint"), watchdog.suspended():
        time.sleep(0.6)
    timer.end()
    assert not fired, fired
    timer.begin(5)
    timer.switch("data", "loading the batch")
    assert seen.wait(5.0), "the watchdog never fired"
    [stall] = fired
    assert stall.position["step"] == 5 and stall.position["phase"] == "data"
    assert 0.4 <= stall.stalled_seconds <= 1.5, stall
    assert stall.threshold_seconds == 0.4 and stall.steps_timed == 4
    summary = timer.summary()
    assert summary["steps"] == 4 and summary["save_stall"]["p99"] >= 0.6
    assert summary["compute"]["median"] >= 0.005
