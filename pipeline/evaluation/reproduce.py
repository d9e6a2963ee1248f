"""``tracks reproduce EVALUATION_ID``: re-run a generation evaluation from its record alone.

The record is the ledger's evaluation row (its ``provenance``: weights digest, prompt set,
template, tokenizer, decoding parameters and seed, judge) and the raw outputs file it vouches
for (every sample, with the sha256 of its output bytes). Reproduction loads the checkpoint the
row names, verified against the manifest digest the row recorded, and the snapshot its
provenance names, verified against its manifest, rebuilds every input from them and compares
(``pipeline.textlm.reproduce``): greedy outputs byte-identical, sampled outputs identical
under their recorded seeds, every score equal.
"""

from __future__ import annotations

import dataclasses
import io
from typing import TYPE_CHECKING

from pipeline.evaluation.errors import EvaluationError

if TYPE_CHECKING:
    from pipeline.ledger import Ledger
    from pipeline.settings import TracksSettings
    from pipeline.textlm.reproduce import Reproduction

# The evaluator whose outputs reproduction re-generates.
GENERATION = "generation_judged"


class ReproductionError(EvaluationError):
    """An evaluation that cannot be re-run: not a generation evaluation, not complete, or its
    checkpoint or raw outputs are not the bytes it recorded. Names the evaluation."""

    def __init__(self, evaluation_id: str, problem: str) -> None:
        super().__init__(f"evaluation {evaluation_id}: {problem}")
        self.evaluation_id = evaluation_id


def reproduce_evaluation(
    ledger: Ledger, settings: TracksSettings, evaluation_id: str
) -> Reproduction:
    """Re-run generation evaluation ``evaluation_id`` from its record and compare.

    Raises ``UnknownEvaluationError`` (not in the ledger) or :class:`ReproductionError`.
    A record lacking a field comes back as an incomplete :class:`Reproduction` naming it.
    """
    import pandas as pd

    from pipeline import ids
    from pipeline.checkpoint.errors import CheckpointError
    from pipeline.data.errors import DataError
    from pipeline.data.snapshot import open_snapshot
    from pipeline.evaluation.eval_set import text_eval_set
    from pipeline.mlflow_setup import configure_mlflow
    from pipeline.promotion.comparison import OutcomesError, load_raw_outputs
    from pipeline.serving.loading import UnreadableCheckpointError, load_committed_checkpoint
    from pipeline.states import EvaluationStatus
    from pipeline.textlm.reproduce import (
        Mismatch,
        Reproduction,
        reproduce_generation,
        samples_from_frame,
    )

    configure_mlflow(settings)  # this deployment's store, quiet (no download progress bars)
    record = ledger.get_evaluation(evaluation_id)
    if record.evaluator_name != GENERATION:
        raise ReproductionError(
            evaluation_id,
            f"is a {record.evaluator_name} evaluation; reproduce re-runs {GENERATION} "
            f"evaluations (their outputs are generated, so they are what can differ)",
        )
    if record.status != EvaluationStatus.COMPLETE:
        raise ReproductionError(evaluation_id, f"is {record.status}: it recorded no outputs")
    provenance = record.provenance or {}
    snapshot_id = provenance.get("snapshot_id")
    if not isinstance(snapshot_id, str) or not snapshot_id:
        # Without the snapshot nothing can be rebuilt: incomplete, never "identical".
        return Reproduction(("snapshot_id",), (), (), 0, 0, 0)

    try:
        checkpoint, model = load_committed_checkpoint(record.checkpoint_path)
    except (CheckpointError, UnreadableCheckpointError, OSError) as exc:
        raise ReproductionError(
            evaluation_id, f"its checkpoint {record.checkpoint_path} cannot be loaded: {exc}"
        ) from exc
    if checkpoint.manifest_sha256 != record.checkpoint_manifest_sha256:
        raise ReproductionError(
            evaluation_id,
            f"its checkpoint {record.checkpoint_path} now holds manifest "
            f"{checkpoint.manifest_sha256[:16]}, the evaluation recorded "
            f"{record.checkpoint_manifest_sha256[:16]}",
        )
    try:
        snapshot = open_snapshot(settings.snapshot_root, ids.snapshot_id(snapshot_id))
        eval_set = text_eval_set(snapshot)  # verified against its manifest as it is read
    except (ids.InvalidIdError, DataError, EvaluationError, OSError, ValueError) as exc:
        raise ReproductionError(
            evaluation_id, f"its snapshot {snapshot_id} cannot be read: {exc}"
        ) from exc
    try:
        raw = load_raw_outputs(record, settings)
    except OutcomesError as exc:
        raise ReproductionError(evaluation_id, str(exc)) from exc
    samples = samples_from_frame(pd.read_parquet(io.BytesIO(raw)))

    found = reproduce_generation(
        {"provenance": provenance, "samples": samples}, model=model, eval_set=eval_set
    )
    # The row's own columns say the same as its provenance, or the record contradicts itself.
    columns = [
        Mismatch(name, recorded, wanted)
        for name, recorded, wanted in (
            ("task_set_version", record.task_set_version, eval_set.task_set_version),
            ("judge_model", record.judge_model, eval_set.judge.model_name),
            ("evaluator_version", record.evaluator_version, provenance.get("evaluator_version")),
        )
        if recorded != wanted
    ]
    if not columns:
        return found
    return dataclasses.replace(found, input_mismatches=(*found.input_mismatches, *columns))
