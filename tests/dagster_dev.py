"""A real ``dagster dev`` (webserver + daemon) on loopback, and a small GraphQL client for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

REPO_ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = {"repositoryLocationName": "tracks", "repositoryName": "__repository__"}
# The daemon takes queued runs off Dagster's run queue every second rather than every 5 s (its
# default): each run a test launches, and each the resume sensor launches, waited 2.5 s on
# average in the queue before it started, up to 5. Nothing a test proves depends on the wait.
FAST_RUN_QUEUE = "run_queue:\n  dequeue_interval_seconds: 1\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class DagsterDev:
    """``dagster dev -w workspace.yaml`` in its own process group, stopped with SIGINT."""

    def __init__(
        self,
        env: Mapping[str, str],
        log_path: Path,
        *,
        cwd: Path = REPO_ROOT,
        clean: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml",
             "-h", "127.0.0.1", "-p", str(self.port)],
            cwd=cwd,
            # clean: exactly ``env`` (a fresh shell with nothing exported), not ours on top.
            env=dict(env) if clean else {**os.environ, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # pytest-xdist workers ignore SIGINT and children inherit that: dagster dev would then
            # ignore the SIGINT that stops it and sit out stop()'s 30 s before the SIGKILL.
            preexec_fn=_default_sigint,
        )  # fmt: skip

    def wait_until_loaded(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dagster dev exited early:\n{self.log_tail()}")
            try:
                data = self.graphql(
                    "{ workspaceOrError { ... on Workspace { locationEntries { name "
                    "locationOrLoadError { __typename ... on PythonError { message } } } } } }"
                )
                entries = data["workspaceOrError"]["locationEntries"]
                loaded = [e for e in entries if e["locationOrLoadError"]]
                if loaded:
                    status = loaded[0]["locationOrLoadError"]
                    if status["__typename"] == "PythonError":
                        raise RuntimeError(f"code location failed to load: {status['message']}")
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)  # a refused connection costs nothing; a late look costs the wait
        raise TimeoutError(f"dagster dev did not load in {timeout}s:\n{self.log_tail()}")

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        response = requests.post(
            f"{self.url}/graphql", json={"query": query, "variables": variables or {}}, timeout=30
        )
        response.raise_for_status()
        body = response.json()
        if body.get("errors"):
            raise RuntimeError(f"GraphQL errors: {body['errors']}")
        return body["data"]

    def run_status(self, run_id: str) -> str:
        data = self.graphql(
            "query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }",
            {"id": run_id},
        )
        return data["runOrError"]["status"]

    def wait_for_run(self, run_id: str, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        status = "UNKNOWN"
        while time.monotonic() < deadline:
            status = self.run_status(run_id)
            if status in ("SUCCESS", "FAILURE", "CANCELED"):
                return status
            time.sleep(0.5)
        raise TimeoutError(f"run {run_id} still {status} after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


@contextmanager
def live_drill(home: Path, env: Mapping[str, str]) -> Iterator[tuple[DagsterDev, Path, str]]:
    """A ``dagster dev`` over a fresh ``home`` with digits landed, for drills on live runs.

    Dagster's run retries are off (the resume sensor owns every failure) and so is the
    automation the drill does not start itself (``TRACKS_AUTOMATION=off``); ``env`` adds the
    drill's hooks. Yields the server, the home and the landed snapshot's id.
    """
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import snapshot_id_for

    (home / "dagster").mkdir(parents=True)
    (home / "dagster" / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\nrun_retries:\n  enabled: false\n" + FAST_RUN_QUEUE
    )
    write_digits_landing(home / "landing")
    server = DagsterDev(
        env={
            "TRACKS_HOME": str(home),
            "DAGSTER_HOME": str(home / "dagster"),
            "TRACKS_AUTOMATION": "off",
            **env,
        },
        log_path=home / "dagster-dev.log",
    )
    try:
        server.wait_until_loaded()
        yield server, home, snapshot_id_for(home / "landing")
    finally:
        server.stop()


ADD_PARTITION = """
mutation($repo: RepositorySelector!, $name: String!, $key: String!) {
  addDynamicPartition(repositorySelector: $repo, partitionsDefName: $name, partitionKey: $key) {
    __typename
    ... on PythonError { message }
  }
}
"""

# What the UI's "Materialize" button sends for a selection of assets and one partition.
LAUNCH_RUN = """
mutation($params: ExecutionParams!) {
  launchPipelineExecution(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message stack }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
  }
}
"""


GRAPH_ASSETS = [
    "data_snapshot",
    "training_attempt",
    "committed_checkpoint",
    "evaluation",
    "promoted_model",
]
DATA_CHECKS = ["schema_contract", "data_quality", "drift_vs_previous"]


def launch_graph(
    server: DagsterDev,
    snapshot_id: str,
    training_config: dict[str, Any] | None = None,
    *,
    assets: list[str] | None = None,
    resources: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
) -> str:
    """Register the partition and press "Materialize" for the graph, as the UI does.

    ``resources`` is the launchpad's ``resources:`` section (the trainer's placement, say) and
    ``tags`` are the tags a person adds in the launchpad, on top of the partition's.
    """
    added = server.graphql(
        ADD_PARTITION, {"repo": REPOSITORY, "name": "snapshots", "key": snapshot_id}
    )["addDynamicPartition"]
    if added["__typename"] not in ("AddDynamicPartitionSuccess", "DuplicateDynamicPartitionError"):
        raise RuntimeError(f"could not add partition {snapshot_id}: {added}")
    selected = assets or GRAPH_ASSETS
    params: dict[str, Any] = {
        "selector": {
            **REPOSITORY,
            "pipelineName": "__ASSET_JOB",
            "assetSelection": [{"path": [name]} for name in selected],
            "assetCheckSelection": [
                {"assetKey": {"path": ["data_snapshot"]}, "name": check} for check in DATA_CHECKS
            ]
            if "data_snapshot" in selected
            else [],
        },
        "runConfigData": {
            "ops": {"training_attempt": {"config": training_config or {}}},
            **({"resources": resources} if resources else {}),
        },
        "executionMetadata": {
            "tags": [
                {"key": "dagster/partition", "value": snapshot_id},
                *({"key": k, "value": v} for k, v in (tags or {}).items()),
            ]
        },
    }
    launched = server.graphql(LAUNCH_RUN, {"params": params})["launchPipelineExecution"]
    if launched["__typename"] != "LaunchRunSuccess":
        raise RuntimeError(f"launch failed: {launched}")
    return launched["run"]["runId"]


# What the run page's "Re-execute" menu sends ("From failure" is FROM_FAILURE).
REEXECUTE_RUN = """
mutation($params: ReexecutionParams!) {
  launchPipelineReexecution(reexecutionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
  }
}
"""


def reexecute(server: DagsterDev, parent_run_id: str, strategy: str = "FROM_FAILURE") -> str:
    """Re-execute a Dagster run as the run page's button does; returns the new run's id."""
    launched = server.graphql(
        REEXECUTE_RUN, {"params": {"parentRunId": parent_run_id, "strategy": strategy}}
    )["launchPipelineReexecution"]
    if launched["__typename"] != "LaunchRunSuccess":
        raise RuntimeError(f"re-execution of {parent_run_id} failed: {launched}")
    return launched["run"]["runId"]


def trainer_ranks(run_id: str) -> dict[int, int]:
    """Live trainer processes of one training run by their ``RANK`` (0 when not distributed)."""
    ranks: dict[int, int] = {}
    for pid in trainer_pids(run_id):
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        ranks[int(found.get(b"RANK", b"0"))] = pid
    return ranks


def trainer_pids(run_id: str) -> list[int]:
    """Live ``python -m pipeline.trainer`` processes of one training run, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pipeline.trainer" in argv and run_id.encode() in argv:
            pids.append(int(entry.name))
    return pids


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def check_evaluations(result: Any) -> dict[str, Any]:
    """An in-process run's asset check evaluations, by check name."""
    return {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }
