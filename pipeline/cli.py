"""``tracks``: the command line of Tracks.

Most commands use only the core. ``tracks demo`` and ``tracks instance`` reach for Dagster,
imported inside those commands so the rest of the CLI works without an orchestrator.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import click

from pipeline import envvars, ids, redact, safepath
from pipeline.data.families import DEFAULT_FAMILY, FAMILIES
from pipeline.durable import replace_atomically
from pipeline.settings import TracksSettings

REPO_ROOT = Path(__file__).resolve().parent.parent

LOCAL_INSTANCE_YAML = """\
# Written by `tracks instance init` (and `make dev`, `tracks demo`, `tracks canary`): the
# embedded default instance. Its storage is SQLite and local files in this folder (Dagster's
# defaults). For PostgreSQL, run `tracks instance init --postgres` (copies
# deploy/dagster-postgres.yaml).
telemetry:
  enabled: false
# One owner per failure: the resume sensor resumes preempted runs from their last committed
# checkpoint, so Dagster's own run retries stay off.
run_retries:
  enabled: false
sensors:
  use_threads: true
  num_workers: 2
"""


def _settings() -> TracksSettings:
    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    return settings


def _ledger(settings: TracksSettings):
    from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

    from pipeline.ledger import Ledger
    from pipeline.settings import DatabaseUrlError

    shown = redact.database_url(settings.ledger_url)
    try:
        return Ledger.open(settings.ledger_url)
    except DatabaseUrlError as exc:
        raise click.ClickException(
            f"cannot open the ledger at {shown} ({envvars.TRACKS_LEDGER_URL.name}): {exc.problem}"
        ) from None
    except (ArgumentError, NoSuchModuleError, DBAPIError) as exc:
        # SQLAlchemy's own words name neither the variable nor the database.
        raise click.ClickException(
            f"cannot open the ledger at {shown} ({envvars.TRACKS_LEDGER_URL.name}): "
            + _one_line(getattr(exc, "orig", None) or exc)
        ) from None


def _dagster_home(settings: TracksSettings) -> Path:
    # Absolute, as Dagster requires: a relative DAGSTER_HOME would be refused later, elsewhere.
    home = (envvars.DAGSTER_HOME.get() or settings.home / "dagster").resolve()
    os.environ[envvars.DAGSTER_HOME.name] = str(home)
    return home


class TracksGroup(click.Group):
    """Every error a command raises becomes one redacted line on stderr, never a traceback.

    ``TRACKS_DEBUG=1`` shows the traceback too (redacted as well), for a bug report.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            raise click.exceptions.Abort() from None
        except Exception as exc:
            if envvars.TRACKS_DEBUG.get():
                click.echo(redact.text(traceback.format_exc()), err=True)
            raise click.ClickException(_one_line(exc)) from None


def _one_line(exc: BaseException) -> str:
    text = redact.one_line(str(exc)) or type(exc).__name__
    if len(text) > 600:
        text = text[:600] + "…"
    return text


class _IdType(click.ParamType):
    """A click type over one of :mod:`pipeline.ids`' validators: a bad id is a usage error."""

    def __init__(self, name: str, validate: Any) -> None:
        self.name = name
        self._validate = validate

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return self._validate(value)
        except ids.InvalidIdError as exc:
            self.fail(str(exc), param, ctx)


class PositiveNumber(click.ParamType):
    """A finite number > 0 and at most ``maximum``: `--days -1`, `nan`, `inf` and `1e10` are
    usage errors, not empty answers or a date arithmetic overflow."""

    name = "positive number"

    def __init__(self, maximum: float) -> None:
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or not 0 < number <= self.maximum:
            self.fail(
                f"{value!r} must be a finite number greater than 0 and at most {self.maximum:g}",
                param,
                ctx,
            )
        return number


# A look back of a century covers every ledger; Python's dates end in the year 9999.
DAYS = PositiveNumber(maximum=36_500)


RUN_ID = _IdType("run id", ids.run_id)
FAMILY = _IdType("model family", ids.model_family)
LANDING_FILE = _IdType("file name", ids.landing_file_name)


@click.group(cls=TracksGroup)
def main() -> None:
    """Tracks: train, evaluate and promote PyTorch models, and leave a receipt for every attempt."""


@main.group()
def landing() -> None:
    """Write landing files."""


@landing.command("digits")
@click.option(
    "--landing-dir",
    type=click.Path(path_type=Path),
    help=f"Default: ${envvars.TRACKS_HOME.name}/landing.",
)
@click.option(
    "--drift",
    type=click.Choice(["renamed_column", "label_out_of_range", "pixel_out_of_range", "nulls"]),
    help="Write bad data on purpose (drills, tests).",
)
@click.option("--file-name", type=LANDING_FILE, help="Name of the Parquet file to write.")
def landing_digits(landing_dir: Path | None, drift: str | None, file_name: str | None) -> None:
    """Write scikit-learn's handwritten digits as a landing Parquet file."""
    from pipeline.data.landing import Drift, write_digits_landing

    target = landing_dir or _settings().landing_root
    path = write_digits_landing(target, drift=Drift(drift) if drift else None, file_name=file_name)
    click.echo(str(path))


# The values of pipeline.textlm.landing.TextDrift, written out so `tracks --help` loads neither
# pandas nor pyarrow (a test holds the two lists equal).
TEXT_DRIFTS = ("invalid_utf8", "empty_document", "duplicate_id", "split_leak", "shouted")


@landing.command("text")
@click.option(
    "--landing-dir",
    type=click.Path(path_type=Path),
    help=f"Default: ${envvars.TRACKS_HOME.name}/landing/text-lm.",
)
@click.option(
    "--drift",
    type=click.Choice(TEXT_DRIFTS),
    help="Write bad (or shifted) text on purpose (drills, tests).",
)
@click.option("--file-name", type=LANDING_FILE, help="Name of the Parquet file to write.")
def landing_text(landing_dir: Path | None, drift: str | None, file_name: str | None) -> None:
    """Write the Python language reference (pydoc_data.topics) as a text landing Parquet file."""
    from pipeline.data.families import TEXT, landing_dir_for
    from pipeline.textlm.landing import TextDrift, write_text_landing

    target = landing_dir or landing_dir_for(_settings().landing_root, TEXT)
    path = write_text_landing(
        target, drift=TextDrift(drift) if drift else None, file_name=file_name
    )
    click.echo(str(path))


@main.command("snapshot-id")
@click.option(
    "--landing-dir",
    type=click.Path(path_type=Path),
    help="Default: the family's landing folder.",
)
@click.option(
    "--family",
    type=click.Choice(FAMILIES),
    default=DEFAULT_FAMILY,
    show_default=True,
    help="The model family the data is for: it picks the id's prefix and the default folder.",
)
def snapshot_id(landing_dir: Path | None, family: str) -> None:
    """Print the content-addressed snapshot id of the landing files."""
    from pipeline.data.families import landing_dir_for
    from pipeline.data.snapshot import snapshot_id_for

    target = landing_dir or landing_dir_for(_settings().landing_root, family)
    click.echo(snapshot_id_for(target, family=family))


@main.group()
def instance() -> None:
    """The Dagster instance (DAGSTER_HOME)."""


@instance.command("init")
@click.option(
    "--postgres", is_flag=True, help="Use deploy/dagster-postgres.yaml (PostgreSQL storage)."
)
def instance_init(postgres: bool) -> None:
    """Write dagster.yaml into DAGSTER_HOME (default $TRACKS_HOME/dagster)."""
    home = _dagster_home(_settings())
    _write_instance_yaml(home, postgres=postgres)
    click.echo(f"{envvars.DAGSTER_HOME.name}={home}")


def _write_instance_yaml(home: Path, *, postgres: bool) -> None:
    home.mkdir(parents=True, exist_ok=True)
    # A dagster.yaml that is a link (dangling or not) is refused, never written through: the
    # file is replaced whole, so no reader sees half of it either.
    target = safepath.under(home, "dagster.yaml")
    if postgres:
        replace_atomically(target, (REPO_ROOT / "deploy" / "dagster-postgres.yaml").read_bytes())
    elif not target.exists():
        replace_atomically(target, LOCAL_INSTANCE_YAML.encode())


@main.command()
@click.option(
    "--fresh-data/--reuse-data", default=False, help="Rewrite the landing file even if one exists."
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Train as this many ranks under torchrun (gloo on CPU); 1 runs one process.",
)
@click.option(
    "--family",
    type=click.Choice(FAMILIES),
    default=DEFAULT_FAMILY,
    show_default=True,
    help="digits-cnn: scikit-learn's handwritten digits; text-lm: a byte-level language model "
    "on the Python reference that ships with CPython.",
)
def demo(fresh_data: bool, nproc_per_node: int, family: str) -> None:
    """Land the family's data, then snapshot → train → checkpoint → evaluate → promote, in
    Dagster; print the champion, what it serves, and the run's story."""
    import dagster as dg

    from pipeline.data.families import TEXT, landing_dir_for
    from pipeline.data.landing import landing_files
    from pipeline.data.snapshot import snapshot_id_for
    from pipeline.explain import explain

    settings = _settings()
    _write_instance_yaml(_dagster_home(settings), postgres=False)
    landing_dir = landing_dir_for(settings.landing_root, family)
    if fresh_data or not landing_files(landing_dir):
        if family == TEXT:
            from pipeline.textlm.landing import write_text_landing

            write_text_landing(landing_dir)
        else:
            from pipeline.data.landing import write_digits_landing

            write_digits_landing(landing_dir)
    snapshot = snapshot_id_for(landing_dir, family=family)
    click.echo(f"snapshot {snapshot} from {landing_dir}")

    from definitions import defs
    from sensors import materialize_snapshot

    with dg.DagsterInstance.get() as dagster_instance:
        # The terminal gets what the steps say (context.log at INFO: the trainer's progress,
        # its checkpoints, the promotion), not Dagster's DEBUG line per step event, which an
        # in-process run prints by default (its console logger's level). The run's event log
        # in the UI still holds every event. The partition's family picks the training config.
        run_config: dict = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
        if nproc_per_node > 1:
            trainer = {"backend": "torchrun", "nproc_per_node": nproc_per_node}
            run_config["resources"] = {"trainer": {"config": trainer}}
        result = materialize_snapshot(
            defs,
            dagster_instance,
            snapshot,
            run_config=run_config,
            tags={"tracks/launched_by": "cli:tracks demo"},
        )
        if not result.success:
            for event in result.all_events:
                if event.is_step_failure and event.step_failure_data:
                    error = event.step_failure_data.error
                    click.echo(
                        f"step {event.step_key} failed: {error.message if error else ''}", err=True
                    )
            raise click.ClickException(f"Dagster run {result.run_id} failed")
        promotion = result.asset_materializations_for_node("promoted_model")[-1].metadata
        click.echo(f"Dagster run {result.run_id} succeeded")
    model_name = promotion["model_name"].value
    click.echo(
        f"champion: {model_name} version {promotion['model_version'].value} "
        f"(models:/{model_name}@champion)"
    )
    # Served the way production serves it: every byte verified against the promotion record.
    from pipeline.serving.champion import load_champion

    served = load_champion(settings, _ledger(settings), model_name)
    if family == TEXT:
        click.echo(_served_text_line(served))
    else:
        click.echo(_served_digits_line(served, settings.snapshot_root / snapshot))
    click.echo("")
    click.echo(explain(_ledger(settings), promotion["run_id"].value))


def _served_digits_line(served: Any, snapshot_dir: Path) -> str:
    from pipeline.data.snapshot import open_snapshot, read_snapshot_frame

    frame = read_snapshot_frame(open_snapshot(snapshot_dir))
    held_out = frame[frame["split"] == "eval"]
    pixels = held_out[[f"px_{i:02d}" for i in range(64)]].to_numpy()
    accuracy = float((served.predict(pixels) == held_out["label"].to_numpy()).mean())
    return (
        f"served version {served.version} after verifying its files against promotion "
        f"{served.promotion_id}: {accuracy:.1%} on the {len(held_out)} held-out digits"
    )


def _served_text_line(served: Any) -> str:
    prompt = "The if statement is used for"
    [continuation] = served.continue_text([prompt], max_new_tokens=48)
    return (
        f"served version {served.version} after verifying its files against promotion "
        f"{served.promotion_id}: {prompt!r} continues {continuation!r}"
    )


@main.command()
@click.option("--max-steps", default=120, show_default=True, type=click.IntRange(min=1))
@click.option("--max-minutes", default=5.0, show_default=True, type=PositiveNumber(maximum=24 * 60))
def canary(max_steps: int, max_minutes: float) -> None:
    """The CI canary: real data and config under strict limits; non-zero exit on failure.

    Fails unless the loss falls, a checkpoint is committed and restores in a new process, and
    evaluation has complete provenance, all within --max-minutes. Never promotes.
    """
    import dagster as dg

    settings = _settings()
    _write_instance_yaml(_dagster_home(settings), postgres=False)

    from definitions import defs
    from sensors.canary import run_canary

    with dg.DagsterInstance.get() as dagster_instance:
        verdict = run_canary(defs, dagster_instance, max_steps=max_steps, max_minutes=max_minutes)
    for line in verdict.lines():
        click.echo(line)
    if not verdict.passed:
        raise click.ClickException(verdict.summary())


@main.command("explain")
@click.argument("target")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Also write the page here (its folder must exist).",
)
def explain_cmd(target: str, output: Path | None) -> None:
    """The one-page story of a run (RUN_ID) or an attempt (RUN_ID#N): Markdown, laid out on a
    terminal."""
    from pipeline.explain import explain
    from pipeline.ledger import LedgerError

    if output is not None and not output.resolve().parent.is_dir():
        raise click.BadParameter(f"folder {output.parent} does not exist", param_hint="--output")
    try:
        page = explain(_ledger(_settings()), target)
    except ids.InvalidIdError as exc:
        raise click.BadParameter(str(exc), param_hint="TARGET") from None
    except LedgerError as exc:
        raise click.ClickException(_one_line(exc)) from None
    if output is not None:
        output.write_text(page)
    _echo_page(page)


@main.command("note")
@click.argument("target")
@click.argument("text")
@click.option("--author", help="Who writes it. Default: the OS user running the command.")
def note_cmd(target: str, text: str, author: str | None) -> None:
    """Add a note to a run (RUN_ID) or an attempt (RUN_ID#N) in the ledger's logbook.

    Notes are dated, attributed and only ever added: say why a learning rate changed, why a run
    was restarted or stopped early. `tracks explain` shows them in the run's logbook.
    """
    from pipeline.explain import parse_target
    from pipeline.ledger import LedgerError
    from pipeline.ledger.notes import os_user

    try:
        run_id, attempt_no = parse_target(target)
    except ids.InvalidIdError as exc:
        # parse_target also offers explain's snapshot pages; a note is on a run or an attempt.
        said = str(exc) if exc.kind != "target" else f"invalid target {target!r}"
        raise click.BadParameter(
            f"{said} (expected RUN_ID or RUN_ID#N, attempt N from 1 to 9999)", param_hint="TARGET"
        ) from None
    try:
        who = os_user() if author is None else author  # an empty --author is refused
        note = _ledger(_settings()).add_note(
            run_id, text, author=who, source="cli", attempt_no=attempt_no
        )
    except LedgerError as exc:
        raise click.ClickException(f"{_one_line(exc)}; no note was recorded") from None
    click.echo(
        f"note {note.note_id} on {note.target}, {note.created_at:%Y-%m-%d %H:%M:%S} UTC, "
        f"by {note.author} ({note.source}):"
    )
    for line in note.text.splitlines():
        click.echo(f"  {line}")


def _echo_page(page: str) -> None:
    """A Markdown page: rendered (headings, tables, emphasis) on a terminal, as written else.

    A pipe or a file gets the Markdown itself, for a ticket, a wiki or ``--output``; a person at
    a terminal reads it laid out by rich's renderer rather than as ``| --- |`` and ``**``.
    """
    if not sys.stdout.isatty():
        click.echo(page, nl=False)
        return
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown(page))


@main.command("diff")
@click.argument("left", type=RUN_ID)
@click.argument("right", type=RUN_ID)
def diff_cmd(left: str, right: str) -> None:
    """Two runs side by side: config key by key, data, placement, evaluations (Markdown, laid
    out on a terminal)."""
    from pipeline.diff import diff_runs
    from pipeline.ledger import LedgerError

    try:
        page = diff_runs(_ledger(_settings()), left, right)
    except LedgerError as exc:
        raise click.ClickException(_one_line(exc)) from None
    _echo_page(page)


@main.command("reproduce")
@click.argument("evaluation_id")
def reproduce_cmd(evaluation_id: str) -> None:
    """Re-run a generation evaluation (EVALUATION_ID) from its record and compare: every
    recorded input, greedy outputs byte for byte, sampled outputs under their recorded seeds.

    Exits non-zero on a mismatch or an incomplete record.
    """
    from pipeline.evaluation.reproduce import reproduce_evaluation
    from pipeline.ledger import LedgerError

    settings = _settings()
    try:
        reproduction = reproduce_evaluation(_ledger(settings), settings, evaluation_id)
    except LedgerError as exc:
        raise click.ClickException(_one_line(exc)) from None
    click.echo(f"{evaluation_id}: {reproduction.summary()}")
    if not reproduction.identical:
        raise click.exceptions.Exit(1)


def _reason_choices() -> list[str]:
    from pipeline.states import TerminationReason

    return [str(r) for r in TerminationReason]


@main.command("attempts")
@click.option("--family", type=FAMILY, help="Model family.")
@click.option("--reason", type=click.Choice(_reason_choices()), help="Termination reason.")
@click.option(
    "--status", type=click.Choice(["running", "succeeded", "failed"]), help="Attempt status."
)
@click.option("--since", "since_days", type=DAYS, help="Started within the last DAYS days.")
@click.option("--run", "run_id", type=RUN_ID, help="Only this run's attempts.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 10_000))
def attempts_cmd(
    family: str | None,
    reason: str | None,
    status: str | None,
    since_days: float | None,
    run_id: str | None,
    limit: int,
) -> None:
    """List attempts, newest first, with their reason, decision and cost."""
    from datetime import UTC, datetime, timedelta

    since = datetime.now(UTC) - timedelta(days=since_days) if since_days is not None else None
    rows = _ledger(_settings()).list_attempts(
        model_family=family,
        termination_reason=reason,
        status=status,
        since=since,
        run_id=run_id,
        limit=limit,
    )
    _echo_blocked_snapshots(since)
    if not rows:
        click.echo("No attempts match.")
        return
    width = max(len("attempt"), *(len(a.key) for a in rows))
    click.echo(
        f"{'attempt':<{width}}  {'started (UTC)':<19}  {'reason':<16}  {'GPU-h':>7}  "
        f"{'CPU-h':>7}  {'decision':<34}  detail"
    )
    for a in rows:
        decision = a.retry_decision or {}
        decided = f"{decision['action']} ({decision.get('rule')})" if decision else "—"
        click.echo(
            f"{a.key:<{width}}  {a.started_at:%Y-%m-%d %H:%M:%S}  "
            f"{a.termination_reason or a.status:<16}  {a.gpu_seconds / 3600:>7.2f}  "
            f"{a.cpu_seconds / 3600:>7.3f}  {decided:<34}  "
            # Rows written before details were redacted on the way in may quote a password.
            f"{redact.text(a.termination_detail or '')}"
        )


@main.command("cost")
@click.option("--family", required=True, type=FAMILY, help="Model family.")
@click.option("--days", default=7.0, show_default=True, type=DAYS, help="Started within DAYS.")
def cost_cmd(family: str, days: float) -> None:
    """Attempts, GPU- and CPU-hours per termination reason: where did the time go?

    Then the steps lost per reason (trained past each attempt's own last commit), if any.
    """
    from datetime import UTC, datetime, timedelta

    ledger = _ledger(_settings())
    rows = ledger.cost_by_reason(family, days)
    window = f"started in the last {days:g} day(s)"
    _echo_blocked_snapshots(datetime.now(UTC) - timedelta(days=days))
    if not rows:
        click.echo(f"No {family} attempts {window}.")
        return
    click.echo(f"{family} attempts {window}, by termination reason:")
    click.echo(f"{'termination_reason':<18}  {'attempts':>9}  {'gpu_hours':>12}  {'cpu_hours':>10}")
    for row in rows:
        click.echo(
            f"{row.termination_reason or '(running)':<18}  {row.attempts:>9,}  "
            f"{row.gpu_hours:>12,.2f}  {row.cpu_hours:>10,.3f}"
        )
    total_attempts = sum(r.attempts for r in rows)
    total_hours = sum(r.gpu_hours for r in rows)
    total_cpu = sum(r.cpu_hours for r in rows)
    click.echo(f"{'total':<18}  {total_attempts:>9,}  {total_hours:>12,.2f}  {total_cpu:>10,.3f}")
    lost = ledger.cost_by_reason_lost_steps(family, days)
    if lost:
        # Steps an attempt trained past its own last commit: nobody resumes from them.
        most = sorted(lost.items(), key=lambda kv: (-kv[1], str(kv[0])))
        said = ", ".join(f"{reason} {steps:,}" for reason, steps in most)
        click.echo(f"steps lost past each attempt's last own commit: {said}")


def _echo_blocked_snapshots(since: Any) -> None:
    """Batches the blocking checks stopped cost no training, but they happened: say so."""
    blocked = _ledger(_settings()).snapshots(verdict="blocked", since=since)
    if blocked:
        shown = ", ".join(s.snapshot_id for s in blocked[-5:])
        click.echo(
            f"{len(blocked)} snapshot(s) stopped by their blocking checks before any training "
            f"({shown}); `tracks explain SNAPSHOT_ID` says why."
        )


@main.command("ledger-upgrade")
def ledger_upgrade() -> None:
    """Bring the ledger schema to the newest migration."""
    settings = _settings()
    _ledger(settings)
    click.echo(f"ledger at {redact.database_url(settings.ledger_url)} is up to date")


if __name__ == "__main__":
    sys.exit(main())
