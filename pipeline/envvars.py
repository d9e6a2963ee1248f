"""Every environment variable Tracks reads, declared once: name, type, default, meaning, group.

Code reads a variable only through its object here (``TRACKS_LEDGER_URL.get()``), which parses
and checks the value and names the variable when it is wrong; code that sets one for a child
process uses its ``.name``. Nothing here is read at import time. The tables of
docs/configuration.md are rendered from these declarations::

    python -m pipeline.envvars --write docs/configuration.md   # or --markdown: print them

(``pipeline/environment.py`` is something else: where an attempt ran and with what software.)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pipeline import redact

T = TypeVar("T")
Environ = Mapping[str, str]


class Group(StrEnum):
    """Who sets a variable and what for; each group is one table of docs/configuration.md."""

    STORAGE = "storage"
    DEPLOYMENT = "deployment"
    AUTOMATION = "automation"
    TRAINER = "trainer"
    KUBERNETES = "kubernetes"
    DRILL_HOOKS = "drill hooks"
    INTERNAL = "internal"
    TESTS = "tests"


class SettingError(ValueError):
    """A variable whose value cannot be used. The message names the variable and its value
    (a URL's password masked); ``problem`` says what is wrong with it."""

    def __init__(self, name: str, shown: str, problem: str) -> None:
        self.name = name
        self.shown = shown
        self.problem = problem
        super().__init__(f"{name}={shown!r} {problem}")


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable. ``default_text`` says the default in words where it is
    computed from other settings (``default`` is then ``None``)."""

    name: str
    group: Group
    meaning: str
    default: T | None = None
    default_text: str | None = None
    # Empty counts as unset ("" would be the cwd as a path, 0 as a number) unless a variable
    # says otherwise.
    empty_is_unset: bool = True

    kind: ClassVar[str] = "text"

    def raw(self, env: Environ | None = None) -> str | None:
        """The value as written in ``env`` (default: ``os.environ``); ``None`` when unset."""
        value = (os.environ if env is None else env).get(self.name)
        if value is None or (value == "" and self.empty_is_unset):
            return None
        return value

    def is_set(self, env: Environ | None = None) -> bool:
        """Whether ``env`` (default: ``os.environ``) gives this variable a value."""
        return self.raw(env) is not None

    def get(self, env: Environ | None = None) -> T | None:
        """The parsed value from ``env`` (default: ``os.environ``), else the default.

        Raises :class:`SettingError`, naming the variable and the value, when it does not parse.
        """
        raw = self.raw(env)
        return self.default if raw is None else self.parse(raw)

    def parse(self, raw: str) -> T:
        """``raw`` as this variable's type; :class:`SettingError` when it is not one."""
        raise NotImplementedError(self.name)

    def error(self, raw: str, problem: str) -> SettingError:
        """The error for a value of this variable that cannot be used."""
        return SettingError(self.name, redact.text(raw), problem)

    def default_words(self) -> str:
        """The default as docs/configuration.md states it."""
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "unset"
        return f"`{self.default}`"


@dataclass(frozen=True)
class TextVariable(Variable[str]):
    """Any text, taken as written."""

    def parse(self, raw: str) -> str:
        return raw


@dataclass(frozen=True)
class UrlVariable(Variable[str]):
    """A URL that may hold a password: never printed whole."""

    kind: ClassVar[str] = "URL (secret)"

    def parse(self, raw: str) -> str:
        return raw

    def error(self, raw: str, problem: str) -> SettingError:
        return SettingError(self.name, redact.url(raw), problem)


@dataclass(frozen=True)
class PathVariable(Variable[Path]):
    """A file or folder, as written (neither expanded nor resolved here)."""

    kind: ClassVar[str] = "path"

    def parse(self, raw: str) -> Path:
        return Path(raw)


@dataclass(frozen=True)
class IntVariable(Variable[int]):
    """A whole number."""

    kind: ClassVar[str] = "integer"

    def parse(self, raw: str) -> int:
        try:
            return int(raw)
        except ValueError:
            raise self.error(raw, "is not a whole number") from None


@dataclass(frozen=True)
class FloatVariable(Variable[float]):
    """A number; ``minimum`` and ``finite`` bound it where a value out of range means a typo."""

    unit: str | None = None
    minimum: float | None = None
    finite: bool = False

    @property
    def kind(self) -> str:  # type: ignore[override]
        return f"number ({self.unit})" if self.unit else "number"

    def parse(self, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            unit = f" of {self.unit}" if self.unit else ""
            raise self.error(raw, f"is not a number{unit}") from None
        if (self.finite and not math.isfinite(value)) or (
            self.minimum is not None and not value >= self.minimum
        ):
            bounds = [*(["finite"] if self.finite else []), "number"]
            floor = f" >= {self.minimum:g}" if self.minimum is not None else ""
            raise self.error(raw, f"must be a {' '.join(bounds)}{floor}")
        return value

    def default_words(self) -> str:
        if self.default_text is None and self.default is not None:
            return f"`{self.default:g}`"
        return super().default_words()


_ON = ("on", "1", "true", "yes")
_OFF = ("off", "0", "false", "no")


@dataclass(frozen=True)
class BoolVariable(Variable[bool]):
    """On or off: ``on``/``off``, ``1``/``0``, ``true``/``false``, ``yes``/``no``, any case."""

    kind: ClassVar[str] = "on/off"

    def parse(self, raw: str) -> bool:
        word = raw.strip().lower()
        if word in _ON:
            return True
        if word in _OFF:
            return False
        raise self.error(raw, f"is neither on ({', '.join(_ON)}) nor off ({', '.join(_OFF)})")

    def default_words(self) -> str:
        if self.default_text is None and self.default is not None:
            return "`on`" if self.default else "`off`"
        return super().default_words()


@dataclass(frozen=True)
class FlagVariable(Variable[bool]):
    """Set to any value, or not set: the value itself is not read."""

    kind: ClassVar[str] = "flag (any value)"

    def get(self, env: Environ | None = None) -> bool:
        return self.is_set(env)

    def parse(self, raw: str) -> bool:
        return True


# ---- Where things live -------------------------------------------------------------------

TRACKS_HOME = PathVariable(
    "TRACKS_HOME",
    Group.STORAGE,
    "the one folder everything below defaults into",
    default=Path(".tracks"),
    default_text="`.tracks` (the Makefile exports `$(CURDIR)/.tracks`)",
)
TRACKS_LEDGER_URL = UrlVariable(
    "TRACKS_LEDGER_URL",
    Group.STORAGE,
    "SQLAlchemy URL of the ledger; reaches the trainer by environment, never argv",
    default_text="`sqlite:///$TRACKS_HOME/ledger.db`",
)
TRACKS_MLFLOW_URI = UrlVariable(
    "TRACKS_MLFLOW_URI",
    Group.STORAGE,
    "MLflow tracking URI; a trainer started without it keeps no MLflow run",
    default_text="`sqlite:///$TRACKS_HOME/mlflow.db`",
)
TRACKS_MLFLOW_ARTIFACTS = PathVariable(
    "TRACKS_MLFLOW_ARTIFACTS",
    Group.STORAGE,
    "MLflow artifact root",
    default_text="`$TRACKS_HOME/mlartifacts`",
)
TRACKS_LANDING = PathVariable(
    "TRACKS_LANDING",
    Group.STORAGE,
    "landing files (`*.parquet`)",
    default_text="`$TRACKS_HOME/landing`",
)
TRACKS_SNAPSHOTS = PathVariable(
    "TRACKS_SNAPSHOTS",
    Group.STORAGE,
    "content-addressed snapshots and their verdict files",
    default_text="`$TRACKS_HOME/snapshots`",
)
TRACKS_CHECKPOINTS = PathVariable(
    "TRACKS_CHECKPOINTS",
    Group.STORAGE,
    "the checkpoint store; set to the claim's mount path in Kubernetes trainer pods",
    default_text="`$TRACKS_HOME/checkpoints`",
)
DAGSTER_HOME = PathVariable(
    "DAGSTER_HOME",
    Group.STORAGE,
    "Dagster's instance folder (`dagster.yaml`, its storage); Dagster reads it too",
    default_text="`$TRACKS_HOME/dagster` (Makefile, `tracks instance init`, `tracks demo`, "
    "`tracks canary`)",
)

# ---- Deployment ----------------------------------------------------------------------------

TRACKS_ENV = TextVariable(
    "TRACKS_ENV",
    Group.DEPLOYMENT,
    "`local` (SQLite and folders under `TRACKS_HOME`) or `production` (refuses to start unless "
    "the ledger and MLflow URLs are PostgreSQL); set but empty is refused",
    default="local",
    # A deployment that renders it empty meant something: never fall back to local then.
    empty_is_unset=False,
)
TRACKS_DAGSTER_PG_URL = UrlVariable(
    "TRACKS_DAGSTER_PG_URL",
    Group.DEPLOYMENT,
    "PostgreSQL URL of Dagster's own storage, after `tracks instance init --postgres`; "
    "read by Dagster (`deploy/dagster-postgres.yaml`), not by Tracks",
)
TRACKS_CODE_COMMIT = TextVariable(
    "TRACKS_CODE_COMMIT",
    Group.DEPLOYMENT,
    "the code commit recorded on runs and attempts",
    default_text="`git rev-parse HEAD` of the working tree, `-dirty` when it has changes",
)
TRACKS_LEDGER_RETRY_SECONDS = FloatVariable(
    "TRACKS_LEDGER_RETRY_SECONDS",
    Group.DEPLOYMENT,
    "how long a ledger transaction is retried across a database restart or failover",
    default=60.0,
    unit="seconds",
    minimum=0.0,
    finite=True,
)
TRACKS_DEBUG = FlagVariable(
    "TRACKS_DEBUG",
    Group.DEPLOYMENT,
    "`tracks` commands print the (redacted) traceback under their one-line error",
)
TRACKS_MLFLOW_UI_URL = TextVariable(
    "TRACKS_MLFLOW_UI_URL",
    Group.DEPLOYMENT,
    "the MLflow UI's address, for links to its run and model pages (Dagster metadata)",
    default_text="`TRACKS_MLFLOW_URI` when that is an `http(s)` server (its password left out), "
    "else no link",
)
TRACKS_DAGSTER_URL = TextVariable(
    "TRACKS_DAGSTER_URL",
    Group.DEPLOYMENT,
    "the Dagster UI's address, for the `tracks.dagster_run_url` tags on MLflow runs and versions",
    default="http://127.0.0.1:3000",
)

# ---- Automation and timing -----------------------------------------------------------------

TRACKS_AUTOMATION = BoolVariable(
    "TRACKS_AUTOMATION",
    Group.AUTOMATION,
    "on: the `new_snapshot` sensor and the `nightly_retrain` schedule start running (they start "
    "stopped otherwise, and the UI's toggle overrides either); the resume sensor is always on",
    # Off: a new user's `make dev` trains only when they press the button. A sensor that
    # trains on every new landing file and a nightly run are a deployment's choice to make.
    default=False,
)
TRACKS_RESUME_INTERVAL = IntVariable(
    "TRACKS_RESUME_INTERVAL",
    Group.AUTOMATION,
    "seconds between ticks of `resume_after_preemption`",
    default=5,
)
TRACKS_HEARTBEAT_TIMEOUT = FloatVariable(
    "TRACKS_HEARTBEAT_TIMEOUT",
    Group.AUTOMATION,
    "seconds of heartbeat silence after which a running attempt counts as lost",
    default=60.0,
    unit="seconds",
)
TRACKS_NEW_SNAPSHOT_INTERVAL = IntVariable(
    "TRACKS_NEW_SNAPSHOT_INTERVAL",
    Group.AUTOMATION,
    "seconds between ticks of `new_snapshot`",
    default=30,
)
TRACKS_LANDING_SETTLE = FloatVariable(
    "TRACKS_LANDING_SETTLE",
    Group.AUTOMATION,
    "seconds the newest landing file must have been left alone before `new_snapshot` registers it",
    default=2.0,
    unit="seconds",
)
TRACKS_NIGHTLY_CRON = TextVariable(
    "TRACKS_NIGHTLY_CRON",
    Group.AUTOMATION,
    "cron schedule of `nightly_retrain`",
    default="0 3 * * *",
)

# ---- The trainer ---------------------------------------------------------------------------

TRACKS_TRAINER_PYTHON = TextVariable(
    "TRACKS_TRAINER_PYTHON",
    Group.TRAINER,
    "the trainer's interpreter: a deployment setting, never run config",
    default_text="the code server's own (`sys.executable`)",
)
TRACKS_HEARTBEAT_SECONDS = FloatVariable(
    "TRACKS_HEARTBEAT_SECONDS",
    Group.TRAINER,
    "seconds between the trainer's heartbeats to the ledger (drills shorten it)",
    default=5.0,
    unit="seconds",
)
TRACKS_PROGRESS_SECONDS = FloatVariable(
    "TRACKS_PROGRESS_SECONDS",
    Group.TRAINER,
    "the least time between two progress lines (`step 120/400 (30%) · loss … · ETA …`) a "
    "trainer under Dagster logs on the run page; the first and the final step always get one",
    default=2.0,
    unit="seconds",
    minimum=0.0,
    finite=True,
)

# ---- Kubernetes ----------------------------------------------------------------------------

TRACKS_IMAGE = TextVariable(
    "TRACKS_IMAGE",
    Group.KUBERNETES,
    "the trainer image reference; set in the trainer pods Tracks renders",
)
TRACKS_IMAGE_DIGEST = TextVariable(
    "TRACKS_IMAGE_DIGEST",
    Group.KUBERNETES,
    "the image digest recorded as an attempt's `container_digest`",
    default_text="unset: then `TRACKS_IMAGE` when pinned by digest, else a digest of the "
    "installed distributions",
)
TRACKS_POD_NAME = TextVariable(
    "TRACKS_POD_NAME",
    Group.KUBERNETES,
    "the attempt's pod, for its placement; set in rendered trainer pods (downward API)",
    default_text="unset: then `POD_NAME`, then `HOSTNAME_POD`",
)
TRACKS_POD_NAMESPACE = TextVariable(
    "TRACKS_POD_NAMESPACE",
    Group.KUBERNETES,
    "the attempt's namespace, for its placement; set in rendered trainer pods (downward API)",
    default_text="unset: then `POD_NAMESPACE`",
)
TRACKS_NODE_NAME = TextVariable(
    "TRACKS_NODE_NAME",
    Group.KUBERNETES,
    "the attempt's node, for its placement; set in rendered trainer pods (downward API)",
    default_text="unset: then `NODE_NAME`",
)
TRACKS_TERMINATION_LOG = PathVariable(
    "TRACKS_TERMINATION_LOG",
    Group.KUBERNETES,
    "where the torchrun launcher writes its verdict as JSON (the container's termination message)",
    default_text="`/dev/termination-log` when it exists",
)

# ---- Drill hooks ---------------------------------------------------------------------------

DRILL_HOOK_PREFIX = "TRACKS_FAULT_"

TRACKS_FAULT_SLEEP_AFTER_STEP = TextVariable(
    "TRACKS_FAULT_SLEEP_AFTER_STEP",
    Group.DRILL_HOOKS,
    "`seconds@N`: after step N (any step when N is left out) the trainer pauses until the "
    "time is up or a stop is requested",
)
TRACKS_FAULT_OOM_ABOVE_BATCH = IntVariable(
    "TRACKS_FAULT_OOM_ABOVE_BATCH",
    Group.DRILL_HOOKS,
    "a smaller node: the first step raises `torch.OutOfMemoryError` when the batch is larger",
)
TRACKS_FAULT_SLEEP_BEFORE_AGREEMENT = TextVariable(
    "TRACKS_FAULT_SLEEP_BEFORE_AGREEMENT",
    Group.DRILL_HOOKS,
    "`seconds@step@rank` (step, rank empty: every one): that rank pauses inside the stop "
    "agreement, before it reduces",
)
TRACKS_FAULT_HANG_AT_STEP = TextVariable(
    "TRACKS_FAULT_HANG_AT_STEP",
    Group.DRILL_HOOKS,
    "`N[:rank=R][:in=data|collective]`: rank R (default 0) hangs in step N for good, in its "
    "data loading (default) or in a collective its peers never join; the process stays alive",
)
TRACKS_FAULT_SLEEP_DURING_WRITE = TextVariable(
    "TRACKS_FAULT_SLEEP_DURING_WRITE",
    Group.DRILL_HOOKS,
    "`seconds@N` (N left out: every checkpoint): the write of step N's checkpoint pauses "
    "halfway through `optimizer.safetensors`",
)
TRACKS_FAULT_ENOSPC_AT_STEP = TextVariable(
    "TRACKS_FAULT_ENOSPC_AT_STEP",
    Group.DRILL_HOOKS,
    "`N` or `seconds@N`: the write of step N's checkpoint fails with ENOSPC halfway through "
    "`optimizer.safetensors`",
)
TRACKS_FAULT_SLEEP_BEFORE_COMMIT = TextVariable(
    "TRACKS_FAULT_SLEEP_BEFORE_COMMIT",
    Group.DRILL_HOOKS,
    "`seconds@N` (N left out: every checkpoint): the write of step N's checkpoint pauses "
    "between `MANIFEST.json` and `COMMITTED`",
)
TRACKS_FAULT_SPIKE_BATCHES = TextVariable(
    "TRACKS_FAULT_SPIKE_BATCHES",
    Group.DRILL_HOOKS,
    "`60,61`: those batches of the data order (steps 60 and 61 of a run that skipped none) "
    "reach the model with their pixels scaled by 1000, a loss spike on demand",
)
TRACKS_FAULT_EVALUATOR_CRASH = TextVariable(
    "TRACKS_FAULT_EVALUATOR_CRASH",
    Group.DRILL_HOOKS,
    "`evaluator` or `evaluator:times`: that evaluator crashes (only while a checkpoint has "
    "fewer than `times` crashed evaluations by it)",
)

# ---- Set by Tracks for its own processes ---------------------------------------------------

TRACKS_RANK_OUTCOME_DIR = PathVariable(
    "TRACKS_RANK_OUTCOME_DIR",
    Group.INTERNAL,
    "the folder where each rank writes `outcome-<rank>.json`; set by the torchrun launcher",
)
TRACKS_LAUNCHER_PID = IntVariable(
    "TRACKS_LAUNCHER_PID",
    Group.INTERNAL,
    "the torchrun launcher's pid: a rank dies with its launcher (Linux); set by the launcher",
)

# ---- Tests and screenshots only ------------------------------------------------------------

TRACKS_TEST_PG_URL = UrlVariable(
    "TRACKS_TEST_PG_URL",
    Group.TESTS,
    "the PostgreSQL server the tests use",
    default="postgresql+psycopg2://postgres@127.0.0.1:5432/postgres",
)
TRACKS_SCREENSHOTS = PathVariable(
    "TRACKS_SCREENSHOTS",
    Group.TESTS,
    "where the browser test keeps its screenshots (`make screenshots` sets `docs/screenshots`)",
    default_text="unset: the test's temporary folder",
)
TRACKS_UI_DIAGNOSTICS = PathVariable(
    "TRACKS_UI_DIAGNOSTICS",
    Group.TESTS,
    "where the browser test writes diagnostics",
    default=Path("/tmp"),
)

ALL: tuple[Variable[Any], ...] = tuple(v for v in globals().values() if isinstance(v, Variable))
BY_NAME: Mapping[str, Variable[Any]] = {v.name: v for v in ALL}


def drill_hooks_set(env: Environ | None = None) -> dict[str, str]:
    """Every ``TRACKS_FAULT_*`` variable in ``env`` (default: ``os.environ``), by name.

    By prefix, not by the declared hooks: a receipt records any hook an operator set, a
    misspelt one included, so the record shows what the environment held.
    """
    env = os.environ if env is None else env
    return {name: env[name] for name in sorted(env) if name.startswith(DRILL_HOOK_PREFIX)}


# ---- docs/configuration.md -------------------------------------------------------------------

BEGIN_MARKER = (
    "<!-- BEGIN variables: rendered from pipeline/envvars.py by "
    "`python -m pipeline.envvars --write docs/configuration.md`; edit there, not here -->"
)
END_MARKER = "<!-- END variables -->"

_SECTIONS: dict[Group, tuple[str, str]] = {
    Group.STORAGE: ("Where things live", ""),
    Group.DEPLOYMENT: ("Deployment", ""),
    Group.AUTOMATION: ("Automation and timing", ""),
    Group.TRAINER: ("The trainer", ""),
    Group.KUBERNETES: (
        "Kubernetes",
        "The receipt's placement and `container_digest` come from these; the trainer pods "
        "Tracks renders set them (`pipeline/kube/render.py`).",
    ),
    Group.DRILL_HOOKS: (
        "Drill hooks",
        "They cause real failures on purpose; none is set in normal operation, and an "
        "attempt's receipt records every `TRACKS_FAULT_*` variable its trainer saw. "
        "Their values and effects: [drills](drills.md).",
    ),
    Group.INTERNAL: (
        "Set by Tracks for its own processes",
        "Never set by hand: the torchrun launcher (`pipeline/distributed/launch.py`) sets them "
        "for its ranks.",
    ),
    Group.TESTS: ("Tests and screenshots only", "Read by the tests (`tests/`), not by Tracks."),
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The tables of docs/configuration.md, one section per group, markers included."""
    lines = [BEGIN_MARKER]
    for group, (title, intro) in _SECTIONS.items():
        lines += ["", f"## {title}", ""]
        if intro:
            lines += [intro, ""]
        lines += ["| variable | meaning | type | default |", "|---|---|---|---|"]
        lines += [
            f"| `{v.name}` | {_cell(v.meaning)} | {_cell(v.kind)} | {_cell(v.default_words())} |"
            for v in ALL
            if v.group is group
        ]
    lines += ["", END_MARKER]
    return "\n".join(lines)


class MarkersMissingError(ValueError):
    """A document without the begin and end markers the tables are rendered between."""


def with_tables(document: str, path: str = "docs/configuration.md") -> str:
    """``document`` with what lies between its markers replaced by :func:`render_markdown`."""
    start, end = document.find(BEGIN_MARKER), document.find(END_MARKER)
    if start < 0 or end < start:
        raise MarkersMissingError(f"{path}: no {BEGIN_MARKER!r} ... {END_MARKER!r} section")
    return document[:start] + render_markdown() + document[end + len(END_MARKER) :]


def main(argv: list[str] | None = None) -> int:
    """``--markdown`` prints the tables; ``--write FILE`` renders them into FILE in place."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.envvars", description=__doc__)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--markdown", action="store_true", help="print the tables")
    action.add_argument("--write", type=Path, metavar="FILE", help="render them into FILE")
    args = parser.parse_args(argv)
    if args.markdown:
        print(render_markdown())
        return 0
    path: Path = args.write
    try:
        updated = with_tables(path.read_text(encoding="utf-8"), str(path))
    except (OSError, MarkersMissingError) as exc:
        print(f"python -m pipeline.envvars: {exc}", file=sys.stderr)
        return 1
    path.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
