"""The spike detector's fast path: a fold's bounds decide a clean step with two comparisons, and
every verdict is the exact rule's (pipeline/trainer/spikes.py).

Each stream is judged twice: by the detector as the trainer uses it (``clean``, then ``judge``
where the bounds do not decide) and by one that folds at every step (``fold_steps=0``: the
exact rule alone). The streams aim at the bounds: values a hair either side of the exact
threshold, runs that squeeze the window's deviation as fast as any values can, flat windows,
negative and zero means under the ratio rule, magnitudes near overflow, NaN and infinities.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pipeline.trainer.config import SpikeConfig
from pipeline.trainer.spikes import Bounds, SpikeDetector

Stream = Callable[[random.Random, SpikeDetector], Iterator[tuple[float, float]]]
CONFIGS = [
    SpikeConfig(),  # the demo's: window 128, z 6 from 50 steps
    SpikeConfig(window=8, min_history=2, zscore=1.0),
    SpikeConfig(window=15, min_history=15, zscore=2.0),
    SpikeConfig(window=2, min_history=2, zscore=0.2, ratio=1.01),
    SpikeConfig(window=16, min_history=4, zscore=3.0, ratio=1.5),
    SpikeConfig(window=40, min_history=40, zscore=None, ratio=2.0),
    SpikeConfig(window=128, min_history=50, zscore=6.0, metrics="loss"),
    SpikeConfig(window=64, min_history=10, zscore=0.5, metrics="grad_norm,loss"),
]


def _threshold(detector: SpikeDetector, name: str) -> float:
    """The exact rule's threshold for ``name`` now: the least of the window's mean + z sd and
    ``ratio`` times its mean, those the config judges by."""
    detector.fold()
    mean, std = detector._windows[name].mean_std()
    config, thresholds = detector.config, []
    if config.zscore is not None:
        thresholds.append(mean + config.zscore * std if std > 0 else mean)
    if config.ratio is not None:
        thresholds.append(config.ratio * mean if mean > 0 else 0.0)
    return min(thresholds)


def _squeeze(detector: SpikeDetector, name: str) -> float:
    """The new value that lowers the threshold fastest: a little below the mean (z-score),
    or 0, the least a value the bounds let through may be (ratio)."""
    mean, std = detector._windows[name].mean_std()
    z = detector.config.zscore
    return mean - std / z if z is not None else 0.0


def noisy_trend(rng: random.Random, _: SpikeDetector) -> Iterator[tuple[float, float]]:
    """A loss falling through noise, a gradient norm climbing then settling, a spike now and
    then (what training looks like)."""
    for step in range(600):
        loss = 2.0 * math.exp(-step / 200) + rng.gauss(0, 0.05)
        norm = min(step, 40) / 4 + rng.gauss(0, 0.5)
        if rng.random() < 0.02:
            loss, norm = loss * rng.choice([3.0, 30.0]), norm * rng.choice([1.0, 10.0])
        yield loss, norm


def near_the_threshold(rng: random.Random, det: SpikeDetector) -> Iterator[tuple[float, float]]:
    """Values within a few parts in 1e12 of the exact threshold, either side, between runs of
    the values that lower the threshold fastest."""
    for _ in range(40):
        yield rng.uniform(0.9, 1.1), rng.uniform(9.0, 11.0)
    for step in range(800):
        name = det.config.metric_names[step % len(det.config.metric_names)]
        if step % 3:
            value = _squeeze(det, name)
        else:
            value = _threshold(det, name) * (1 + rng.choice([-1, 1]) * rng.uniform(0, 4e-12))
        other = rng.uniform(0.9, 1.1) if name == "grad_norm" else rng.uniform(9.0, 11.0)
        yield (value, other) if name == "loss" else (other, value)


def flat_then_rise(rng: random.Random, _: SpikeDetector) -> Iterator[tuple[float, float]]:
    """A flat window (deviation 0), then values at and a hair above it."""
    for _ in range(200):
        yield 0.5, 3.0
    for _ in range(100):
        yield rng.choice([0.5, math.nextafter(0.5, 1.0)]), rng.choice([3.0, 3.0000000001])


def signed(rng: random.Random, _: SpikeDetector) -> Iterator[tuple[float, float]]:
    """Means below and around zero: the ratio rule's edge (a positive value over a mean <= 0)."""
    for step in range(500):
        centre = -1.0 if step < 250 else 0.0
        yield centre + rng.uniform(-1, 1), rng.uniform(-0.01, 0.01) + (step > 400)


def extremes(rng: random.Random, _: SpikeDetector) -> Iterator[tuple[float, float]]:
    """Magnitudes from 1e-300 to near overflow, and values that are not finite."""
    for _ in range(300):
        scale = 10.0 ** rng.choice([-300, -5, 0, 150, 300])
        value = rng.uniform(0.5, 2.0) * scale
        if rng.random() < 0.05:
            value = rng.choice([math.inf, -math.inf, math.nan])
        yield value, rng.uniform(0.5, 2.0) * scale


STREAMS: list[Stream] = [noisy_trend, near_the_threshold, flat_then_rise, signed, extremes]


def _verdicts(
    config: SpikeConfig, stream: Stream, seed: int
) -> tuple[list[Any], list[Any], int, SpikeDetector, SpikeDetector]:
    fast, exact = SpikeDetector(config), SpikeDetector(config, fold_steps=0)
    got, want, cleared = [], [], 0
    for loss, grad_norm in stream(random.Random(seed), exact):
        values = {"loss": loss, "grad_norm": grad_norm}
        if fast.clean(loss, grad_norm):
            cleared += 1
            got.append(None)
        else:
            judged = fast.judge(values)
            got.append(judged and judged.to_json())
        assert not exact.clean(loss, grad_norm)  # fold_steps 0: never decided by bounds
        judged = exact.judge(values)
        want.append(judged and judged.to_json())
    return got, want, cleared, fast, exact


@pytest.mark.parametrize("stream", STREAMS, ids=lambda s: s.__name__)
def test_every_verdict_is_the_exact_rules_at_every_step(stream: Stream) -> None:
    for number, config in enumerate(CONFIGS):
        got, want, _, fast, exact = _verdicts(config, stream, seed=number)
        first = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), None)
        assert first is None, (config, first, got[first], want[first])
        # The windows hold the same values, folded or not: a checkpoint reads the same.
        assert fast.state_dict() == exact.state_dict()


def test_the_bounds_decide_most_clean_steps() -> None:
    """Not a vacuous fast path: on a training-like stream nearly every clean step is decided
    by the bounds alone, and the spikes are still found."""
    got, want, cleared, *_ = _verdicts(SpikeConfig(), noisy_trend, seed=3)
    spikes = sum(1 for w in want if w is not None)
    assert got == want and spikes >= 5
    assert cleared >= 0.8 * (len(want) - spikes), (cleared, len(want), spikes)


def test_a_restored_detector_folds_and_judges_as_the_one_it_was_saved_from() -> None:
    config = SpikeConfig(window=32, min_history=8)
    rng = random.Random(5)
    saved = SpikeDetector(config)
    for _ in range(45):  # ends with values waiting for a fold
        saved.clean(rng.gauss(1, 0.1), rng.gauss(5, 0.3)) or saved.judge(
            {"loss": rng.gauss(1, 0.1), "grad_norm": rng.gauss(5, 0.3)}
        )
    restored = SpikeDetector(config)
    restored.load_state_dict(saved.state_dict())
    for loss, norm in [(rng.gauss(1, 0.1), rng.gauss(5, 0.3)) for _ in range(60)] + [(9.0, 5.0)]:
        verdicts = []
        for detector in (saved, restored):
            cleared = detector.clean(loss, norm)
            judged = None if cleared else detector.judge({"loss": loss, "grad_norm": norm})
            verdicts.append(judged and judged.to_json())
        assert verdicts[0] == verdicts[1]
    assert verdicts[0] is not None and verdicts[0]["metric"] == "loss"


def test_bounds_stay_below_the_threshold_of_every_window_the_next_steps_reach() -> None:
    """Against brute force: for each of the next 16 steps, the window with that many new
    values, all equal, swept across the range where mean + z sd is least."""
    from pipeline.trainer.spikes import _Window

    rng = random.Random(9)
    config = SpikeConfig(window=32, min_history=8, zscore=4.0)
    for _ in range(40):
        window = _Window(32)
        for _ in range(rng.randint(8, 40)):
            window.append(rng.gauss(10, 2))
        bounds = Bounds.of(window, config, 16)
        assert bounds.steps == 16 and bounds.low < 0 < bounds.high
        mean, std = window.mean_std()
        for pending in range(16):
            old = list(window.values)[max(0, len(window.values) + pending - 32) :]
            count = len(old) + pending
            least = math.inf
            for x in (mean + std * k / 100 for k in range(-600, 101, 4)):
                m = (math.fsum(old) + pending * x) / count
                variance = (math.fsum((v - m) ** 2 for v in old) + pending * (x - m) ** 2) / (
                    count - 1
                )
                least = min(least, m + config.zscore * math.sqrt(variance))
            assert bounds.high <= least, (pending, bounds.high, least)
