"""Where Tracks keeps things: one home folder by default, URLs for the ledger and MLflow."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from pipeline import envvars, redact
from pipeline.envvars import Environ

_URL_FIELDS = ("ledger_url", "mlflow_tracking_uri")


class DatabaseUrlError(ValueError):
    """A database URL that cannot be used as written. ``shown`` is the URL with its password
    masked, ``problem`` what is wrong; neither holds the password."""

    def __init__(self, shown: str, problem: str) -> None:
        self.shown = shown
        self.problem = problem
        super().__init__(f"database URL {shown}: {problem}")


def check_database_url(url: str) -> None:
    """Refuse a URL SQLAlchemy cannot read, or whose port is not one of 1-65535.

    Said before any connection, in words that name the URL (redacted): SQLAlchemy's own are
    ``invalid literal for int()`` for a port such as ``:abc``, and a driver error much later for
    ``:99999``. Raises :class:`DatabaseUrlError`.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    shown = redact.database_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseUrlError(
            shown, "not a database URL (dialect+driver://user:password@host:port/database)"
        ) from None
    except ValueError:
        # SQLAlchemy's message quotes the port text, which may hold part of the password.
        raise DatabaseUrlError(shown, "its port is not a number from 1 to 65535") from None
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise DatabaseUrlError(shown, f"its port {parsed.port} is not from 1 to 65535")


@dataclass(frozen=True)
class TracksSettings:
    """Locations of every store Tracks writes to. Build with :meth:`from_env`."""

    home: Path
    ledger_url: str
    mlflow_tracking_uri: str
    mlflow_artifact_root: Path
    landing_root: Path
    snapshot_root: Path
    checkpoint_root: Path
    work_root: Path

    def __repr__(self) -> str:
        # A dataclass repr would print the URLs whole, passwords included, into any log line.
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _URL_FIELDS:
            shown[name] = redact.database_url(shown[name])
        return f"TracksSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_env(cls, environ: Environ | None = None) -> TracksSettings:
        """Read ``TRACKS_HOME`` (default ``.tracks``), ``TRACKS_LEDGER_URL``, ``TRACKS_MLFLOW_URI``.

        The defaults put everything under the home folder: SQLite for the ledger and
        MLflow, plain directories for landing files, snapshots and checkpoints. ``environ``
        defaults to ``os.environ``; an empty value counts as unset ("" would be the cwd).
        """
        env = environ
        home = envvars.TRACKS_HOME.get(env).expanduser().resolve()
        return cls(
            home=home,
            ledger_url=envvars.TRACKS_LEDGER_URL.get(env) or f"sqlite:///{home / 'ledger.db'}",
            mlflow_tracking_uri=(
                envvars.TRACKS_MLFLOW_URI.get(env) or f"sqlite:///{home / 'mlflow.db'}"
            ),
            mlflow_artifact_root=(
                envvars.TRACKS_MLFLOW_ARTIFACTS.get(env) or home / "mlartifacts"
            ).resolve(),
            landing_root=_landing_root(envvars.TRACKS_LANDING.get(env), home),
            snapshot_root=(envvars.TRACKS_SNAPSHOTS.get(env) or home / "snapshots").resolve(),
            checkpoint_root=(envvars.TRACKS_CHECKPOINTS.get(env) or home / "checkpoints").resolve(),
            work_root=(home / "work").resolve(),
        )

    def ensure_dirs(self) -> None:
        for path in (
            self.home,
            self.mlflow_artifact_root,
            self.landing_root,
            self.snapshot_root,
            self.checkpoint_root,
            self.work_root,
        ):
            path.mkdir(parents=True, exist_ok=True)


def _landing_root(configured: Path | None, home: Path) -> Path:
    """The landing folder, absolute but with its own links left in place.

    Under ``TRACKS_HOME`` (the default ``home/landing``) nothing below the home is resolved;
    elsewhere, the folders above it are (the operator's own path) but not the folder itself. A
    link left in the path is then one :func:`~pipeline.data.landing.landing_files` refuses,
    where resolving it here would have read and snapshotted whatever it pointed at.
    """
    path = Path(os.path.abspath(configured.expanduser())) if configured else home / "landing"
    if path.is_relative_to(home):
        return path
    return path.parent.resolve() / path.name


@dataclass(frozen=True)
class AutomationSettings:
    """How often the sensors look, and when a silent attempt counts as lost.

    The defaults are the registry's (:mod:`pipeline.envvars`), declared there once.
    """

    resume_interval_seconds: int = envvars.TRACKS_RESUME_INTERVAL.default
    heartbeat_timeout_seconds: float = envvars.TRACKS_HEARTBEAT_TIMEOUT.default
    new_snapshot_interval_seconds: int = envvars.TRACKS_NEW_SNAPSHOT_INTERVAL.default
    landing_settle_seconds: float = envvars.TRACKS_LANDING_SETTLE.default
    nightly_cron: str = envvars.TRACKS_NIGHTLY_CRON.default
    automation_on: bool = envvars.TRACKS_AUTOMATION.default

    @classmethod
    def from_env(cls, environ: Environ | None = None) -> AutomationSettings:
        """Read the ``TRACKS_*`` variables named after each field.

        ``TRACKS_RESUME_INTERVAL``, ``TRACKS_HEARTBEAT_TIMEOUT``, ``TRACKS_NEW_SNAPSHOT_INTERVAL``,
        ``TRACKS_LANDING_SETTLE``, ``TRACKS_NIGHTLY_CRON``; ``TRACKS_AUTOMATION`` (on/off) says
        whether the new-data sensor and the nightly schedule start running by default. A value
        that does not parse raises :class:`~pipeline.envvars.SettingError`, naming it.
        """
        env = environ
        return cls(
            resume_interval_seconds=envvars.TRACKS_RESUME_INTERVAL.get(env),
            heartbeat_timeout_seconds=envvars.TRACKS_HEARTBEAT_TIMEOUT.get(env),
            new_snapshot_interval_seconds=envvars.TRACKS_NEW_SNAPSHOT_INTERVAL.get(env),
            landing_settle_seconds=envvars.TRACKS_LANDING_SETTLE.get(env),
            nightly_cron=envvars.TRACKS_NIGHTLY_CRON.get(env),
            automation_on=envvars.TRACKS_AUTOMATION.get(env),
        )
