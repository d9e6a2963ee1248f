"""Who the champion is: the registry's ``champion`` alias, and the ledger's promotion of a version.

Promotion moves the alias and records the promotion; serving loads what the alias names and
verifies it against that record. Both read the two facts here, below them both: this module
imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.mlflow_setup import CHAMPION_ALIAS
from pipeline.states import PromotionDecision

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from pipeline.ledger import Ledger, PromotionRecord


def registered_champion(client: MlflowClient, model_name: str) -> ModelVersion | None:
    """The model version the ``champion`` alias of ``model_name`` points at, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException as exc:
        # No registered model yet, or a model without the alias.
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def promotion_for_version(ledger: Ledger, model_name: str, version: str) -> PromotionRecord | None:
    """The ledger's promotion that crowned ``version`` of ``model_name``, or None."""
    for row in ledger.promotions(model_name=model_name, decision=PromotionDecision.PROMOTED):
        if row.model_version == str(version):
            return row
    return None
