"""Reason-aware retry budgets: what happens after an attempt ends, and why.

Every termination reason spends from its own budget per run: a count of attempts that ended
with it, and the GPU-seconds those attempts burned. :func:`decide` applies this table (also in
docs/receipts.md):

=================  =================  ===============================================
reason             action             rule
=================  =================  ===============================================
succeeded          none               ``succeeded_evaluate``
preempted          resume             ``preempted_resume``
timeout            resume             ``timeout_resume``
hung               resume             ``hung_resume``
infra_transient    retry (backoff)    ``infra_transient_retry``
oom                retry / stop       ``oom_config_changed`` / ``oom_config_unchanged``
diverged           rollback / stop    ``diverged_rollback_once`` / ``..._budget_spent``
evaluator_crash    retry_evaluator    ``evaluator_crash_retry_evaluator``
bad_input          stop               ``bad_input_stops``
user_code_error    stop               ``user_code_error_stops``
cancelled          stop               ``cancelled_stops``
fenced             newer_attempt      ``fenced_newer_attempt_carries_on``
=================  =================  ===============================================

and any budgeted reason whose budget is spent stops with ``<reason>_budget_spent`` (count) or
``<reason>_gpu_budget_spent`` (GPU-seconds).

The policy lives in one readable place, a ``retry_policy:`` section of the run's YAML (defaults
here fill in whatever it leaves out); the resolved policy is stored on the run
(``training_runs.retry_policy``) so later changes to the defaults never rewrite an old run::

    retry_policy:
      preempted:        {max_attempts: 5}                 # 5 resumes; the 6th preemption stops
      infra_transient:
        max_attempts: 3
        max_gpu_seconds: 7200                             # null (the default) means no limit
        backoff: {initial_seconds: 30, max_seconds: 600, multiplier: 2}
      oom:              {max_attempts: 2}                 # and only with a memory-relevant change
      diverged:         {max_attempts: 1}                 # one rollback
      timeout:          {max_attempts: 2}
      hung:             {max_attempts: 3}                 # resumes after a rank's watchdog fired
      evaluator_crash:  {max_attempts: 2, backoff: {initial_seconds: 10, max_seconds: 120}}
      oom_memory_keys: [batch_size, activation_checkpointing, world_size]  # replaces the default

``max_attempts`` is how many attempts of the run may end with that reason and still be followed
by another; ``max_gpu_seconds`` is how many GPU-seconds those attempts may burn in total. The
``n``-th retry for a reason waits ``min(initial_seconds * multiplier**(n-1), max_seconds)``, and
never more than a day. Every number is finite and bounded: ``max_attempts`` <= 1000, backoff
seconds <= 86400, ``multiplier`` <= 100, ``max_gpu_seconds`` <= one year.
bad_input, user_code_error and cancelled always stop and have no budget to configure.
fenced never retries the attempt and has no budget either: the newer attempt that holds the run's
fencing token carries the run on, so the run stays ``running`` and no budget is spent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pipeline.states import CheckpointState, TerminationReason, attempt_status

if TYPE_CHECKING:
    from pipeline.ledger import AttemptRecord, CheckpointRecord, EvaluationRecord, Ledger, RunRecord

R = TerminationReason


class RetryAction(StrEnum):
    RESUME = "resume"  # continue from the newest committed checkpoint, same config
    RETRY = "retry"  # run again (after a backoff, or with a changed config)
    ROLLBACK = "rollback"  # continue from an earlier committed checkpoint
    RETRY_EVALUATOR = "retry_evaluator"  # run the evaluator again, never the training
    STOP = "stop"  # no further attempt: a person has to change something
    NONE = "none"  # nothing to retry: the attempt succeeded
    # Nothing to launch: a newer attempt (holding the run's fencing token) already carries it on.
    NEWER_ATTEMPT = "newer_attempt"


class RetryPolicyError(ValueError):
    """A ``retry_policy`` section that does not load; names the source and the key."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: retry_policy.{key}: {problem}")
        self.source = source
        self.key = key


# The longest wait before a retry, whatever the policy says.
MAX_BACKOFF_SECONDS = 86400.0  # one day


@dataclass(frozen=True)
class Backoff:
    """Wait before the n-th retry: ``min(initial_seconds * multiplier**(n-1), max_seconds)``."""

    initial_seconds: float = 0.0
    max_seconds: float = 0.0
    multiplier: float = 2.0

    def delay(self, nth: int) -> float:
        if self.initial_seconds <= 0 or nth < 1:
            return 0.0
        # No max_seconds still waits at most a day: a longer wait is a stuck run, and a wait
        # that no clock can represent would stop the resume sensor for every run.
        ceiling = min(self.max_seconds if self.max_seconds > 0 else math.inf, MAX_BACKOFF_SECONDS)
        try:
            grown = self.initial_seconds * self.multiplier ** (nth - 1)
        except OverflowError:  # multiplier**n past the float range: far past the ceiling
            return float(ceiling)
        return float(min(grown, ceiling))


@dataclass(frozen=True)
class ReasonBudget:
    """One reason's budget per run: attempts that may end with it, and GPU-seconds (None: ∞)."""

    max_attempts: int
    max_gpu_seconds: float | None = None
    backoff: Backoff = field(default_factory=Backoff)


# Reasons that never earn another attempt: retrying cannot change the outcome.
ALWAYS_STOP: Mapping[TerminationReason, str] = MappingProxyType(
    {
        R.BAD_INPUT: "retrying bad data is wishful thinking: fix the snapshot or the contract "
        "and start a new run",
        R.USER_CODE_ERROR: "the same code would fail the same way: fix it and start a new "
        "attempt by hand",
        R.CANCELLED: "a person asked for it to stop",
    }
)

DEFAULT_BUDGETS: Mapping[TerminationReason, ReasonBudget] = MappingProxyType(
    {
        R.PREEMPTED: ReasonBudget(max_attempts=5),
        R.INFRA_TRANSIENT: ReasonBudget(
            max_attempts=3, backoff=Backoff(initial_seconds=30, max_seconds=600, multiplier=2)
        ),
        R.OOM: ReasonBudget(max_attempts=2),
        R.DIVERGED: ReasonBudget(max_attempts=1),
        R.TIMEOUT: ReasonBudget(max_attempts=2),
        # A hang is most often the platform's (a stuck collective, a storage mount that stopped
        # answering): resumed at once, like a preemption; one that comes back at the same spot
        # every time spends the budget and stops for a person.
        R.HUNG: ReasonBudget(max_attempts=3),
        R.EVALUATOR_CRASH: ReasonBudget(
            max_attempts=2, backoff=Backoff(initial_seconds=10, max_seconds=120, multiplier=2)
        ),
    }
)

# A config key whose change can make an OOM go away: batch shape, activation checkpointing,
# placement. A changed path counts when any of its dotted parts is one of these.
DEFAULT_OOM_MEMORY_KEYS: tuple[str, ...] = (
    # batch shape
    "batch_size",
    "micro_batch_size",
    "global_batch_size",
    "per_device_batch_size",
    "train_batch_size",
    "gradient_accumulation_steps",
    "seq_len",
    "sequence_length",
    "max_seq_len",
    "block_size",
    "max_tokens",
    "image_size",
    # activation checkpointing
    "activation_checkpointing",
    "gradient_checkpointing",
    "ac_mode",
    # placement
    "placement",
    "device",
    "world_size",
    "num_nodes",
    "nproc_per_node",
    "accelerator_type",
    "accelerator_count",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "fsdp",
    "zero_stage",
    "cpu_offload",
)

_BUDGET_KEYS = ("max_attempts", "max_gpu_seconds", "backoff")
_BACKOFF_KEYS = ("initial_seconds", "max_seconds", "multiplier")

# Upper bounds of each number a policy may hold. Anything larger is a typo (or .inf/.nan in
# YAML); left in, it becomes a wait no clock can represent, or a budget that never ends.
_LIMITS: Mapping[str, float] = MappingProxyType(
    {
        "max_attempts": 1000,
        "max_gpu_seconds": 365 * 86400.0,  # one GPU-year
        "initial_seconds": MAX_BACKOFF_SECONDS,
        "max_seconds": MAX_BACKOFF_SECONDS,
        "multiplier": 100.0,
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """Budgets per reason for one run. Build with :meth:`default` or :func:`load_retry_policy`."""

    budgets: Mapping[TerminationReason, ReasonBudget] = field(
        default_factory=lambda: DEFAULT_BUDGETS, hash=False
    )
    oom_memory_keys: tuple[str, ...] = DEFAULT_OOM_MEMORY_KEYS

    @classmethod
    def default(cls) -> RetryPolicy:
        return cls()

    def budget(self, reason: TerminationReason) -> ReasonBudget | None:
        """The reason's budget; None for reasons that always stop (or succeeded)."""
        return self.budgets.get(reason)

    @classmethod
    def from_mapping(
        cls, section: Mapping[str, Any] | None, *, source: str = "retry_policy"
    ) -> RetryPolicy:
        """The policy from a ``retry_policy:`` section (or its stored JSON); defaults fill gaps."""
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise RetryPolicyError(source, "", f"must be a mapping, not {type(section).__name__}")
        budgets = dict(DEFAULT_BUDGETS)
        memory_keys = DEFAULT_OOM_MEMORY_KEYS
        for key, value in section.items():
            if key == "oom_memory_keys":
                if not isinstance(value, list | tuple) or not all(
                    isinstance(k, str) and k for k in value
                ):
                    raise RetryPolicyError(source, key, "must be a list of config key names")
                memory_keys = tuple(value)
                continue
            if key in ALWAYS_STOP:
                raise RetryPolicyError(
                    source, key, f"{key} always stops; it has no budget to configure"
                )
            if key == R.FENCED:
                raise RetryPolicyError(
                    source, key, "fenced is never retried (the newer attempt that fenced it "
                    "carries the run on); it has no budget to configure",
                )  # fmt: skip
            if key not in R._value2member_map_ or key == R.SUCCEEDED:
                known = ", ".join([*(str(r) for r in DEFAULT_BUDGETS), "oom_memory_keys"])
                raise RetryPolicyError(source, key, f"unknown key (expected one of {known})")
            reason = R(key)
            budgets[reason] = _budget_from(value, budgets[reason], source, key)
        return cls(budgets=MappingProxyType(budgets), oom_memory_keys=memory_keys)

    from_json = from_mapping

    def to_json(self) -> dict[str, Any]:
        """The resolved policy, in the same shape as the YAML section (store it on the run)."""
        out: dict[str, Any] = {}
        for reason in DEFAULT_BUDGETS:
            b = self.budgets[reason]
            out[str(reason)] = {
                "max_attempts": b.max_attempts,
                "max_gpu_seconds": b.max_gpu_seconds,
                "backoff": {
                    "initial_seconds": b.backoff.initial_seconds,
                    "max_seconds": b.backoff.max_seconds,
                    "multiplier": b.backoff.multiplier,
                },
            }
        out["oom_memory_keys"] = list(self.oom_memory_keys)
        return out


def _number(value: Any, source: str, key: str, *, integer: bool = False) -> float:
    """``value`` if it is a finite number from 0 to the bound of ``key``'s last part."""
    limit = _LIMITS[key.rsplit(".", 1)[-1]]
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 <= value <= limit
    ):
        raise RetryPolicyError(source, key, f"must be a number from 0 to {limit:g}, not {value!r}")
    if integer and int(value) != value:
        raise RetryPolicyError(source, key, f"must be a whole number, not {value!r}")
    return value


def _budget_from(value: Any, default: ReasonBudget, source: str, key: str) -> ReasonBudget:
    if not isinstance(value, Mapping):
        raise RetryPolicyError(source, key, "must be a mapping with " + ", ".join(_BUDGET_KEYS))
    for name in value:
        if name not in _BUDGET_KEYS:
            raise RetryPolicyError(
                source, f"{key}.{name}", f"unknown key (expected {', '.join(_BUDGET_KEYS)})"
            )
    max_attempts = default.max_attempts
    if "max_attempts" in value:
        max_attempts = int(
            _number(value["max_attempts"], source, f"{key}.max_attempts", integer=True)
        )
    max_gpu = default.max_gpu_seconds
    if "max_gpu_seconds" in value:
        raw = value["max_gpu_seconds"]
        max_gpu = None if raw is None else float(_number(raw, source, f"{key}.max_gpu_seconds"))
    backoff = default.backoff
    if "backoff" in value:
        given = value["backoff"]
        if not isinstance(given, Mapping):
            raise RetryPolicyError(source, f"{key}.backoff", "must be a mapping")
        for name in given:
            if name not in _BACKOFF_KEYS:
                raise RetryPolicyError(
                    source,
                    f"{key}.backoff.{name}",
                    f"unknown key (expected {', '.join(_BACKOFF_KEYS)})",
                )
        backoff = Backoff(
            **{
                name: float(_number(given.get(name), source, f"{key}.backoff.{name}"))
                if name in given
                else getattr(default.backoff, name)
                for name in _BACKOFF_KEYS
            }
        )
    return ReasonBudget(max_attempts=max_attempts, max_gpu_seconds=max_gpu, backoff=backoff)


def load_retry_policy(source: str | Path | Mapping[str, Any] | None) -> RetryPolicy:
    """The policy from YAML text, a parsed mapping, or a YAML file named by a ``Path``.

    A ``retry_policy:`` key is unwrapped; without it the whole is taken as the section. None
    gives the defaults. A string is always YAML text, never a file name: it comes from run
    config, and a file read from there could be any file the code location can see.
    """
    from pipeline import yamlio

    name = "retry_policy"
    if source is None:
        return RetryPolicy()
    if isinstance(source, Path):
        name = str(source)
        try:
            loaded = yamlio.load_file(source)
        except yamlio.YamlError as exc:
            raise RetryPolicyError(name, "", str(exc).removeprefix(f"{source}: ")) from exc
    elif isinstance(source, str):
        try:
            loaded = yamlio.loads(source, source=name)
        except yamlio.YamlError as exc:
            raise RetryPolicyError(name, "", str(exc).removeprefix(f"{name}: ")) from exc
        if isinstance(loaded, str):
            # YAML reads a bare file name as a string: say so, rather than "not a mapping".
            raise RetryPolicyError(
                name,
                "",
                "must be inline YAML (e.g. 'preempted: {max_attempts: 3}'), not a file name: "
                "files are not read from run config; paste the section itself",
            )
    else:
        loaded = source
    if loaded is None:
        return RetryPolicy()
    if isinstance(loaded, Mapping) and "retry_policy" in loaded:
        loaded = loaded["retry_policy"]
    return RetryPolicy.from_mapping(loaded, source=name)


def split_retry_policy(config: Mapping[str, Any]) -> tuple[dict[str, Any], RetryPolicy]:
    """A run's YAML minus its ``retry_policy:`` section (what the trainer reads), and the policy.

    The trainer's config rejects unknown keys, so the section must come out before it does.
    """
    rest = {k: v for k, v in config.items() if k != "retry_policy"}
    return rest, RetryPolicy.from_mapping(config.get("retry_policy"))


def policy_for_run(run: RunRecord) -> RetryPolicy:
    """The policy stored on the run (the defaults for a run that stored none)."""
    return RetryPolicy.from_json(run.retry_policy, source=f"run {run.run_id}")


@dataclass(frozen=True)
class RetryDecision:
    """What the policy decided after one attempt ended, the rule that decided it, and why."""

    action: RetryAction
    rule: str
    reason: str
    termination_reason: TerminationReason
    attempt_no: int
    budget_left: Mapping[str, Any]
    spent: Mapping[str, Any]
    backoff_seconds: float = 0.0
    resume_from: str | None = None
    decided_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def continues(self) -> bool:
        """Whether another attempt (or evaluator run) follows."""
        # NEWER_ATTEMPT continues: the run goes on in the newer attempt, never marked failed.
        return self.action not in (RetryAction.STOP, RetryAction.NONE)

    def to_json(self) -> dict[str, Any]:
        """The dict written on the attempt (``training_attempts.retry_decision``)."""
        return {
            "action": str(self.action),
            "rule": self.rule,
            "reason": self.reason,
            "termination_reason": str(self.termination_reason),
            "attempt_no": self.attempt_no,
            "budget_left": dict(self.budget_left),
            "spent": dict(self.spent),
            "backoff_seconds": self.backoff_seconds,
            "resume_from": self.resume_from,
            "decided_at": self.decided_at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RetryDecision:
        return cls(
            action=RetryAction(data["action"]),
            rule=data["rule"],
            reason=data["reason"],
            termination_reason=R(data["termination_reason"]),
            attempt_no=int(data["attempt_no"]),
            budget_left=dict(data.get("budget_left") or {}),
            spent=dict(data.get("spent") or {}),
            backoff_seconds=float(data.get("backoff_seconds") or 0.0),
            resume_from=data.get("resume_from"),
            decided_at=data.get("decided_at") or "",
        )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Every changed leaf, as ``path: old → new``, sorted by path."""
    a, b = _flatten(before), _flatten(after)
    return [
        f"{path}: {a.get(path)!r} → {b.get(path)!r}"
        for path in sorted(set(a) | set(b))
        if a.get(path) != b.get(path)
    ]


def memory_relevant_changes(
    before: Mapping[str, Any], after: Mapping[str, Any], keys: Iterable[str]
) -> list[str]:
    """Changes to batch shape, activation checkpointing or placement (any part in ``keys``)."""
    wanted = set(keys)
    a, b = _flatten(before), _flatten(after)
    return [
        f"{path}: {a.get(path)!r} → {b.get(path)!r}"
        for path in sorted(set(a) | set(b))
        if a.get(path) != b.get(path) and wanted & set(path.split("."))
    ]


def _resume_target(
    checkpoints: Sequence[CheckpointRecord] | None, *, earlier: bool
) -> tuple[str | None, str]:
    """(path, words) of the newest committed checkpoint, or of the one before it."""
    if checkpoints is None:
        words = "the previous committed checkpoint" if earlier else "the latest committed"
        return ("previous committed" if earlier else "latest committed"), words
    committed = sorted(
        (c for c in checkpoints if c.state == CheckpointState.COMMITTED),
        key=lambda c: (c.step, c.attempt_no),
    )
    if not committed:
        return None, "the start (no checkpoint was committed)"
    target = committed[-2] if earlier and len(committed) >= 2 else committed[-1]
    return target.path, f"step {target.step} ({target.path})"


def _gpu_words(seconds: float | None) -> str:
    return "no GPU-seconds limit" if seconds is None else f"{seconds:.0f} GPU-seconds"


def decide(
    policy: RetryPolicy,
    attempts_so_far: Sequence[AttemptRecord],
    ended: AttemptRecord,
    next_config: Mapping[str, Any] | None = None,
    *,
    checkpoints: Sequence[CheckpointRecord] | None = None,
) -> RetryDecision:
    """What follows ``ended``: resume, retry, rollback, retry the evaluator, stop, or nothing.

    ``attempts_so_far`` are the run's attempts (``ended`` may be among them; later ones are
    ignored). ``next_config`` is the config the next attempt would run with; None means the
    same config again. ``checkpoints`` (the run's, from the ledger) turn "latest committed"
    and "previous committed" into paths.
    """
    if ended.termination_reason is None:
        raise ValueError(f"attempt {ended.run_id}#{ended.attempt_no} has not ended yet")
    reason = R(ended.termination_reason)
    n = ended.attempt_no
    same = [
        a
        for a in attempts_so_far
        if a.run_id == ended.run_id and a.attempt_no < n and a.termination_reason == reason
    ]
    spent_count = len(same) + 1
    spent_gpu = sum(a.gpu_seconds or 0.0 for a in same) + (ended.gpu_seconds or 0.0)
    spent = {"count": spent_count, "gpu_seconds": round(spent_gpu, 3)}

    def made(action: RetryAction, rule: str, sentence: str, **extra: Any) -> RetryDecision:
        return RetryDecision(
            action=action,
            rule=rule,
            reason=sentence,
            termination_reason=reason,
            attempt_no=n,
            budget_left=extra.pop("budget_left", left),
            spent=spent,
            **extra,
        )

    if reason == R.SUCCEEDED:
        left = {"count": None, "gpu_seconds": None}
        return made(
            RetryAction.NONE,
            "succeeded_evaluate",
            f"Attempt {n} succeeded: evaluation of its final checkpoint comes next, "
            "not another attempt.",
        )
    if reason == R.FENCED:
        # Spends from no budget: counting it would let a race between two continuations stop
        # the run that the winner is still carrying.
        left = {"count": None, "gpu_seconds": None}
        return made(
            RetryAction.NEWER_ATTEMPT,
            "fenced_newer_attempt_carries_on",
            f"No retry: attempt {n} was fenced out by a newer attempt, which holds the run's "
            "fencing token and carries the run on; nothing is launched for this one.",
        )
    if reason in ALWAYS_STOP:
        left = {"count": 0, "gpu_seconds": 0.0}
        return made(
            RetryAction.STOP,
            f"{reason}_stops",
            f"Stop: attempt {n} ended {reason}; {ALWAYS_STOP[reason]}.",
        )

    budget = policy.budget(reason)
    assert budget is not None, reason
    count_left = budget.max_attempts - spent_count
    gpu_left = None if budget.max_gpu_seconds is None else budget.max_gpu_seconds - spent_gpu
    left = {
        "count": max(count_left, 0),
        "gpu_seconds": None if gpu_left is None else round(max(gpu_left, 0.0), 3),
    }
    budget_words = (
        f"{left['count']} more {reason} attempt(s) and "
        + _gpu_words(left["gpu_seconds"])
        + " left in this reason's budget"
    )

    # OOM: the same memory footprint fails the same way, whatever the budget says.
    if reason == R.OOM:
        changes = memory_relevant_changes(
            ended.config_snapshot or {}, next_config or ended.config_snapshot or {},
            policy.oom_memory_keys,
        )  # fmt: skip
        if not changes:
            return made(
                RetryAction.STOP,
                "oom_config_unchanged",
                f"Stop: attempt {n} ran out of memory and the next config changes nothing that "
                "bears on memory (batch shape, activation checkpointing, placement), so it "
                "would run out again; change one of those and retry.",
            )

    if count_left < 0:
        return made(
            RetryAction.STOP,
            f"{reason}_budget_spent",
            f"Stop: attempt {n} is the {_ordinal(spent_count)} of this run to end {reason}, "
            f"and the {reason} budget allows {budget.max_attempts} attempt(s); "
            "the count budget is spent.",
        )
    if gpu_left is not None and gpu_left < 0:
        return made(
            RetryAction.STOP,
            f"{reason}_gpu_budget_spent",
            f"Stop: the {spent_count} attempt(s) of this run that ended {reason} burned "
            f"{spent_gpu:.0f} GPU-seconds, past the {reason} budget of "
            f"{budget.max_gpu_seconds:.0f} GPU-seconds; the GPU-seconds budget is spent.",
        )

    backoff = budget.backoff.delay(spent_count)
    wait = f" after {backoff:.0f}s" if backoff else ""
    if reason in (R.PREEMPTED, R.TIMEOUT, R.HUNG):
        path, words = _resume_target(checkpoints, earlier=False)
        why = {
            R.PREEMPTED: "was preempted",
            R.TIMEOUT: "reached its wall-clock limit",
            R.HUNG: "hung (a rank's watchdog saw no step finish and ended it)",
        }[reason]
        return made(
            RetryAction.RESUME,
            f"{reason}_resume",
            f"Resume{wait}: attempt {n} {why}; the next attempt continues from {words}, "
            f"with {budget_words}.",
            backoff_seconds=backoff,
            resume_from=path,
        )
    if reason == R.INFRA_TRANSIENT:
        path, words = _resume_target(checkpoints, earlier=False)
        return made(
            RetryAction.RETRY,
            "infra_transient_retry",
            f"Retry{wait}: attempt {n} hit a transient infrastructure failure (the "
            f"{_ordinal(spent_count)} this run); the next attempt continues from {words}, "
            f"with {budget_words}.",
            backoff_seconds=backoff,
            resume_from=path,
        )
    if reason == R.OOM:
        return made(
            RetryAction.RETRY,
            "oom_config_changed",
            f"Retry{wait}: attempt {n} ran out of memory and the next config changes "
            + "; ".join(changes)
            + f". It starts fresh, because a checkpoint is bound to its config; {budget_words}.",
            backoff_seconds=backoff,
            resume_from=None,
        )
    if reason == R.DIVERGED:
        path, words = _resume_target(checkpoints, earlier=True)
        return made(
            RetryAction.ROLLBACK,
            "diverged_rollback_once",
            f"Roll back: attempt {n} diverged; the next attempt starts again from {words}, "
            f"earlier than where the loss went wrong, with {budget_words}.",
            backoff_seconds=backoff,
            resume_from=path,
        )
    if reason == R.EVALUATOR_CRASH:
        return made(
            RetryAction.RETRY_EVALUATOR,
            "evaluator_crash_retry_evaluator",
            f"Retry the evaluator{wait}, never the training: attempt {n}'s evaluator crashed; "
            f"{budget_words}.",
            backoff_seconds=backoff,
        )
    raise AssertionError(f"no rule for {reason}")  # pragma: no cover - every reason is above


def decide_evaluation(
    policy: RetryPolicy,
    evaluations_so_far: Sequence[EvaluationRecord],
    ended: EvaluationRecord,
) -> RetryDecision:
    """After an evaluation crashed: retry this evaluator (its own budget), or stop."""
    if ended.status != "failed" and ended.termination_reason is None:
        reason_value = R.SUCCEEDED
    else:
        reason_value = R(ended.termination_reason or R.EVALUATOR_CRASH)
    crashed_before = [
        e
        for e in evaluations_so_far
        if e.evaluation_id != ended.evaluation_id
        and e.evaluator_name == ended.evaluator_name
        and e.checkpoint_manifest_sha256 == ended.checkpoint_manifest_sha256
        and e.termination_reason == R.EVALUATOR_CRASH
        and e.started_at <= ended.started_at
    ]
    spent_count = len(crashed_before) + (1 if reason_value == R.EVALUATOR_CRASH else 0)
    budget = policy.budget(R.EVALUATOR_CRASH)
    assert budget is not None
    common = {
        "termination_reason": reason_value,
        "attempt_no": ended.attempt_no,
        "spent": {"count": spent_count, "gpu_seconds": 0.0},
    }
    if reason_value != R.EVALUATOR_CRASH:
        return RetryDecision(
            action=RetryAction.NONE if reason_value == R.SUCCEEDED else RetryAction.STOP,
            rule=f"evaluation_{reason_value}",
            reason=f"Evaluator {ended.evaluator_name} ended {reason_value}; nothing to retry.",
            budget_left={"count": None, "gpu_seconds": None},
            **common,
        )
    left = budget.max_attempts - spent_count
    if left < 0:
        return RetryDecision(
            action=RetryAction.STOP,
            rule="evaluator_crash_budget_spent",
            reason=f"Stop: evaluator {ended.evaluator_name} crashed {spent_count} times on this "
            f"checkpoint and the evaluator_crash budget allows {budget.max_attempts}; "
            "the count budget is spent.",
            budget_left={"count": 0, "gpu_seconds": None},
            **common,
        )
    backoff = budget.backoff.delay(spent_count)
    return RetryDecision(
        action=RetryAction.RETRY_EVALUATOR,
        rule="evaluator_crash_retry_evaluator",
        reason=f"Retry evaluator {ended.evaluator_name} after {backoff:.0f}s, never the "
        f"training; {left} more evaluator_crash retr{'y' if left == 1 else 'ies'} left.",
        budget_left={"count": left, "gpu_seconds": None},
        backoff_seconds=backoff,
        **common,
    )


# The rule of the ``stop`` recorded on an ended attempt when a person terminated the Dagster run
# that was about to continue the run in place (pipeline.attempts.stop_after_termination).
TERMINATED_BEFORE_CONTINUING = "terminated_before_continuing"


def decide_from_ledger(ledger: Ledger, policy: RetryPolicy, ended: AttemptRecord) -> RetryDecision:
    """:func:`decide` on the run's attempts and checkpoints as the ledger holds them now."""
    return decide(
        policy, ledger.attempts(ended.run_id), ended, checkpoints=ledger.checkpoints(ended.run_id)
    )


def record_decision(ledger: Ledger, ended: AttemptRecord, decision: RetryDecision) -> None:
    """Write ``decision`` on an attempt that has ended, keeping any earlier decision under
    ``previous`` (one ledger transaction: a decision written meanwhile is kept too), and
    supersede what a rollback passes over (:func:`supersede_after_rollback`)."""
    ledger.record_retry_decision(ended.run_id, ended.attempt_no, decision.to_json())
    supersede_after_rollback(ledger, ended, decision)


def end_with_decision(
    ledger: Ledger,
    attempt: AttemptRecord,
    decide_for: Callable[[AttemptRecord], RetryDecision],
    *,
    termination_reason: TerminationReason,
    termination_detail: str,
    **ending: Any,
) -> tuple[AttemptRecord, RetryDecision]:
    """End the open ``attempt`` with its retry decision in the same ledger write.

    ``decide_for`` gets the attempt as it reads once ended (the reason, status and
    GPU-seconds the policy counts), so no reader sees the attempt ended and undecided, and an
    attempt another process ended first keeps its own ending and decision
    (:class:`~pipeline.ledger.AttemptAlreadyEndedError`). ``ending`` is the rest of
    :meth:`~pipeline.ledger.Ledger.end_attempt`'s keywords.
    """
    preview = replace(
        attempt,
        status=str(attempt_status(termination_reason)),
        termination_reason=str(termination_reason),
        termination_detail=termination_detail,
        gpu_seconds=float(ending.get("gpu_seconds") or 0.0),
    )
    decision = decide_for(preview)
    ended = ledger.end_attempt(
        attempt.run_id,
        attempt.attempt_no,
        termination_reason=termination_reason,
        termination_detail=termination_detail,
        retry_decision=decision.to_json(),
        **ending,
    )
    supersede_after_rollback(ledger, ended, decision)
    return ended, decision


def supersede_after_rollback(ledger: Ledger, ended: AttemptRecord, decision: RetryDecision) -> None:
    """On a rollback, mark the committed checkpoints newer than its target superseded, with
    the reason, so nothing resumes from them again."""
    if decision.action != RetryAction.ROLLBACK:
        return
    committed = ledger.checkpoints(ended.run_id, [CheckpointState.COMMITTED])
    target = next((c for c in committed if c.path == decision.resume_from), None)
    if target is None and decision.resume_from == "previous committed" and committed:
        target = committed[-2] if len(committed) >= 2 else committed[-1]
    if target is None:
        return  # nothing committed to roll back to: the next attempt starts fresh
    for c in committed:
        if (c.step, c.attempt_no) > (target.step, target.attempt_no):
            ledger.set_checkpoint_state(
                ended.run_id,
                c.path,
                CheckpointState.SUPERSEDED,
                f"rolled back past it to step {target.step} after attempt "
                f"{ended.attempt_no} diverged (rule {decision.rule})",
            )
