"""Errors of the evaluation step; each names the evaluator, checkpoint or snapshot involved."""

from __future__ import annotations

from pipeline import redact


class EvaluationError(Exception):
    """Base class for evaluation errors."""


class UnknownEvaluatorError(EvaluationError, LookupError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"no evaluator named {name!r}; registered: {', '.join(known)}")
        self.name = name


class EvaluatorCrashError(EvaluationError):
    """An evaluator raised. The evaluation is recorded as failed (``evaluator_crash``) first."""

    def __init__(
        self,
        *,
        evaluator_name: str,
        evaluator_version: str,
        checkpoint_path: str,
        evaluation_id: str,
        cause: BaseException,
    ) -> None:
        # The message goes to Dagster's log and the step's failure: no URL password in it.
        super().__init__(
            redact.text(
                f"evaluator {evaluator_name} ({evaluator_version}) crashed on checkpoint "
                f"{checkpoint_path} and was recorded as failed evaluation {evaluation_id}: "
                f"{type(cause).__name__}: {cause}"
            )
        )
        self.evaluator_name = evaluator_name
        self.evaluator_version = evaluator_version
        self.checkpoint_path = checkpoint_path
        self.evaluation_id = evaluation_id


class EvalSetError(EvaluationError):
    """The eval split of a snapshot cannot be used (empty, or ids and tensors disagree)."""

    def __init__(self, snapshot_id: str, problem: str) -> None:
        super().__init__(f"snapshot {snapshot_id}: {problem}")
        self.snapshot_id = snapshot_id


class CheckpointAttemptMismatchError(EvaluationError):
    """The caller's run/attempt disagrees with the checkpoint's COMMITTED marker."""

    def __init__(self, checkpoint_path: str, expected: str, found: str) -> None:
        super().__init__(
            f"checkpoint {checkpoint_path} was committed by attempt {found}, "
            f"not by attempt {expected} as the caller said"
        )
        self.checkpoint_path = checkpoint_path


class FamilyMismatchError(EvaluationError):
    """A checkpoint of one model family evaluated on (or compared with) another family's data."""

    def __init__(self, what: str, family: str, other: str, other_family: str) -> None:
        super().__init__(
            f"{what} is model family {family}, but {other} is {other_family}; a family is "
            f"evaluated on its own data only"
        )
        self.family = family
        self.other_family = other_family
