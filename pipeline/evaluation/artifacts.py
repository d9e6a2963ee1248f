"""What an evaluation leaves behind: raw outputs, sampled failures, metrics, confusion matrix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.evaluation.base import EvaluatorResult

RAW_OUTPUTS = "raw_outputs.parquet"
FAILURES = "failures.json"
METRICS = "metrics.json"
CONFUSION_MATRIX = "confusion_matrix.png"
# The generation samples as an MLflow table (``log_table``) on the evaluation's run.
SAMPLES_TABLE = "generation_samples.json"


def write_artifacts(
    result: EvaluatorResult, out_dir: Path, *, title: str, provenance: dict[str, Any]
) -> list[Path]:
    """Write the evaluation's artifacts into ``out_dir`` and return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    raw_path = out_dir / RAW_OUTPUTS
    result.raw_outputs.to_parquet(raw_path, index=False)
    written.append(raw_path)

    if "correct" in result.raw_outputs.columns:  # a classifier's outputs
        total: int | None = int((~result.raw_outputs["correct"]).sum())
        order = "most confident wrong predictions first"
    else:
        # A text evaluator has no right or wrong answer per example: it hands back its worst
        # examples (hardest documents, worst-judged samples, contaminated items) itself.
        total = None
        order = "as the evaluator ranks them, worst first"
    failures_path = out_dir / FAILURES
    failures_path.write_text(
        json.dumps(
            {
                "total_failures": total,
                "sampled": len(result.failures),
                "order": order,
                "failures": json.loads(result.failures.to_json(orient="records")),
            },
            indent=2,
        )
    )
    written.append(failures_path)

    metrics_path = out_dir / METRICS
    metrics_path.write_text(
        json.dumps(
            {
                "provenance": provenance,
                "metrics": result.metrics,
                "slice_metrics": result.slice_metrics,
                "confusion_matrix": result.confusion_matrix,
            },
            indent=2,
            sort_keys=True,
            default=str,
        )
    )
    written.append(metrics_path)

    if result.confusion_matrix is not None:
        png_path = out_dir / CONFUSION_MATRIX
        plot_confusion_matrix(result.confusion_matrix, png_path, title=title)
        written.append(png_path)
    return written


def plot_confusion_matrix(matrix: list[list[int]], path: Path, *, title: str) -> None:
    """A labelled confusion-matrix heatmap as PNG, drawn without pyplot's global state."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.asarray(matrix)
    size = counts.shape[0]
    figure = Figure(figsize=(6, 5.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(counts, cmap="Blues")
    figure.colorbar(image, ax=axes)
    axes.set_xticks(range(size))
    axes.set_yticks(range(size))
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    axes.set_title(title, fontsize=9)
    threshold = counts.max() / 2 if counts.size else 0
    for row in range(size):
        for col in range(size):
            if counts[row, col]:
                color = "white" if counts[row, col] > threshold else "black"
                axes.text(
                    col,
                    row,
                    str(counts[row, col]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color=color,
                )
    figure.tight_layout()
    figure.savefig(path, format="png")
