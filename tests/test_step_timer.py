"""The step timer's split, on a clock the test moves by hand."""

from __future__ import annotations

from pipeline.trainer.timing import StepTimer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_carved_part_counts_as_its_own_phase_and_leaves_the_position_alone() -> None:
    clock = Clock()
    timer = StepTimer(clock=clock)
    timer.begin(7)
    timer.switch("data", "loading the batch")
    clock.now += 0.010
    timer.switch("compute", "forward, backward and the optimizer's update")
    clock.now += 0.030  # forward and backward
    position = timer.position
    began = timer.clock()
    clock.now += 0.002  # the spike detector's verdict
    timer.carve("health", began)
    assert timer.position == position  # the watchdog still reads compute
    clock.now += 0.005  # the optimizer's update
    timer.end()
    summary = timer.summary()
    assert summary["data"]["median"] == 0.010
    assert round(summary["compute"]["median"], 9) == 0.035
    assert round(summary["health"]["median"], 9) == 0.002
    assert round(summary["total"]["median"], 9) == 0.047
