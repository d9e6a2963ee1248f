"""A real ``mlflow server`` (UI + REST API) on loopback, over a Tracks home's MLflow store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.dagster_dev import free_port


class MlflowServer:
    """``mlflow server`` in its own process group over ``tracking_uri``, stopped with SIGTERM.

    The store is the one the Tracks home's runs wrote (``sqlite:///<home>/mlflow.db`` on the
    embedded default); the experiments carry their own artifact locations, so the server reads
    the artifacts where the trainer and promotion put them.
    """

    def __init__(self, tracking_uri: str, artifact_root: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
             "--default-artifact-root", artifact_root.resolve().as_uri(),
             "-h", "127.0.0.1", "-p", str(self.port),
             # One worker: the tests share two cores, and the UI is one reader.
             "--workers", "1"],
            # No job runner beside it: it runs GenAI scorers, which nothing here asks for.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            cwd=log_path.parent,  # whatever it writes beside itself stays in the test's home
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_until_ready(self, timeout: float = 240.0) -> None:
        """Returns once ``/health`` answers; raises with the server's log when it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited early:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"mlflow server did not answer in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
