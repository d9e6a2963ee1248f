"""``promoted_model``: the gate between an evaluated checkpoint and the served model."""

from pathlib import Path
from typing import Any

import dagster as dg

from assets.failures import step_failure
from assets.lineage import upstream_metadata
from assets.links import mlflow_model_version_link, mlflow_training_link
from assets.partitions import ASSET_GROUP, snapshot_partitions
from assets.tables import fields_table, table
from resources import LedgerResource, MlflowResource, StorageResource, core_settings


class PromotionConfig(dg.Config):
    # Empty: the registered model of the run's family (digits-classifier, text-lm).
    model_name: str = ""


@dg.asset(
    partitions_def=snapshot_partitions,
    deps=["evaluation"],
    group_name=ASSET_GROUP,
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
    from pipeline.explain import explain
    from pipeline.promotion import promote
    from pipeline.states import PromotionDecision

    try:
        if config.model_name:
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
        model_name=config.model_name or None,
        dagster_run_id=context.run_id,
    )
    metadata = promotion_metadata(decision)
    metadata |= mlflow_model_version_link(mlflow, decision.model_name, decision.model_version)
    metadata |= mlflow_training_link(mlflow, decision.run_id)
    # The run's page once the decision is recorded: the last chapter, on the asset a person
    # looks at last.
    metadata["explain"] = dg.MetadataValue.md(explain(ledger.ledger(), decision.run_id))
    if decision.decision == PromotionDecision.REFUSED:
        # The refusal is already in the ledger; failing the step makes the run say why.
        raise dg.Failure(
            description=f"promotion refused: {decision.reason}",
            metadata=metadata,
            allow_retries=False,
        )
    if decision.decision == PromotionDecision.PROMOTED:
        context.log.info(f"{decision.model_name} version {decision.model_version} is now champion")
    else:  # recorded, and not a refusal (a candidate identical to the champion, say)
        context.log.info(f"{decision.decision}: {decision.reason}")
    return dg.MaterializeResult(metadata=metadata)


def promotion_metadata(decision: Any) -> dict[str, Any]:
    """The materialization's metadata for a promotion record, refused or promoted.

    Every number of the gate is in a table: each rule a row of ``gate_rules``, the paired
    headline comparison's fields in ``headline_comparison``, the rest of what the gate recorded
    (its settings, the evaluations it counted) in ``gate``.
    """
    gate = decision.gate or {}
    return {
        "decision": str(decision.decision),
        "reason": dg.MetadataValue.text(decision.reason),
        "decision_against_champion": dg.MetadataValue.md(_decision_markdown(decision)),
        "model_name": decision.model_name,
        "model_version": decision.model_version or "none",
        "previous_champion_version": decision.previous_champion_version or "none",
        "promotion_id": decision.promotion_id,
        "run_id": decision.run_id,
        "attempt_no": dg.MetadataValue.text(str(decision.attempt_no)),
        "checkpoint_manifest_sha256": decision.checkpoint_manifest_sha256,
        "evaluation_ids": dg.MetadataValue.json(list(decision.evaluation_ids)),
        "gate_rules": gate_rules_table(decision),
        "headline_comparison": fields_table(
            "headline_comparison",
            gate.get("headline_comparison") or {"compared": False},
            "as the gate recorded the paired comparison with the champion",
        ),
        "gate": fields_table(
            "gate",
            {k: v for k, v in gate.items() if k not in _IN_OTHER_TABLES},
            "as the gate recorded it (rules: gate_rules; headline: headline_comparison)",
        ),
    }


# Parts of the gate record shown by their own tables.
_IN_OTHER_TABLES = frozenset({"thresholds", "slice_comparisons", "headline_comparison"})


def _decision_markdown(decision: Any) -> str:
    """The decision in sentences: what was decided against whom and why, then the headline
    comparison with every number. Each rule is a row of ``gate_rules``."""
    from pipeline.promotion.comparison import headline_sentence

    gate = decision.gate or {}
    champion = gate.get("champion_version")
    against = (
        f"against champion version {champion}"
        if champion
        else "no champion yet to compare slices against"
    )
    text = f"**{decision.decision}** ({against}) — {decision.reason}"
    if headline := gate.get("headline_comparison"):
        who = f"champion version {champion}" if champion else "the champion"
        text += "\n\nHeadline: " + headline_sentence(headline, who) + "."
    return text + "\n\nEach rule of the gate, with its numbers: `gate_rules`."


_GATE_COLUMNS = [
    dg.TableColumn("rule", "string", "a threshold, the paired headline comparison or a slice"),
    dg.TableColumn("this_checkpoint", "float", "the candidate's value; empty: none"),
    dg.TableColumn(
        "reference", "float", "the threshold, or the champion's value; empty: not compared"
    ),
    dg.TableColumn(
        "difference", "float", "this_checkpoint - reference (headline: the paired difference)"
    ),
    dg.TableColumn("needs", "string", "what the rule requires"),
    dg.TableColumn("passed", "bool", "empty: not compared"),
    dg.TableColumn("interval_low", "float", "headline: the paired interval's lower bound"),
    dg.TableColumn("interval_high", "float", "headline: the paired interval's upper bound"),
    dg.TableColumn("n", "int", "headline: paired examples compared"),
    dg.TableColumn("result", "string", "passed, failed, regressed or not compared"),
]


_NO_INTERVAL = {"interval_low": None, "interval_high": None, "n": None}


def gate_rules_table(decision: Any) -> dg.TableMetadataValue:
    """The gate's rules, one row each: every threshold, the headline against the champion
    and every slice against the champion."""
    gate = decision.gate or {}
    rows = [_threshold_row(c) for c in gate.get("thresholds", [])]
    if headline := gate.get("headline_comparison"):
        rows.append(_headline_row(headline))
    limit = (gate.get("gate") or {}).get("max_slice_regression")
    rows += [_slice_row(s, limit) for s in gate.get("slice_comparisons", [])]
    return table("gate_rules", _GATE_COLUMNS, rows)


def _threshold_row(check: dict[str, Any]) -> dict[str, Any]:
    value, threshold = check.get("value"), float(check["threshold"])
    return {
        "rule": check["metric"],
        "this_checkpoint": None if value is None else float(value),
        "reference": threshold,
        "difference": None if value is None else float(value) - threshold,
        "needs": f"{check.get('needs', '>=')} {check['threshold']}",
        "passed": bool(check.get("passed")),
        **_NO_INTERVAL,
        "result": "passed" if check.get("passed") else "failed",
    }


def _slice_row(comparison: dict[str, Any], limit: float | None) -> dict[str, Any]:
    candidate, champion = float(comparison["candidate"]), float(comparison["champion"])
    regressed = bool(comparison.get("regressed"))
    return {
        "rule": f"{comparison['evaluator']} slice {comparison['slice']}",
        "this_checkpoint": candidate,
        "reference": champion,
        "difference": candidate - champion,
        "needs": "no bigger drop from the champion than the gate allows"
        if limit is None
        else f"a drop of at most {limit:g} from the champion",
        "passed": not regressed,
        **_NO_INTERVAL,
        "result": "regressed" if regressed else "passed",
    }


def _headline_row(headline: dict[str, Any]) -> dict[str, Any]:
    rule = f"{headline.get('metric')} against the champion, paired"
    if not headline.get("compared"):
        return {
            "rule": rule,
            "this_checkpoint": None,
            "reference": None,
            "difference": None,
            "needs": "a paired comparison",
            "passed": None,
            **_NO_INTERVAL,
            "result": "not compared",
        }
    low, high = headline["interval"]
    return {
        "rule": rule,
        "this_checkpoint": float(headline["candidate"]),
        "reference": float(headline["champion"]),
        "difference": float(headline["difference"]),
        # What pipeline/promotion/comparison.py decides on: within the margin, and not
        # significantly worse (the interval does not lie wholly below 0).
        "needs": (
            f"difference >= -{headline['margin']:g} and the {headline['confidence']:.0%} "
            "interval's upper bound >= 0"
        ),
        "passed": bool(headline["passed"]),
        "interval_low": float(low),
        "interval_high": float(high),
        "n": int(headline["n"]),
        "result": "passed" if headline["passed"] else "failed",
    }
