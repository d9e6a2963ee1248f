"""Pictures a person would rather look at than numbers in JSON: the loss curve, small enough
for the Dagster UI to show without a click.

Dagster 1.13's UI (``MetadataEntry.tsx`` in dagster-webserver) renders a Markdown value inline
in an asset's metadata table only while it is shorter than 1,000 characters; a longer one hides
behind a "[Show Markdown]" button, and the run's event log always hides Markdown. A matplotlib
PNG as a data URI is ~30,000 characters, so the curve is a hand-written SVG data URI instead:
one polyline, the committed checkpoints as dotted lines and three labels, downsampled until the
whole Markdown value fits. Text (the sparkline) is shown inline everywhere, the event log too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The UI shows a Markdown value inline only below this many characters.
INLINE_MARKDOWN_CHARS = 1000
_WIDTH, _HEIGHT, _TOP, _BOTTOM = 320, 100, 14, 86  # SVG user units; the curve spans _TOP.._BOTTOM
_SPARKS = "▁▂▃▄▅▆▇█"
# Committed checkpoints drawn at most (spread evenly): each costs ~12 of the characters.
_MAX_MARKS = 12


class PlotTooLargeError(ValueError):
    """Even the smallest curve does not fit the characters the UI shows inline."""


def _points(steps: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    return [(int(s["step"]), float(s["loss"])) for s in steps if s.get("loss") is not None]


def evenly(items: Sequence[Any], count: int) -> list[Any]:
    """At most ``count`` items spread evenly, the first and the last always among them."""
    if len(items) <= count:
        return list(items)
    if count < 2:
        return [items[-1]]
    last = len(items) - 1
    return [items[round(i * last / (count - 1))] for i in range(count)]


def _svg(points: Sequence[tuple[int, float]], commits: Sequence[int], title: str) -> str:
    x0, x1 = points[0][0], points[-1][0]
    low, high = min(p[1] for p in points), max(p[1] for p in points)

    def x(step: int) -> int:
        return round((step - x0) * (_WIDTH - 4) / max(x1 - x0, 1)) + 2

    def y(loss: float) -> int:
        return round(_TOP + (high - loss) * (_BOTTOM - _TOP) / ((high - low) or 1.0))

    curve = "M" + "L".join(f"{x(s)},{y(v)}" for s, v in points)
    shown = [s for s in commits if x0 <= s <= x1]
    marks = "".join(f"M{x(s)},{_TOP}V{_BOTTOM}" for s in evenly(shown, _MAX_MARKS))
    which = (
        "checkpoints" if len(shown) <= _MAX_MARKS else f"{_MAX_MARKS} of {len(shown)} checkpoints"
    )
    parts = [
        "<svg xmlns='http://www.w3.org/2000/svg' width='400' viewBox='0 0 "
        f"{_WIDTH} {_HEIGHT}' font-family='sans-serif' font-size='9'>",
        # White under the curve: the UI's dark theme would hide dark strokes on transparency.
        f"<rect width='{_WIDTH}' height='{_HEIGHT}' fill='white'/>",
        f"<path d='{marks}' stroke='grey' stroke-dasharray='2'/>" if marks else "",
        f"<path d='{curve}' fill='none' stroke='steelblue' stroke-width='1.5'/>",
        f"<text x='2' y='10'>{title}: top {high:.4g}, bottom {low:.4g}</text>",
        f"<text x='2' y='{_HEIGHT - 3}'>step {x0}</text>",
        f"<text x='{_WIDTH - 2}' y='{_HEIGHT - 3}' text-anchor='end'>"
        f"step {x1}; dotted: {which}</text>",
        "</svg>",
    ]
    return "".join(parts)


def loss_curve_markdown(
    steps: Sequence[Mapping[str, Any]],
    commits: Sequence[int] = (),
    *,
    title: str = "loss",
    max_chars: int = INLINE_MARKDOWN_CHARS - 1,
) -> str:
    """The loss by global step, committed checkpoints dotted, as a Markdown image shorter than
    ``max_chars``: as many points as fit, spread evenly over the steps, first and last kept."""
    points = _points(steps)
    if not points:
        return "No loss was reported."
    # Only what a data URI inside a Markdown link may not hold raw is escaped: spaces (a link
    # ends there), '#' (a fragment) and '%'. Titles are ids and words; ')' would end the link.
    safe_title = "".join(c for c in title if c not in "()[]<>&'\"#%\\")
    count = len(points)
    while True:
        svg = _svg(evenly(points, count), commits, safe_title).replace(" ", "%20")
        markdown = f"![loss curve](data:image/svg+xml,{svg})"
        if len(markdown) <= max_chars:
            return markdown
        if count <= 2:
            raise PlotTooLargeError(
                f"a loss curve of {count} points is {len(markdown)} characters, "
                f"longer than {max_chars}"
            )
        count = max(min(count - 1, int(count * 0.85)), 2)


def sparkline(values: Sequence[float], width: int = 24) -> str:
    """``values`` as block characters, each the mean of one of ``width`` equal runs of them."""
    if not values:
        return ""
    size = len(values)
    buckets = [values[i * size // width : max((i + 1) * size // width, i * size // width + 1)]
               for i in range(min(width, size))]  # fmt: skip
    means = [sum(b) / len(b) for b in buckets]
    low, high = min(means), max(means)
    scale = (len(_SPARKS) - 1) / ((high - low) or 1.0)
    return "".join(_SPARKS[round((m - low) * scale)] for m in means)


def loss_sparkline(steps: Sequence[Mapping[str, Any]]) -> str:
    """One line a log row shows whole: first and final loss around the curve's shape."""
    points = _points(steps)
    if not points:
        return "no loss reported"
    losses = [v for _, v in points]
    best_step, best = min(points, key=lambda p: p[1])
    return (
        f"{losses[0]:.4g} {sparkline(losses)} {losses[-1]:.4g} (steps {points[0][0]}-"
        f"{points[-1][0]}, {len(points)} report(s); lowest {best:.4g} at step {best_step})"
    )
