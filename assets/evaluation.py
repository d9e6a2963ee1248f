"""``evaluation``: every registered evaluator on the committed checkpoint, with full provenance.

Separate from training so an evaluator crash retries the evaluator, never the training.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from assets.failures import step_failure
from assets.lineage import upstream_metadata
from assets.links import mlflow_evaluation_links
from assets.partitions import ASSET_GROUP, snapshot_partitions
from assets.tables import (
    COUNT_METRICS,
    confusion_matrix_table,
    metric_cells,
    metric_columns,
    table,
)
from resources import LedgerResource, MlflowResource, StorageResource, core_settings


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=["committed_checkpoint"],
    group_name=ASSET_GROUP,
    kinds={"mlflow"},
    description="Evaluator results for exactly one committed checkpoint, logged to MLflow.",
)
def evaluation(
    context: dg.AssetExecutionContext,
    ledger: LedgerResource,
    storage: StorageResource,
    mlflow: MlflowResource,
) -> dg.MaterializeResult:
    from pipeline.data.snapshot import open_snapshot
    from pipeline.evaluation import EvaluatorCrashError, run_evaluation
    from pipeline.evaluation.evaluators import family_evaluators
    from pipeline.explain import explain
    from pipeline.retry import RetryAction, decide_evaluation, policy_for_run
    from pipeline.states import EvaluationStatus

    checkpoint = upstream_metadata(context, "committed_checkpoint", context.partition_key)
    book = ledger.ledger()
    settings = core_settings(storage, mlflow, ledger)
    snapshot = open_snapshot(storage.snapshots() / context.partition_key)
    checkpoint_dir = Path(checkpoint["path"])

    # A retry after one evaluator crashed re-runs only what has no complete row yet.
    done = {
        (e.evaluator_name, e.evaluator_version): e
        for e in book.evaluations_for_checkpoint(checkpoint["manifest_sha256"])
        if e.status == EvaluationStatus.COMPLETE
    }
    records = []
    # The snapshot's family decides the evaluators (run_evaluation refuses a checkpoint of
    # another family).
    for name, evaluator in family_evaluators(snapshot.family).items():
        record = done.get((name, evaluator.version))
        if record is None:
            try:
                record = run_evaluation(
                    checkpoint_dir=checkpoint_dir,
                    snapshot=snapshot,
                    ledger=book,
                    settings=settings,
                    evaluator=evaluator,
                    run_id=checkpoint["run_id"],
                    attempt_no=int(checkpoint["attempt_no"]),
                    dagster_run_id=context.run_id,
                )
            except EvaluatorCrashError as exc:
                # The evaluator's own budget decides; a retry re-runs this step, which skips
                # the evaluators already complete and never touches the training.
                so_far = book.evaluations_for_checkpoint(checkpoint["manifest_sha256"])
                crashed = next(e for e in so_far if e.evaluation_id == exc.evaluation_id)
                run = book.get_run(checkpoint["run_id"])
                decision = decide_evaluation(policy_for_run(run), so_far, crashed)
                context.log.warning(f"{exc} Next: {decision.reason}")
                if decision.action == RetryAction.RETRY_EVALUATOR:
                    # Not chained: Dagster would store the evaluator's raw error (see
                    # assets/failures.py); the warning above says what happened.
                    raise dg.RetryRequested(
                        max_retries=context.retry_number + 1,
                        seconds_to_wait=decision.backoff_seconds,
                    ) from None
                raise step_failure(
                    f"{exc} {decision.reason}",
                    exc,
                    metadata={"retry_decision": dg.MetadataValue.json(decision.to_json())},
                ) from None
        else:
            context.log.info(f"{name} already evaluated this checkpoint: {record.evaluation_id}")
        records.append(record)

    metadata: dict[str, object] = {
        "run_id": checkpoint["run_id"],
        "checkpoint_manifest_sha256": checkpoint["manifest_sha256"],
        "evaluation_ids": dg.MetadataValue.json([r.evaluation_id for r in records]),
        "results": results_table(records),
    }
    for r in records:
        # A score is worth plotting over snapshots; a count of examples is in ``results``.
        for key, value in (r.metrics or {}).items():
            if key not in COUNT_METRICS:
                metadata[f"{r.evaluator_name}/{key}"] = float(value)
    metadata |= mlflow_evaluation_links(mlflow, records)
    for r in records:
        if r.slice_metrics:
            metadata[f"{r.evaluator_name}/slices"] = slices_table(r)
        matrix = _confusion_matrix(r)
        if matrix is not None:
            labels = list(range(len(matrix)))
            metadata[f"{r.evaluator_name}/confusion_matrix"] = confusion_matrix_table(
                matrix, labels
            )
    # The run's page now that its evaluations are recorded (training_attempt's predates them).
    metadata["explain"] = dg.MetadataValue.md(explain(book, checkpoint["run_id"]))
    return dg.MaterializeResult(metadata=metadata)


def results_table(records: Sequence[Any]) -> dg.TableMetadataValue:
    """One row per evaluator (``EvaluationRecord``s): its evaluation, MLflow run and metrics.

    Evaluators report different metrics: each metric is a column, empty for the others.
    """
    metrics = metric_columns(
        (r.metrics for r in records), "as the evaluator reported it; empty: not reported"
    )
    columns = [
        dg.TableColumn("evaluator", "string"),
        dg.TableColumn("evaluator_version", "string"),
        dg.TableColumn("evaluation_id", "string", "the ledger's evaluation row"),
        dg.TableColumn("mlflow_run_id", "string", "the MLflow run with its metrics and outputs"),
        *metrics,
    ]
    rows = [
        {
            "evaluator": r.evaluator_name,
            "evaluator_version": r.evaluator_version,
            "evaluation_id": r.evaluation_id,
            "mlflow_run_id": r.mlflow_run_id,
            **metric_cells(r.metrics, metrics),
        }
        for r in records
    ]
    return table("results", columns, rows)


def slices_table(record: Any) -> dg.TableMetadataValue:
    """One row per slice of one evaluation (a class, a noise level), one column per metric."""
    slices = record.slice_metrics or {}
    metrics = metric_columns(slices.values(), "on the examples of this slice")
    columns = [
        dg.TableColumn(
            "slice",
            "string",
            "class=K: examples labelled K; noise=S: Gaussian pixel noise of std S; "
            "topic=T: documents of pydoc topic T; mode=M: greedy or sampled generations",
        ),
        *metrics,
    ]
    rows = [{"slice": name, **metric_cells(v, metrics)} for name, v in sorted(slices.items())]
    return table(f"{record.evaluator_name}/slices", columns, rows)


def _confusion_matrix(record: Any) -> list[list[int]] | None:
    # Written with the evaluation's artifacts (metrics.json beside raw outputs); a picture is
    # worth trying, never worth failing the asset over.
    if not record.raw_outputs_uri:
        return None
    try:
        import mlflow

        from pipeline.evaluation.artifacts import METRICS

        uri = record.raw_outputs_uri.rsplit("/", 1)[0] + f"/{METRICS}"
        return mlflow.artifacts.load_dict(uri).get("confusion_matrix")
    except Exception:
        return None
