"""One MLflow run per training run, continuous across attempts, on the run's true global steps.

The trainer buffers its step metrics (loss, learning rate, throughput) and logs them to MLflow
only when a checkpoint that covers them commits. A step trained after the last commit and lost
to a SIGKILL is never logged; the next attempt re-trains it from the restored checkpoint and
logs it then — so each metric has exactly one value per step, and the curve in MLflow is the
curve of the checkpoints that exist. A step already logged (a rollback re-trains steps past its
restore point) keeps its first committed value; the attempt's tags say where it restored.

A background commit can land after the trainer's last look at it, just before a SIGKILL: its
steps were committed but never logged. So every buffered step is also appended to a journal in
the run's checkpoint folder (``metrics-aNN.jsonl``), and an attempt starts by logging, from the
journals, the steps its restored checkpoint covers that MLflow does not have yet.

Tracking never stops training: the first MLflow error is reported once and tracking is off for
the rest of the attempt. The MLflow URI comes from the environment (``TRACKS_MLFLOW_URI``), never
the command line.

The ledger has the last word: once it closes an attempt, :func:`mirror_attempt` writes its
termination reason, sentence and Dagster run onto the MLflow run and ends the run's RUNNING
status with the one that reason implies.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import envvars, redact
from pipeline.durable import make_dir_durably

if TYPE_CHECKING:
    from pipeline.ledger import Ledger

log = logging.getLogger(__name__)

TRAINING_EXPERIMENT = "tracks-training"
RUN_TAG = "tracks.run_id"
STEP_METRICS = ("loss", "lr", "examples_per_second")


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(f"{prefix}{key}.", inner, out)
    else:
        out[prefix.rstrip(".")] = str(value)[:6000]


class TrainingTracker:
    """Buffers step metrics and logs them, with the commit, when a checkpoint commits."""

    def __init__(
        self,
        *,
        tracking_uri: str,
        artifact_root: str | None,
        run_id: str,
        attempt_no: int,
        config: Mapping[str, Any],
        tags: Mapping[str, str],
        warn: Callable[[str], None],
        run_dir: Path,
        restored_step: int,
    ) -> None:
        from mlflow import MlflowClient

        self._warn = warn
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self.mlflow_run_id = self._find_or_create(run_id, artifact_root, config)
        # An earlier attempt's end set the run FINISHED, KILLED or FAILED: it runs again now.
        self._client.update_run(self.mlflow_run_id, status="RUNNING")
        self._logged_up_to = self._last_logged_step()
        make_dir_durably(run_dir)  # before the first checkpoint would create it
        self._journal = run_dir / f"metrics-a{attempt_no:02d}.jsonl"
        self._journal_warned = False
        # Steps the restored checkpoint covers that an earlier attempt never got to log.
        self._pending = [
            (s, m) for s, m in _read_journals(run_dir) if self._logged_up_to < s <= restored_step
        ]
        self.enabled = True
        if restored_step > self._logged_up_to:
            # The restored checkpoint is a commit the earlier attempt may never have reported.
            self.committed(restored_step, {})
        self._client.set_tag(self.mlflow_run_id, f"tracks.attempt.{attempt_no}", "started")
        for key, value in tags.items():
            if value:  # an empty tag says nothing (a trainer started outside Dagster)
                self._client.set_tag(
                    self.mlflow_run_id, f"tracks.attempt.{attempt_no}.{key}", value
                )

    @classmethod
    def start(cls, warn: Callable[[str], None], **kwargs: Any) -> TrainingTracker | None:
        """A tracker, or None (with one warning) when MLflow is not reachable."""
        try:
            return cls(warn=warn, **kwargs)
        except Exception as exc:  # tracking must never stop training
            warn(f"MLflow tracking is off for this attempt: {type(exc).__name__}: {exc}")
            return None

    def _find_or_create(
        self, run_id: str, artifact_root: str | None, config: Mapping[str, Any]
    ) -> str:
        experiment = self._client.get_experiment_by_name(TRAINING_EXPERIMENT)
        if experiment is None:
            experiment_id = self._client.create_experiment(
                TRAINING_EXPERIMENT,
                artifact_location=f"{artifact_root}/{TRAINING_EXPERIMENT}"
                if artifact_root
                else None,
            )
        else:
            experiment_id = experiment.experiment_id
        found = _search(self._client, experiment_id, run_id)
        if found:
            return found
        run = self._client.create_run(experiment_id, run_name=run_id, tags={RUN_TAG: run_id})
        params: dict[str, str] = {}
        _flatten("", dict(config), params)
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for start in range(0, len(items), 100):
            self._client.log_batch(run.info.run_id, params=items[start : start + 100])
        return run.info.run_id

    def _last_logged_step(self) -> int:
        """The newest step MLflow holds: a loss, or a commit logged past the last loss (a
        checkpoint between two logged steps), which a resumed attempt must not log again."""
        return max(
            (
                m.step
                for name in ("loss", "checkpoint.step")
                for m in self._client.get_metric_history(self.mlflow_run_id, name)
            ),
            default=0,
        )

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        values = {k: float(metrics[k]) for k in STEP_METRICS if k in metrics}
        self._pending.append((step, values))
        try:
            with open(self._journal, "a") as journal:
                journal.write(json.dumps({"step": step, **values}) + "\n")
        except OSError as exc:
            if not self._journal_warned:  # once: it is a gap in a curve, not a failure
                self._journal_warned = True
                self._warn(f"metrics journal {self._journal} not written: {exc}")

    def committed(self, step: int, checkpoint_metrics: Mapping[str, float]) -> None:
        """Log every buffered step up to ``step`` (now covered by a checkpoint) and the commit."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        due = [(s, m) for s, m in self._pending if s <= step and s > self._logged_up_to]
        self._pending = [(s, m) for s, m in self._pending if s > step]
        metrics = [Metric(k, v, now, s) for s, values in due for k, v in values.items()]
        if step > self._logged_up_to:
            metrics += [Metric(f"checkpoint.{k}", float(v), now, step)
                        for k, v in checkpoint_metrics.items()]  # fmt: skip
            metrics.append(Metric("checkpoint.step", float(step), now, step))
        try:
            for start in range(0, len(metrics), 500):
                self._client.log_batch(self.mlflow_run_id, metrics=metrics[start : start + 500])
        except Exception as exc:
            self.enabled = False
            self._warn(f"MLflow tracking stopped: {type(exc).__name__}: {exc}")
            return
        self._logged_up_to = max(self._logged_up_to, step)

    def finished(self, attempt_no: int, reason: str, *, final: bool) -> None:
        """The trainer's own ending: the run leaves RUNNING with the status ``reason`` implies.

        An orchestrator that classifies the attempt afterwards (the ledger's reason may differ
        from what the trainer saw) corrects both through :func:`mirror_attempt`. ``final`` is
        kept for callers: a succeeded attempt is FINISHED either way.
        """
        if not self.enabled:
            return
        try:
            self._client.set_tag(self.mlflow_run_id, f"tracks.attempt.{attempt_no}", reason)
            self._client.set_tag(self.mlflow_run_id, TERMINATION_REASON_TAG, reason)
            self._client.set_terminated(
                self.mlflow_run_id, "FINISHED" if final else mlflow_status(reason)
            )
        except Exception as exc:
            self._warn(f"MLflow tracking stopped: {type(exc).__name__}: {exc}")


def _read_journals(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """Every journalled step, the newest attempt's value where two attempts trained one step."""
    by_step: dict[int, dict[str, float]] = {}
    for path in sorted(run_dir.glob("metrics-a*.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
                step = int(entry.pop("step"))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            by_step[step] = {k: float(v) for k, v in entry.items() if k in STEP_METRICS}
    return sorted(by_step.items())


def _search(client: Any, experiment_id: str, run_id: str) -> str | None:
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1
    )
    return found[0].info.run_id if found else None


def _training_run(client: Any, run_id: str) -> str | None:
    """The MLflow run of ledger run ``run_id``, or None; MLflow's errors are raised."""
    experiment = client.get_experiment_by_name(TRAINING_EXPERIMENT)
    return None if experiment is None else _search(client, experiment.experiment_id, run_id)


def training_run_of(client: Any, run_id: str) -> str | None:
    """The MLflow run that tracks ledger run ``run_id``, or None (tracking was off)."""
    try:
        return _training_run(client, run_id)
    except Exception:  # a link is worth trying, never worth failing an evaluation over
        return None


TRAINING_RUN_TAG = "tracks.training_mlflow_run"

TERMINATION_REASON_TAG = "tracks.termination_reason"
TERMINATION_DETAIL_TAG = "tracks.termination_detail"
# MLflow's statuses for the ledger's reasons: a preempted, cancelled or fenced attempt was
# stopped from outside (KILLED), not a failure of the training; every other reason FAILED.
_STATUS_OF_REASON = {
    "succeeded": "FINISHED",
    "preempted": "KILLED",
    "cancelled": "KILLED",
    "fenced": "KILLED",
}
_MAX_TAG_CHARS = 5000  # MLflow refuses longer tag values on some stores


def mlflow_status(reason: str) -> str:
    """The MLflow run status that tells the truth about an attempt ended with ``reason``."""
    return _STATUS_OF_REASON.get(reason, "FAILED")


def _store_missing(tracking_uri: str) -> bool:
    """A SQLite store that does not exist holds no run; opening it would create it."""
    if not tracking_uri.startswith("sqlite:"):
        return False
    import sqlalchemy as sa

    database = sa.engine.make_url(tracking_uri).database
    return not database or not Path(database).is_file()


def mirror_attempt(
    ledger: Ledger, run_id: str, attempt_no: int, *, tracking_uri: str | None
) -> str | None:
    """Make the MLflow run of ledger run ``run_id`` say what the ledger says of attempt N.

    Called after the ledger closes an attempt. Per attempt: ``tracks.attempt.N`` is its
    termination reason, ``…N.termination_detail`` the ledger's sentence and ``…N.dagster_run_id``
    the Dagster run that ran it. When it is the run's newest attempt, the run's
    ``tracks.termination_reason`` / ``tracks.termination_detail`` tags are set and the run
    leaves RUNNING: FINISHED when it succeeded, KILLED when it was preempted, cancelled or
    fenced, FAILED otherwise (a newer attempt that is still open keeps the run RUNNING).

    Never raises: returns a sentence saying what could not be written (tracking never stops
    the pipeline), or None. No MLflow run (tracking was off) is nothing to mirror.
    """
    if not tracking_uri or _store_missing(tracking_uri):
        return None
    try:
        attempt = ledger.get_attempt(run_id, attempt_no)
        if attempt.ended_at is None:
            return None
        reason = attempt.termination_reason or "unknown"
        detail = (attempt.termination_detail or "")[:_MAX_TAG_CHARS]
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        mlflow_run = _training_run(client, run_id)
        if mlflow_run is None:
            return None
        prefix = f"tracks.attempt.{attempt_no}"
        tags = {prefix: reason, f"{prefix}.termination_detail": detail}
        if attempt.dagster_run_id:
            tags[f"{prefix}.dagster_run_id"] = attempt.dagster_run_id
        newest = ledger.latest_attempt(run_id)
        is_newest = newest is not None and newest.attempt_no == attempt_no
        if is_newest:
            tags |= {TERMINATION_REASON_TAG: reason, TERMINATION_DETAIL_TAG: detail}
        for key, value in tags.items():
            client.set_tag(mlflow_run, key, value)
        if is_newest:
            client.set_terminated(mlflow_run, mlflow_status(reason))
    except Exception as exc:
        return redact.one_line(
            f"MLflow run of {run_id} not updated after attempt {attempt_no}: "
            f"{type(exc).__name__}: {exc}"
        )
    return None


def mirror_in_trainer_env(ledger: Ledger, run_id: str, attempt_no: int) -> str | None:
    """:func:`mirror_attempt` to the MLflow the trainer's environment names
    (``TRACKS_MLFLOW_URI``): for a launcher that runs with the trainer's environment."""
    return mirror_attempt(ledger, run_id, attempt_no, tracking_uri=envvars.TRACKS_MLFLOW_URI.get())
