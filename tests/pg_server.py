"""A private PostgreSQL server for one test: its own data directory, port and life.

The restart drill restarts its server ten times. On the shared server on 5432 that would break
every other test's connections, so the drill had to run alone after the rest of the suite; on a
server of its own it runs beside them. The server is the real one (the same binaries as the
shared cluster, ``initdb`` + ``pg_ctl``), only not shared.

PostgreSQL refuses to run as root, so when the tests run as root (CI does) the server runs as the
``postgres`` account, in a directory that account owns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SERVER_USER = "postgres"


def _bindir() -> Path:
    """The newest installed PostgreSQL's binaries (Debian keeps them out of PATH)."""
    root = Path("/usr/lib/postgresql")
    versions = sorted((p for p in root.iterdir() if (p / "bin" / "pg_ctl").exists()), key=_major)
    if not versions:
        raise RuntimeError(f"no PostgreSQL server binaries under {root}")
    return versions[-1] / "bin"


def _major(path: Path) -> int:
    return int(path.name) if path.name.isdigit() else -1


def _ephemeral_ports() -> range:
    """The ports the kernel hands out for port 0 and for outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def _free_port(rng: random.Random) -> int:
    """A free port below the kernel's ephemeral range.

    Not port 0: that port comes from the range every outgoing connection and every other
    test's server draws from, and the drill stops its server ten times, each time leaving the
    port free for one of them to take (a start failed so in CI: "could not start server").
    """
    ephemeral = _ephemeral_ports()
    while True:
        port = rng.randrange(20000, min(ephemeral.start, 32768))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class PrivatePostgres:
    """``initdb`` into a fresh directory; ``start``, ``restart``, ``close`` (which deletes it)."""

    def __init__(self) -> None:
        self._bin = _bindir()
        self.root = Path(tempfile.mkdtemp(prefix="tracks-pg-"))
        self.data = self.root / "data"
        self._rng = random.Random()
        self.port = _free_port(self._rng)
        self._as_root = os.geteuid() == 0
        if self._as_root:
            account = pwd.getpwnam(SERVER_USER)
            os.chown(self.root, account.pw_uid, account.pw_gid)
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "--no-sync")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        command = [str(self._bin / tool), *args]
        if self._as_root:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr}")

    def _pg_ctl(self, action: str) -> None:
        # The socket lives in the server's own directory: nothing of the shared cluster's is used.
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root}"
        log = str(self.root / "server.log")
        self._run("pg_ctl", action, "-D", str(self.data), "-m", "fast", "-w", "-l", log,
                  "-o", options)  # fmt: skip

    def ready(self) -> bool:
        done = subprocess.run(
            [str(self._bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
            check=False,
        )
        return done.returncode == 0

    def start(self, attempts: int = 5) -> None:
        """Start the server, on another free port where its own was taken in the meantime."""
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except RuntimeError as exc:
                if "could not bind" not in str(exc) or attempt == attempts - 1:
                    raise
                self.port = _free_port(self._rng)

    def _start_once(self) -> None:
        try:
            self._pg_ctl("start")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\nserver.log ends:\n{self.log_tail()}") from exc

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.root / "server.log").read_text(errors="replace")
        except OSError:
            return "(no server.log)"
        return "\n".join(text.splitlines()[-lines:])

    def restart(self, down_for: float = 0.0) -> float:
        """Stop (fast: dirty buffers are flushed first), stay down ``down_for`` seconds, start.

        Returns the seconds from the stop until the server answers again.
        """
        started = time.monotonic()
        self._pg_ctl("stop")
        time.sleep(down_for)
        self._start_once()
        while not self.ready():
            time.sleep(0.1)
        return time.monotonic() - started

    def close(self) -> None:
        # Not running (a failed start) makes pg_ctl fail: then there is nothing to stop.
        with contextlib.suppress(RuntimeError):
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)
