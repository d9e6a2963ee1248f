"""Evaluation: evaluators applied to committed checkpoints, recorded with full provenance.

Importing this package is cheap (no torch or MLflow); they load when an evaluation runs.
"""

from pipeline.evaluation.base import NOT_APPLICABLE, Evaluator, EvaluatorResult, code_digest
from pipeline.evaluation.errors import (
    CheckpointAttemptMismatchError,
    EvalSetError,
    EvaluationError,
    EvaluatorCrashError,
    FamilyMismatchError,
    UnknownEvaluatorError,
)
from pipeline.evaluation.eval_set import EvalSet, text_eval_set
from pipeline.evaluation.evaluators import (
    EVALUATORS,
    evaluator_versions,
    family_evaluators,
    get_evaluator,
    required_evaluators,
)
from pipeline.evaluation.run import run_evaluation

__all__ = [
    "EVALUATORS",
    "NOT_APPLICABLE",
    "CheckpointAttemptMismatchError",
    "EvalSet",
    "EvalSetError",
    "EvaluationError",
    "Evaluator",
    "EvaluatorCrashError",
    "EvaluatorResult",
    "FamilyMismatchError",
    "UnknownEvaluatorError",
    "code_digest",
    "evaluator_versions",
    "family_evaluators",
    "get_evaluator",
    "required_evaluators",
    "run_evaluation",
    "text_eval_set",
]
