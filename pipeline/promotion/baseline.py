"""The champion's baseline for the headline comparison: evaluated on the candidate's examples.

A champion evaluated on another task set, at another evaluator version, or before raw outputs
were digested cannot be compared example by example. Promotion then evaluates the champion's
checkpoint on the promotion's snapshot, recorded in the ledger like any evaluation, when that
snapshot's eval split is the candidate's task set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pipeline import redact
from pipeline.promotion.gate import newest_complete
from pipeline.states import EvaluationStatus

if TYPE_CHECKING:
    from pipeline.ledger import Ledger
    from pipeline.ledger.records import EvaluationRecord, PromotionRecord
    from pipeline.promotion.comparison import HeadlineSettings
    from pipeline.settings import TracksSettings


def reevaluate_champion_if_needed(
    *,
    ledger: Ledger,
    settings: TracksSettings,
    champion: PromotionRecord,
    candidate_evaluations: Iterable[EvaluationRecord],
    candidate_manifest_sha256: str,
    snapshot_id: str,
    headline: HeadlineSettings,
    dagster_run_id: str | None = None,
) -> dict[str, Any] | None:
    """Evaluate the champion on the candidate's task set if the ledger has no usable baseline.

    Returns None when nothing was needed (or the candidate has no complete evaluation of the
    headline evaluator to pair with), else what was done: ``evaluated`` with the new
    ``evaluation_id``, or ``evaluated: False`` and the ``reason`` it could not be.
    """
    from pipeline.checkpoint.errors import CheckpointError
    from pipeline.data.errors import DataError
    from pipeline.data.families import TEXT
    from pipeline.data.snapshot import open_snapshot
    from pipeline.evaluation import EvalSet, EvaluationError, run_evaluation
    from pipeline.evaluation.eval_set import text_eval_set
    from pipeline.serving.loading import UnreadableCheckpointError

    name = headline.evaluator
    candidate = newest_complete(candidate_evaluations, candidate_manifest_sha256).get(name)
    if candidate is None:
        return None
    usable = [
        r
        for r in ledger.evaluations_for_checkpoint(champion.checkpoint_manifest_sha256)
        if r.evaluator_name == name
        and r.status == EvaluationStatus.COMPLETE
        and r.task_set_version == candidate.task_set_version
        and r.evaluator_version == candidate.evaluator_version
        and r.raw_outputs_sha256
    ]
    if usable:
        return None
    done: dict[str, Any] = {
        "evaluator": name,
        "checkpoint_path": champion.checkpoint_path,
        "snapshot_id": snapshot_id,
        "task_set_version": candidate.task_set_version,
    }
    try:
        snapshot = open_snapshot(settings.snapshot_root, snapshot_id)
        # The headline evaluator reads only the eval split: the training side of a text
        # evaluation set (the contamination check's) is not needed here.
        eval_set: Any = (
            text_eval_set(snapshot) if snapshot.family == TEXT else EvalSet.from_snapshot(snapshot)
        )
    except (DataError, EvaluationError, OSError, ValueError) as exc:
        # ValueError: a text snapshot whose documents give no evaluation set (TextDataError).
        return {**done, "evaluated": False, "reason": f"snapshot {snapshot_id}: {exc}"}
    if eval_set.task_set_version != candidate.task_set_version:
        return {
            **done,
            "evaluated": False,
            "reason": (
                f"the eval split of snapshot {snapshot_id} is task set "
                f"{eval_set.task_set_version[:12]}, not the task set "
                f"{candidate.task_set_version[:12]} of the candidate's evaluation "
                f"{candidate.evaluation_id}"
            ),
        }
    try:
        record = run_evaluation(
            checkpoint_dir=champion.checkpoint_path,
            snapshot=eval_set,
            ledger=ledger,
            settings=settings,
            evaluator=name,
            run_id=champion.run_id,
            attempt_no=champion.attempt_no,
            dagster_run_id=dagster_run_id,
        )
    except (CheckpointError, EvaluationError, UnreadableCheckpointError, OSError) as exc:
        return {**done, "evaluated": False, "reason": redact.one_line(str(exc))}
    if record.checkpoint_manifest_sha256 != champion.checkpoint_manifest_sha256:
        return {
            **done,
            "evaluated": False,
            "evaluation_id": record.evaluation_id,
            "reason": (
                f"{champion.checkpoint_path} now holds manifest "
                f"{record.checkpoint_manifest_sha256[:16]}, the champion was promoted from "
                f"{champion.checkpoint_manifest_sha256[:16]}"
            ),
        }
    return {**done, "evaluated": True, "evaluation_id": record.evaluation_id}
