"""One MLflow run per training run, continuous across attempts, on the run's true global steps.

**Live.** Every logged step (each ``log_every_steps``) sends its ``loss``, ``lr`` and
``examples_per_second`` to MLflow while the run trains, on the run's global step. The tracker
does its MLflow work on a thread of its own (``import mlflow`` and finding the run included), so
a slow or unreachable MLflow never holds up a step: the training thread only queues points.
Checkpoint commits add ``checkpoint.*`` metrics on the commit's step and move the run's link
to its newest checkpoint (tags ``tracks.checkpoint_path``, ``…_manifest_sha256``, ``…_step``).
The run's dataset is logged as an MLflow input: the snapshot's folder and manifest digest, no
copy of the data.

**One value per step.** A resumed attempt re-trains the steps between its restored checkpoint
and the end of the attempt before it, which that attempt already logged. Resume is bit-exact
(weights, optimizer, RNG and data cursor are restored, the CPU kernels are deterministic), so the
value it computes for such a step is the value MLflow already holds: the tracker logs, per
metric, only the steps past the newest one MLflow holds. The rule before this one logged a step
only once a checkpoint covering it had committed, so a curve lagged a whole checkpoint interval
behind training.

**Rollback.** A rollback (a loss spike restores an older checkpoint and deals other batches)
re-trains steps on other data, so their new values differ. MLflow keeps the first value of each
step, and the run's tag ``tracks.rollback.<step>`` says which attempt restored ``<step>``, behind
which commit, and which steps kept their first values.

**Flushes and the journal.** At each commit the tracker waits (at most
:data:`FLUSH_AT_COMMIT_SECONDS`) until MLflow holds every point queued so far; the attempt's end
waits at most :data:`END_FLUSH_SECONDS`, a stopped one :data:`STOP_FLUSH_SECONDS` (a preempted
pod has a grace period to keep). Live logging cannot promise more without holding up training:
an attempt can end before MLflow took its points (MLflow slow or down, or the tracker's thread
still starting when a short attempt was preempted), and the steps its last checkpoint covers are
exactly the ones no later attempt trains again. So every logged step, every commit and the
attempt's own tags are also appended, on the training thread, to a journal beside the
checkpoints (``metrics-aNN.jsonl``, a line each), and an attempt's tracker starts by logging,
from the journals, the steps and commits its restored checkpoint covers that MLflow does not
hold yet (the newest attempt's value where two trained one step) and the earlier attempts' tags
MLflow lacks (never overwriting one). The journal is what makes a run whole after such an
ending; without it a gap would stay.

Tracking never stops training: the first MLflow error is reported once (on the training thread)
and tracking is off for the rest of the attempt. The MLflow URI comes from the environment
(``TRACKS_MLFLOW_URI``), never the command line.

The ledger has the last word: once it closes an attempt, :func:`mirror_attempt` writes its
termination reason, sentence and Dagster run onto the MLflow run and ends the run's RUNNING
status with the one that reason implies.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import envvars, redact

if TYPE_CHECKING:
    from pipeline.ledger import Ledger

TRAINING_EXPERIMENT = "tracks-training"
RUN_TAG = "tracks.run_id"
STEP_METRICS = ("loss", "lr", "examples_per_second")
# The training run's link to its newest committed checkpoint, moved at each commit; the
# evaluation runs and model versions name the checkpoint they are about with the same keys.
CHECKPOINT_PATH_TAG = "tracks.checkpoint_path"
CHECKPOINT_SHA_TAG = "tracks.checkpoint_manifest_sha256"
CHECKPOINT_STEP_TAG = "tracks.checkpoint_step"
SNAPSHOT_TAG = "tracks.snapshot_id"
SNAPSHOT_SHA_TAG = "tracks.snapshot_manifest_sha256"
# The newest promotion decision about the run's checkpoint, in a sentence.
PROMOTION_TAG = "tracks.promotion"
DAGSTER_RUN_TAG = "tracks.dagster_run_id"
DAGSTER_URL_TAG = "tracks.dagster_run_url"
ROLLBACK_TAG_PREFIX = "tracks.rollback."
# How long the training thread waits for MLflow to catch up, at a commit and at the end.
FLUSH_AT_COMMIT_SECONDS = 2.0
END_FLUSH_SECONDS = 60.0
# A stopped attempt (SIGTERM) has a grace period to keep: its checkpoint is already saved.
STOP_FLUSH_SECONDS = 10.0
_STOPPED_FROM_OUTSIDE = ("preempted", "cancelled")
# How long `mlflow_run_id` waits for the tracker's thread to find or create the run.
SETUP_WAIT_SECONDS = 120.0
# Pauses between the tries of one batch before tracking gives up (the training thread never
# waits for them: it only queues).
_RETRY_PAUSES = (0.5, 2.0)
_BATCH_METRICS = 1000  # log_batch takes at most 1000 metrics and 100 tags a call
_BATCH_TAGS = 100
_DATASET_CONTEXT = "training"
_MAX_DATASET_DIGEST = 36  # MLflow's datasets table holds a digest of at most 36 characters


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(f"{prefix}{key}.", inner, out)
    else:
        out[prefix.rstrip(".")] = str(value)[:6000]


class TrainingTracker:
    """Logs one attempt of a training run to its MLflow run, live, from a thread of its own.

    The constructor touches neither MLflow nor the network: it starts the thread and returns.
    Every method is called from the training thread and only queues work, except
    :meth:`committed` and :meth:`finished`, which wait a bounded time for MLflow to catch up.
    """

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
        self._tracking_uri = tracking_uri
        self._artifact_root = artifact_root
        self._run_id = run_id
        self._attempt_no = attempt_no
        self._config = dict(config)
        self._tags = {k: v for k, v in tags.items() if v}  # an empty tag says nothing
        self._warn = warn
        self._run_dir = Path(run_dir)
        self._restored_step = restored_step
        self._client: Any = None
        self._mlflow_run_id: str | None = None
        # Worker-thread state: the newest step MLflow holds, per step metric and for commits.
        self._newest: dict[str, int] = {}
        self._newest_commit = 0
        # Set by the worker, read by the training thread.
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._unreported: list[str] = []
        self._ready = threading.Event()
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._ended = False
        self._journal = self._run_dir / f"metrics-a{attempt_no:02d}.jsonl"
        self._journal_warned = False
        self._start_tags = self._attempt_tags()
        self._write_journal({"tags": self._start_tags})
        if restored_step > 0:
            # The restored checkpoint is a commit, which the attempt that wrote it may never
            # have reported (a background save that landed just before a kill).
            self._write_journal({"commit": restored_step, "metrics": {}})
        self._thread = threading.Thread(
            target=self._work, name=f"mlflow-tracker-{run_id}", daemon=True
        )
        self._thread.start()

    @classmethod
    def start(cls, warn: Callable[[str], None], **kwargs: Any) -> TrainingTracker | None:
        """A tracker for this attempt; it returns at once (see the class). None only when the
        arguments themselves are wrong, with one warning: tracking never stops training."""
        try:
            return cls(warn=warn, **kwargs)
        except Exception as exc:
            warn(f"MLflow tracking is off for this attempt: {type(exc).__name__}: {exc}")
            return None

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run's id, once the tracker's thread has found or created it (it waits up
        to :data:`SETUP_WAIT_SECONDS`); None when tracking is off."""
        self._ready.wait(SETUP_WAIT_SECONDS)
        return self._mlflow_run_id

    @property
    def enabled(self) -> bool:
        """False once an MLflow error has turned tracking off for this attempt."""
        with self._lock:
            return self._failure is None

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Queue one logged step's metrics (those of :data:`STEP_METRICS` present)."""
        self._report()
        if self._ended:
            return
        values = {k: float(metrics[k]) for k in STEP_METRICS if k in metrics}
        self._write_journal({"step": step, **values})  # MLflow off or not: see the module
        if self.enabled:
            self._queue.put(("step", step, values, _now_ms()))

    def _write_journal(self, entry: Mapping[str, Any]) -> None:
        try:
            if not self._journal.parent.is_dir():  # before the first checkpoint made it
                self._journal.parent.mkdir(parents=True, exist_ok=True)
            with open(self._journal, "a") as journal:
                journal.write(json.dumps(entry) + "\n")
        except OSError as exc:
            if not self._journal_warned:  # once: it is a gap in a curve, not a failure
                self._journal_warned = True
                self._warn(f"metrics journal {self._journal} not written: {exc}")

    def committed(
        self,
        step: int,
        checkpoint_metrics: Mapping[str, float],
        *,
        path: str | None = None,
        manifest_sha256: str | None = None,
    ) -> None:
        """A checkpoint committed at ``step``: its metrics, and the run's checkpoint link.

        ``path`` and ``manifest_sha256`` default to this attempt's checkpoint folder for
        ``step`` and the digest of its ``MANIFEST.json``. Waits at most
        :data:`FLUSH_AT_COMMIT_SECONDS` for MLflow to hold everything queued so far.
        """
        self._report()
        if self._ended:
            return
        metrics = {k: float(v) for k, v in checkpoint_metrics.items()}
        self._write_journal({"commit": step, "metrics": metrics})
        if not self.enabled:
            return
        self._queue.put(("commit", step, metrics, path, manifest_sha256, _now_ms()))
        self.flush(FLUSH_AT_COMMIT_SECONDS)
        self._report()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until MLflow holds every point queued so far."""
        if self._ended or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def finished(self, attempt_no: int, reason: str, *, final: bool) -> None:
        """The trainer's own ending: the run leaves RUNNING with the status ``reason`` implies.

        An orchestrator that classifies the attempt afterwards (the ledger's reason may differ
        from what the trainer saw) corrects both through :func:`mirror_attempt`. ``final`` is
        kept for callers: a succeeded attempt is FINISHED either way. Waits at most
        :data:`END_FLUSH_SECONDS` (:data:`STOP_FLUSH_SECONDS` when stopped from outside) for
        MLflow to take what is queued (the thread's set-up included), then the thread stops.
        """
        self._report()
        if self._ended:
            return
        status = "FINISHED" if final else mlflow_status(reason)
        self._write_journal({"tags": {f"tracks.attempt.{attempt_no}": reason}})
        self._queue.put(("end", attempt_no, reason, status))
        wait = STOP_FLUSH_SECONDS if reason in _STOPPED_FROM_OUTSIDE else END_FLUSH_SECONDS
        caught_up = self.flush(wait)
        self._queue.put(("stop",))
        self._ended = True
        if not caught_up:
            self._warn(
                f"MLflow did not take this attempt's last points within {wait:g} s; its curve "
                "may end early and the ledger's mirror sets the run's status"
            )
        self._report()

    # -- the training thread's side of problems found on the tracker's thread -------------

    def _report(self) -> None:
        with self._lock:
            problems, self._unreported = self._unreported, []
        for problem in problems:
            self._warn(problem)

    def _fail(self, problem: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = problem
                self._unreported.append(problem)

    # -- the tracker's thread --------------------------------------------------------------

    def _work(self) -> None:
        for pause in (*_RETRY_PAUSES, None):
            try:
                self._setup()
                break
            except Exception as exc:  # two trainers creating one SQLite store race, for one
                if pause is None:
                    self._fail(f"MLflow tracking is off for this attempt: {_describe(exc)}")
                else:
                    time.sleep(pause)
        self._ready.set()
        while True:
            items = [self._queue.get()]
            while len(items) < _BATCH_METRICS:  # whatever else is queued goes in one batch
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._handle(items):
                return

    def _handle(self, items: list[tuple[Any, ...]]) -> bool:
        """Log ``items`` in one go; True when one of them asks the thread to stop."""
        from mlflow.entities import Metric

        points: list[Metric] = []
        tags: dict[str, str] = {}
        waiting: list[threading.Event] = []
        status: str | None = None
        stop = False
        on = self.enabled
        for item in items:
            kind = item[0]
            if kind == "flush":
                waiting.append(item[1])
            elif kind == "stop":
                stop = True
            elif not on:
                continue
            elif kind == "step":
                _, step, values, at = item
                for name, value in values.items():
                    if step > self._newest.get(name, 0):
                        points.append(Metric(name, value, at, step))
                        self._newest[name] = step
            elif kind == "commit":
                _, step, metrics, path, sha, at = item
                points += self._commit_points(step, metrics, at)
                tags |= self._checkpoint_tags(step, path, sha)
            elif kind == "end":
                _, attempt_no, reason, status = item
                tags |= {f"tracks.attempt.{attempt_no}": reason, TERMINATION_REASON_TAG: reason}
        if on and (points or tags or status):
            for pause in (*_RETRY_PAUSES, None):
                try:
                    self._log(points, tags)
                    if status is not None:
                        self._client.set_terminated(self._mlflow_run_id, status)
                    break
                except Exception as exc:
                    if pause is None:
                        self._fail(f"MLflow tracking stopped: {_describe(exc)}")
                    else:  # a locked SQLite store or a server restarting: off this thread
                        time.sleep(pause)
        for done in waiting:
            done.set()
        return stop

    def _commit_points(self, step: int, metrics: Mapping[str, float], at: int) -> list[Any]:
        from mlflow.entities import Metric

        if step <= self._newest_commit:
            return []  # a commit MLflow holds already (a resumed attempt's restored one)
        self._newest_commit = step
        points = [Metric(f"checkpoint.{k}", v, at, step) for k, v in metrics.items()]
        return [*points, Metric("checkpoint.step", float(step), at, step)]

    def _checkpoint_tags(self, step: int, path: str | None, sha: str | None) -> dict[str, str]:
        from pipeline.checkpoint.layout import MANIFEST_FILE, checkpoint_dir_name

        folder = Path(path) if path else self._run_dir / checkpoint_dir_name(step, self._attempt_no)
        tags = {CHECKPOINT_PATH_TAG: str(folder), CHECKPOINT_STEP_TAG: str(step)}
        if sha is None:
            try:  # the digest the ledger and COMMITTED record: sha256 of MANIFEST.json
                sha = hashlib.sha256((folder / MANIFEST_FILE).read_bytes()).hexdigest()
            except OSError:
                sha = None  # pruned already: the path still says which commit it was
        if sha:
            tags[CHECKPOINT_SHA_TAG] = sha
        return tags

    def _log(self, points: list[Any], tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        # Synchronous on this thread whatever MLFLOW_ENABLE_ASYNC_LOGGING says: its errors and
        # its flushes are this tracker's to see.
        run, items = self._mlflow_run_id, [RunTag(k, v) for k, v in tags.items()]
        for start in range(0, len(points), _BATCH_METRICS):
            batch = points[start : start + _BATCH_METRICS]
            self._client.log_batch(run, metrics=batch, synchronous=True)
        for start in range(0, len(items), _BATCH_TAGS):
            self._client.log_batch(run, tags=items[start : start + _BATCH_TAGS], synchronous=True)

    def _setup(self) -> None:
        from mlflow import MlflowClient

        from pipeline.mlflow_setup import dagster_run_url, ensure_experiment, store_ready

        store_ready(self._tracking_uri)
        self._client = client = MlflowClient(tracking_uri=self._tracking_uri)
        root = self._artifact_root
        experiment_id = ensure_experiment(
            client, TRAINING_EXPERIMENT, f"{root}/{TRAINING_EXPERIMENT}" if root else None
        )
        self._mlflow_run_id = run = self._find_or_create(experiment_id)
        # An earlier attempt's end set the run FINISHED, KILLED or FAILED: it runs again now.
        client.update_run(run, status="RUNNING")
        for name in STEP_METRICS:
            self._newest[name] = _newest_step(client, run, name)
        self._newest_commit = _newest_step(client, run, "checkpoint.step")
        points, journalled = self._backfill()
        present = client.get_run(run).data.tags
        # Earlier attempts' tags they never got to set: filled in, never overwritten (the
        # ledger's mirror may have corrected them since).
        tags = {k: v for k, v in journalled.items() if k not in present}
        self._log(points, {})
        tags |= self._start_tags
        if dagster_run := self._tags.get("dagster_run_id"):
            # The run's Dagster run is its newest attempt's; each attempt keeps its own.
            tags |= {DAGSTER_RUN_TAG: dagster_run, DAGSTER_URL_TAG: dagster_run_url(dagster_run)}
        restored = self._restored_step
        if restored < self._newest_commit:
            tags[f"{ROLLBACK_TAG_PREFIX}{restored}"] = self._rollback_sentence()
        self._log([], tags)
        if restored > self._newest_commit:
            # The restored checkpoint is a commit the earlier attempt never got to report.
            from mlflow.entities import Metric

            self._log([Metric("checkpoint.step", float(restored), _now_ms(), restored)], {})
            self._newest_commit = restored
        self._log_dataset()

    def _attempt_tags(self) -> dict[str, str]:
        """``tracks.attempt.N`` ("started") and ``tracks.attempt.N.<key>`` for this attempt."""
        prefix = f"tracks.attempt.{self._attempt_no}"
        tags = {prefix: "started", **{f"{prefix}.{k}": v for k, v in self._tags.items()}}
        if dagster_run := self._tags.get("dagster_run_id"):
            from pipeline.mlflow_setup import dagster_run_url

            tags[f"{prefix}.dagster_run_url"] = dagster_run_url(dagster_run)
        return tags

    def _backfill(self) -> tuple[list[Any], dict[str, str]]:
        """From the journals: the points of the steps and commits the restored checkpoint covers
        that MLflow lacks (commits as :meth:`committed` logs them), and every attempt's tags."""
        from mlflow.entities import Metric

        steps, commits, tags = _read_journals(self._run_dir)
        points, at = [], _now_ms()
        for step, values in steps:
            for name, value in values.items():
                if self._newest.get(name, 0) < step <= self._restored_step:
                    points.append(Metric(name, value, at, step))
                    self._newest[name] = max(self._newest.get(name, 0), step)
        for step, metrics in commits:
            if self._newest_commit < step <= self._restored_step:
                points += self._commit_points(step, metrics, at)
        return points, tags

    def _rollback_sentence(self) -> str:
        restored, newest = self._restored_step, max(self._newest.values(), default=0)
        kept = (
            f"; steps {restored + 1}-{newest} keep the values first logged"
            if newest > restored
            else ""
        )
        return (
            f"attempt {self._attempt_no} restored step {restored}, behind the commit at step "
            f"{self._newest_commit}, and trains the steps after it again{kept}"
        )

    def _find_or_create(self, experiment_id: str) -> str:
        found = _search(self._client, experiment_id, self._run_id)
        if found:
            return found
        run = self._client.create_run(
            experiment_id, run_name=self._run_id, tags={RUN_TAG: self._run_id}
        )
        params: dict[str, str] = {}
        _flatten("", self._config, params)
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for start in range(0, len(items), 100):
            self._client.log_batch(run.info.run_id, params=items[start : start + 100])
        return run.info.run_id

    def _log_dataset(self) -> None:
        """The snapshot as the run's input: its folder and manifest digest, never the data."""
        snapshot_dir = self._config.get("snapshot_dir")
        if not snapshot_dir:
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag, RunTag

        from pipeline.data.snapshot import MANIFEST_NAME

        folder = Path(snapshot_dir)
        raw = (folder / MANIFEST_NAME).read_bytes()
        sha = self._tags.get("snapshot_manifest_sha256") or hashlib.sha256(raw).hexdigest()
        run = self._client.get_run(self._mlflow_run_id)
        logged = {d.dataset.digest for d in (run.inputs.dataset_inputs if run.inputs else [])}
        if sha[:_MAX_DATASET_DIGEST] in logged:
            return  # an earlier attempt logged it
        manifest = json.loads(raw)
        snapshot_id = self._tags.get("snapshot_id") or folder.name
        profile = {"snapshot_id": snapshot_id, "manifest_sha256": sha}
        if isinstance(manifest, dict) and "row_count" in manifest:
            profile["rows"] = manifest["row_count"]
        dataset = Dataset(
            name=snapshot_id,
            digest=sha[:_MAX_DATASET_DIGEST],
            source_type="local",
            source=json.dumps({"uri": folder.resolve().as_uri()}),
            profile=json.dumps(profile),
        )
        context = InputTag("mlflow.data.context", _DATASET_CONTEXT)
        self._client.log_inputs(
            self._mlflow_run_id, datasets=[DatasetInput(dataset, tags=[context])]
        )
        self._client.log_batch(
            self._mlflow_run_id,
            tags=[RunTag(SNAPSHOT_TAG, snapshot_id), RunTag(SNAPSHOT_SHA_TAG, sha)],
        )


def _read_journals(
    run_dir: Path,
) -> tuple[list[tuple[int, dict[str, float]]], list[tuple[int, dict[str, float]]], dict[str, str]]:
    """Every journalled step and commit in step order, the newest attempt's where two attempts
    wrote one step (the attempt numbers order the files), and the attempts' tags, later ones
    over earlier; lines cut short by a kill are skipped."""
    steps: dict[int, dict[str, float]] = {}
    commits: dict[int, dict[str, float]] = {}
    tags: dict[str, str] = {}
    for path in sorted(run_dir.glob("metrics-a*.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
                if "tags" in entry:
                    tags |= {str(k): str(v) for k, v in entry["tags"].items()}
                elif "commit" in entry:  # a restored commit's line adds no metrics
                    metrics = {k: float(v) for k, v in entry["metrics"].items()}
                    commits.setdefault(int(entry["commit"]), {}).update(metrics)
                else:
                    step = int(entry.pop("step"))
                    steps[step] = {k: float(v) for k, v in entry.items() if k in STEP_METRICS}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return sorted(steps.items()), sorted(commits.items()), tags


def _now_ms() -> int:
    return int(time.time() * 1000)


def _describe(exc: BaseException) -> str:
    return redact.one_line(f"{type(exc).__name__}: {exc}")


def _newest_step(client: Any, mlflow_run_id: str, metric: str) -> int:
    return max((m.step for m in client.get_metric_history(mlflow_run_id, metric)), default=0)


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


def ensure_training_run(client: Any, run_id: str, artifact_location: str | None) -> str:
    """The MLflow run of ledger run ``run_id``, created when training kept none (tracking was
    off): promotion logs the model into it, so a model version's source is always a training
    run. A run made here says so (``tracks.created_by``) and is FINISHED at once."""
    from pipeline.mlflow_setup import ensure_experiment

    experiment_id = ensure_experiment(client, TRAINING_EXPERIMENT, artifact_location)
    found = _search(client, experiment_id, run_id)
    if found:
        return found
    run = client.create_run(
        experiment_id,
        run_name=run_id,
        tags={
            RUN_TAG: run_id,
            "tracks.created_by": "promotion: training kept no MLflow run (tracking was off)",
        },
    )
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


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

        from pipeline.mlflow_setup import store_ready

        store_ready(tracking_uri)
        client = MlflowClient(tracking_uri=tracking_uri)
        mlflow_run = _training_run(client, run_id)
        if mlflow_run is None:
            return None
        prefix = f"tracks.attempt.{attempt_no}"
        tags = {prefix: reason, f"{prefix}.termination_detail": detail}
        if attempt.dagster_run_id:
            from pipeline.mlflow_setup import dagster_run_url

            url = dagster_run_url(attempt.dagster_run_id)
            tags[f"{prefix}.dagster_run_id"] = attempt.dagster_run_id
            tags[f"{prefix}.dagster_run_url"] = url
        newest = ledger.latest_attempt(run_id)
        is_newest = newest is not None and newest.attempt_no == attempt_no
        if is_newest:
            tags |= {TERMINATION_REASON_TAG: reason, TERMINATION_DETAIL_TAG: detail}
            if attempt.dagster_run_id:  # the run's Dagster run: its newest attempt's
                tags |= {DAGSTER_RUN_TAG: attempt.dagster_run_id, DAGSTER_URL_TAG: url}
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
