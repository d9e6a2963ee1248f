"""``promoted_model``: the gate between an evaluated checkpoint and the served model."""

from pathlib import Path
from typing import Any

import dagster as dg

from assets.failures import step_failure
from assets.lineage import upstream_metadata
from assets.partitions import snapshot_partitions
from resources import LedgerResource, MlflowResource, StorageResource, core_settings


class PromotionConfig(dg.Config):
    model_name: str = "digits-classifier"


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=["evaluation"],
    group_name="promotion",
    kinds={"mlflow"},
    description=(
        "Registers the checkpoint as an MLflow model version and moves the `champion` alias, "
        "only with complete evaluation provenance and a passing quality gate."
    ),
)
def promoted_model(
    context: dg.AssetExecutionContext,
    config: PromotionConfig,
    ledger: LedgerResource,
    storage: StorageResource,
    mlflow: MlflowResource,
) -> dg.MaterializeResult:
    from pipeline import ids
    from pipeline.promotion import promote
    from pipeline.states import PromotionDecision

    try:
        ids.model_name(config.model_name)
    except ids.InvalidIdError as exc:
        raise step_failure(f"run config of promoted_model: {exc}", exc) from None
    checkpoint = upstream_metadata(context, "committed_checkpoint", context.partition_key)
    decision = promote(
        ledger=ledger.ledger(),
        settings=core_settings(storage, mlflow, ledger),
        run_id=checkpoint["run_id"],
        attempt_no=int(checkpoint["attempt_no"]),
        checkpoint_dir=Path(checkpoint["path"]),
        snapshot_id=context.partition_key,
        model_name=config.model_name,
        dagster_run_id=context.run_id,
    )
    metadata = promotion_metadata(decision)
    if decision.decision != PromotionDecision.PROMOTED:
        # The refusal is already in the ledger; failing the step makes the run say why.
        raise dg.Failure(
            description=f"promotion refused: {decision.reason}",
            metadata=metadata,
            allow_retries=False,
        )
    context.log.info(f"{decision.model_name} version {decision.model_version} is now champion")
    return dg.MaterializeResult(metadata=metadata)


def promotion_metadata(decision: Any) -> dict[str, Any]:
    """The materialization's metadata for a promotion record, refused or promoted."""
    return {
        "promotion_id": decision.promotion_id,
        "decision": str(decision.decision),
        "reason": dg.MetadataValue.text(decision.reason),
        "model_name": decision.model_name,
        "model_version": decision.model_version or "none",
        "previous_champion_version": decision.previous_champion_version or "none",
        "run_id": decision.run_id,
        "attempt_no": decision.attempt_no,
        "checkpoint_manifest_sha256": decision.checkpoint_manifest_sha256,
        "evaluation_ids": dg.MetadataValue.json(list(decision.evaluation_ids)),
        "gate": dg.MetadataValue.json(decision.gate),
        # The paired comparison of the headline metric with the champion, every number in it.
        "headline_comparison": dg.MetadataValue.json(
            (decision.gate or {}).get("headline_comparison") or {}
        ),
        "decision_against_champion": dg.MetadataValue.md(_gate_markdown(decision)),
    }


def _gate_markdown(decision: Any) -> str:
    """The gate's rules as a table: each threshold, the headline and each slice against the
    champion."""
    from pipeline.plots import table_markdown
    from pipeline.promotion.comparison import headline_sentence

    gate = decision.gate or {}
    rows = [
        [c["metric"], "—" if c.get("value") is None else c["value"], f">= {c['threshold']}",
         "passed" if c.get("passed") else "**failed**"]
        for c in gate.get("thresholds", [])
    ]  # fmt: skip
    if headline := gate.get("headline_comparison"):
        rows.append(_headline_row(headline))
    for s in gate.get("slice_comparisons", []):
        rows.append(
            [f"{s['evaluator']} slice {s['slice']}", s["candidate"],
             f"champion {s['champion']} (no bigger drop)",
             "**regressed**" if s.get("regressed") else "passed"]
        )  # fmt: skip
    against = (
        f"against champion version {gate['champion_version']}"
        if gate.get("champion_version")
        else "no champion yet to compare slices against"
    )
    verdict = f"**{decision.decision}** ({against}) — {decision.reason}"
    table = table_markdown(["rule", "this checkpoint", "needs", "result"], rows)
    if headline:
        champion = gate.get("champion_version")
        who = f"champion version {champion}" if champion else "the champion"
        table += "\n\nHeadline: " + headline_sentence(headline, who) + "."
    return verdict + "\n\n" + table


def _headline_row(headline: dict[str, Any]) -> list[Any]:
    if not headline.get("compared"):
        return [f"{headline.get('metric')} against the champion", "—", "a paired comparison",
                "**not compared**"]  # fmt: skip
    low, high = headline["interval"]
    return [
        f"{headline['metric']} against the champion ({headline['champion']:.4f}), paired",
        f"{headline['candidate']:.4f} (difference {headline['difference']:+.4f}, "
        f"{headline['confidence']:.0%} interval [{low:+.4f}, {high:+.4f}], n={headline['n']})",
        f"lower bound >= -{headline['margin']:g}",
        "passed" if headline["passed"] else "**failed**",
    ]
