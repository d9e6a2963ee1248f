"""Asset checks that run with their asset on every run (and decide a canary's verdict).

- ``loss_falls`` (warns): the attempt's loss fell while it trained.
- ``restores_in_new_process`` (blocking): the committed checkpoint restores in a brand-new
  process and reproduces its probe outputs, so evaluation never runs on one that does not.
- ``provenance_complete`` (blocking): every evaluation of the checkpoint has a complete
  provenance row in the ledger, so promotion never runs on incomplete provenance.

Each check reads what its asset recorded (materialization metadata) for the partition and
hands it to a ``judge_*`` function, which holds the logic and is testable without a run.
Partitioned asset checks are a preview feature in Dagster 1.13 (it warns once on load).
"""

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import dagster as dg

from assets.evaluation import evaluation
from assets.lineage import MissingUpstreamError, upstream_metadata
from assets.partitions import snapshot_partitions
from assets.training import committed_checkpoint, training_attempt
from pipeline import redact
from resources import LedgerResource

if TYPE_CHECKING:
    from pipeline.ledger import Ledger

LOSS_FALLS = "loss_falls"
RESTORES_IN_NEW_PROCESS = "restores_in_new_process"
PROVENANCE_COMPLETE = "provenance_complete"

# The final loss must be at least this much below the first: batch-to-batch noise alone
# (a learning rate of ~0) moves it by a percent or so, never by five.
LOSS_MIN_RELATIVE_DROP = 0.05
RESTORE_CHECK_TIMEOUT_SECONDS = 300

Metadata = Mapping[str, Any]


def _metadata(context: dg.AssetCheckExecutionContext, asset: str) -> dict[str, Any] | None:
    try:
        # upstream_metadata only needs the instance, which a check's context has too.
        return upstream_metadata(context, asset, context.partition_key)  # type: ignore[arg-type]
    except MissingUpstreamError:
        return None


def _not_materialized(
    check: str,
    asset: str,
    partition: str,
    severity: dg.AssetCheckSeverity = dg.AssetCheckSeverity.ERROR,
) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=check,
        passed=False,
        severity=severity,
        description=f"{asset} has no materialization for partition {partition}: nothing to check",
    )


# -- loss_falls ---------------------------------------------------------------------------------


def judge_loss_falls(attempt: Metadata | None, partition: str) -> dg.AssetCheckResult:
    """Pass when ``final_loss`` is at least ``LOSS_MIN_RELATIVE_DROP`` below ``first_loss``."""
    warn = dg.AssetCheckSeverity.WARN
    if attempt is None:
        return _not_materialized(LOSS_FALLS, "training_attempt", partition, warn)
    who = f"attempt {attempt.get('run_id')}#{attempt.get('attempt_no')}"
    first, final = attempt.get("first_loss"), attempt.get("final_loss")
    if first is None or final is None:
        return dg.AssetCheckResult(
            check_name=LOSS_FALLS,
            passed=False,
            severity=warn,
            description=f"{who} reported no losses (it trained no steps)",
        )
    first, final = float(first), float(final)
    drop = (first - final) / first if first > 0 else 0.0
    passed = final < first and drop >= LOSS_MIN_RELATIVE_DROP
    return dg.AssetCheckResult(
        check_name=LOSS_FALLS,
        passed=passed,
        severity=warn,
        description=(
            f"{who}: loss {'fell' if passed else 'did not fall enough'}: first {first:.4f} → "
            f"final {final:.4f} ({drop:+.1%} drop, needs ≥ {LOSS_MIN_RELATIVE_DROP:.0%})"
        ),
        metadata={
            "first_loss": first,
            "final_loss": final,
            "relative_drop": drop,
            "min_relative_drop": LOSS_MIN_RELATIVE_DROP,
        },
    )


@dg.asset_check(
    asset=training_attempt,
    name=LOSS_FALLS,
    partitions_def=snapshot_partitions,
    description=(
        f"The attempt's final loss is at least {LOSS_MIN_RELATIVE_DROP:.0%} below its first "
        "logged loss (warns: a short resumed attempt near convergence may not)."
    ),
)
def loss_falls(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    return judge_loss_falls(_metadata(context, "training_attempt"), context.partition_key)


# -- restores_in_new_process --------------------------------------------------------------------


def run_restore_check(checkpoint_path: str) -> tuple[int, dict[str, Any], str]:
    """Run ``python -m pipeline.checkpoint.restore_check``: (exit code, verdict, stderr)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.checkpoint.restore_check", checkpoint_path],
            capture_output=True,
            text=True,
            timeout=RESTORE_CHECK_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return -1, {}, f"restore_check did not finish in {RESTORE_CHECK_TIMEOUT_SECONDS} s"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    try:
        verdict = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        verdict = {}
    if isinstance(verdict.get("error"), str):
        verdict["error"] = redact.text(verdict["error"])  # stored as the check's metadata
    # Redacted whole, before any caller keeps only its tail: the tail may start inside a URL.
    return proc.returncode, verdict, redact.text(proc.stderr.strip())


def judge_restores_in_new_process(
    checkpoint: Metadata | None, partition: str
) -> dg.AssetCheckResult:
    """Pass when the checkpoint ``committed_checkpoint`` recorded restores in a new process."""
    if checkpoint is None:
        return _not_materialized(RESTORES_IN_NEW_PROCESS, "committed_checkpoint", partition)
    path = str(checkpoint["path"])
    returncode, verdict, stderr = run_restore_check(path)
    expected_sha = checkpoint.get("manifest_sha256")
    problem = None
    if returncode != 0 or not verdict.get("ok"):
        # The check's description is stored and shown: no URL password in it.
        problem = redact.text(
            str(verdict.get("error") or stderr[-2000:] or f"exit code {returncode}")
        )
    elif verdict.get("manifest_sha256") != expected_sha:
        problem = (
            f"restored manifest {verdict.get('manifest_sha256')}, but committed_checkpoint "
            f"recorded {expected_sha}"
        )
    metadata: dict[str, Any] = {
        "path": dg.MetadataValue.path(path),
        "exit_code": returncode,
        "verdict": dg.MetadataValue.json(verdict),
    }
    for key in ("step", "manifest_sha256", "probe_max_abs_diff", "seconds"):
        if verdict.get(key) is not None:
            metadata[key] = verdict[key]
    if problem:
        description = f"checkpoint {path} does not restore in a new process: {problem}"
    else:
        description = (
            f"step {verdict['step']} restored in a new process in {verdict['seconds']:.1f} s; "
            f"probe max abs diff {verdict['probe_max_abs_diff']:.3g} "
            f"({verdict['probe_comparison']})"
        )
    return dg.AssetCheckResult(
        check_name=RESTORES_IN_NEW_PROCESS,
        passed=problem is None,
        severity=dg.AssetCheckSeverity.ERROR,
        description=description,
        metadata=metadata,
    )


@dg.asset_check(
    asset=committed_checkpoint,
    name=RESTORES_IN_NEW_PROCESS,
    partitions_def=snapshot_partitions,
    blocking=True,
    description=(
        "A brand-new process verifies the checkpoint, rebuilds model and optimizer from its "
        "safetensors and JSON, re-runs the probe batch and matches the outputs saved with it."
    ),
)
def restores_in_new_process(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    return judge_restores_in_new_process(
        _metadata(context, "committed_checkpoint"), context.partition_key
    )


# -- provenance_complete ------------------------------------------------------------------------


def judge_provenance_complete(
    evaluated: Metadata | None,
    checkpoint: Metadata | None,
    ledger: "Ledger",
    partition: str,
) -> dg.AssetCheckResult:
    """Every evaluation id the ``evaluation`` asset recorded, and every required evaluator, has a
    complete provenance row in ``ledger`` for exactly the checkpoint's manifest sha256."""
    from pipeline.data.snapshot import family_of_snapshot
    from pipeline.evaluation import required_evaluators
    from pipeline.promotion.families import gate_for_family
    from pipeline.states import EvaluationStatus

    if evaluated is None:
        return _not_materialized(PROVENANCE_COMPLETE, "evaluation", partition)
    sha = str(evaluated.get("checkpoint_manifest_sha256") or "")
    evaluation_ids = [str(i) for i in evaluated.get("evaluation_ids") or []]
    problems: list[str] = []
    if checkpoint is not None and checkpoint.get("manifest_sha256") != sha:
        problems.append(
            f"the evaluation is of checkpoint manifest {sha or '(none)'}, but "
            f"committed_checkpoint is {checkpoint.get('manifest_sha256')}"
        )
    if not evaluation_ids:
        problems.append("the evaluation recorded no evaluation ids")
    family = family_of_snapshot(partition)
    gate = gate_for_family(family)
    rows = {r.evaluation_id: r for r in ledger.evaluations_for_checkpoint(sha)}
    evaluators: dict[str, list[str]] = {}
    recorded = {}
    for evaluation_id in evaluation_ids:
        row = rows.get(evaluation_id)
        if row is None:
            problems.append(
                f"evaluation {evaluation_id} has no ledger row for checkpoint manifest {sha}"
            )
            continue
        evaluators.setdefault(row.evaluator_name, []).append(evaluation_id)
        recorded[row.evaluator_name] = row
        if row.status != EvaluationStatus.COMPLETE:
            problems.append(
                f"evaluation {evaluation_id} ({row.evaluator_name}) is {row.status}: "
                f"{row.detail or 'no detail'}"
            )
        # A field the evaluator states does not apply to it (contamination has no slices) is
        # not missing; the gate below refuses any other "not applicable".
        declared = gate.not_applicable.get(row.evaluator_name, {})
        missing = [name for name in row.missing_provenance() if name not in declared]
        if missing:
            problems.append(
                f"evaluation {evaluation_id} ({row.evaluator_name}) is missing {', '.join(missing)}"
            )
    for name in required_evaluators(family):
        if name not in evaluators:
            problems.append(f"required evaluator {name} has no evaluation of this checkpoint")
    # The family's own fields (a text-lm generation evaluation's prompt set, template, decoding,
    # seed, judge...), judged as the promotion gate judges them.
    problems += gate.recorded_provenance_problems(recorded)
    if problems:
        description = f"incomplete provenance for checkpoint {sha}: " + "; ".join(problems)
    else:
        description = (
            f"{len(evaluation_ids)} evaluations ({', '.join(sorted(evaluators))}) of checkpoint "
            f"{sha[:12]} have complete provenance"
        )
    return dg.AssetCheckResult(
        check_name=PROVENANCE_COMPLETE,
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        description=description,
        metadata={
            "checkpoint_manifest_sha256": sha,
            "evaluation_ids": dg.MetadataValue.json(evaluation_ids),
            "evaluators": dg.MetadataValue.json(evaluators),
            "problems": dg.MetadataValue.json(problems),
        },
    )


@dg.asset_check(
    asset=evaluation,
    name=PROVENANCE_COMPLETE,
    partitions_def=snapshot_partitions,
    blocking=True,
    description=(
        "Every evaluation recorded for the checkpoint, and every required evaluator, has a "
        "complete provenance row in the ledger for exactly this checkpoint manifest."
    ),
)
def provenance_complete(
    context: dg.AssetCheckExecutionContext, ledger: LedgerResource
) -> dg.AssetCheckResult:
    return judge_provenance_complete(
        _metadata(context, "evaluation"),
        _metadata(context, "committed_checkpoint"),
        ledger.ledger(),
        context.partition_key,
    )


ALL_CHECKS = [loss_falls, restores_in_new_process, provenance_complete]
