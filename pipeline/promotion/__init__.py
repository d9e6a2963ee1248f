"""Promotion: the quality gate, then the ``champion`` alias moves or a refusal is recorded."""

from pipeline.promotion.comparison import HeadlineSettings
from pipeline.promotion.families import gate_for_family, registered_model_name
from pipeline.promotion.gate import GateDecision, QualityGate, decide, newest_complete
from pipeline.promotion.promote import champion_version, promote

__all__ = [
    "GateDecision",
    "HeadlineSettings",
    "QualityGate",
    "champion_version",
    "decide",
    "gate_for_family",
    "newest_complete",
    "promote",
    "registered_model_name",
]
