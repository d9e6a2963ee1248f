"""Pictures a person would rather look at than JSON: rendered as Markdown for the Dagster UI.

Images are PNGs drawn with matplotlib's Agg backend (no display) and embedded as data URIs, so
the asset's metadata carries them and the UI shows them without a file server.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any


def _png_markdown(figure: Any, alt: str) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return f"![{alt}](data:image/png;base64,{encoded})"


def loss_curve_markdown(
    steps: Sequence[Mapping[str, Any]], commits: Sequence[int] = (), *, title: str = "Loss"
) -> str:
    """The loss by global step, committed checkpoints marked, as a Markdown image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(int(s["step"]), float(s["loss"])) for s in steps if s.get("loss") is not None]
    figure, axes = plt.subplots(figsize=(6, 3))
    try:
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.2)
        for step in commits:
            axes.axvline(step, color="grey", linewidth=0.6, linestyle=":")
        axes.set_xlabel("step (dotted: committed checkpoints)")
        axes.set_ylabel("training loss")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        return _png_markdown(figure, title)
    finally:
        plt.close(figure)


def table_markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.4g}"
        return " ".join(str(value).split()).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def confusion_matrix_markdown(matrix: Sequence[Sequence[int]], labels: Sequence[Any]) -> str:
    """Rows are the true label, columns the predicted one; the diagonal is bold."""
    header = ["true \\ predicted", *[str(label) for label in labels]]
    rows = []
    for i, (label, row) in enumerate(zip(labels, matrix, strict=True)):
        rows.append([str(label), *[f"**{v}**" if i == j else str(v) for j, v in enumerate(row)]])
    return table_markdown(header, rows)
