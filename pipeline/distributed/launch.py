"""``python -m pipeline.distributed.launch --nproc-per-node N -- <trainer arguments>``.

Runs ``python -m pipeline.trainer <trainer arguments>`` as N ranks per node under torchrun's
elastic agent, and keeps the trainer's contract at any world size:

- ``max_restarts=0``: a restart inside torchrun would reuse the attempt's fencing token;
  retries belong to the resume sensor, under a new attempt.
- Exit code: the trainer's own when every rank agrees (75 when all saved on SIGTERM), else the
  first failed rank's (a rank killed by a signal gives 128 + the signal, as a shell would).
  A rank is said to have failed first only when the evidence orders it: every rank ending alike
  (a signal delivered to all) names none, and a rank ended by a peer's failure (its collective
  broke, exit 74, or the agent stopped it with SIGTERM) is collateral, never the cause.
- SIGTERM/SIGINT reach every rank (torchrun forwards them, and the orchestrator signals the
  process group); the ranks agree on the step to stop at and save together.
- Each rank writes its outcome to ``<log dir>/outcome-<rank>.json``; the launcher reads them
  all and writes the first failure as JSON where Kubernetes reads a container's termination
  message (``$TRACKS_TERMINATION_LOG``, default ``/dev/termination-log`` when it exists).
- The log stays line-atomic: only global rank 0 writes to this process's stdout/stderr; the
  other ranks' output goes to a file each under the log directory.

Multi-node: torchrun's ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT`` (set by Kubeflow Trainer, or by an Indexed Job) select static rendezvous.
A malformed one is refused before anything starts, naming the variable (exit 2, as argparse).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline import envvars, redact
from pipeline.distributed.ranks import ranks_summary_path
from pipeline.process_exit import exit_process
from pipeline.trainer import exit_codes

OUTCOME_DIR_ENV = envvars.TRACKS_RANK_OUTCOME_DIR.name
LAUNCHER_PID_ENV = envvars.TRACKS_LAUNCHER_PID.name
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_K8S_TERMINATION_LOG = Path("/dev/termination-log")
# The agent stamps a rank it saw die with int(time.time()) at its next poll (every 0.1 s), up
# to 1.1 s off the moment of death; a rank's own outcome is stamped to the millisecond. Only
# a wider gap (with room for clock skew between NTP-synced nodes) says which rank came first.
ORDER_MARGIN_SECONDS = 1.5


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended: what it wrote itself, or what the agent saw (a signal, no words)."""

    rank: int
    exit_code: int
    reason: str | None
    detail: str
    step: int | None
    ended_at: float  # seconds since the epoch; orders the failures
    attempt_no: int | None = None
    # Self-owned attempts (a ledger, no --attempt-no): rank 0 began the attempt and left its
    # end to this launcher, with what it spent (it alone knows its clocks).
    deferred_end: bool = False
    cpu_seconds: float = 0.0
    gpu_seconds: float = 0.0
    signal: str | None = None  # the signal that ended it (the agent's record, or its words)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "detail": self.detail,
            "step": self.step,
            "signal": self.signal,
            "ended_at": self.ended_at,
        }


def die_with_launcher() -> None:
    """Make this rank die when the launcher does (Linux), as a container's processes would.

    torchrun starts each rank in a session of its own, so a launcher killed outright (SIGKILL
    after the grace period) would otherwise leave its ranks training with nobody watching.
    """
    expected = envvars.TRACKS_LAUNCHER_PID.get()
    if expected is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != expected:  # the launcher died before prctl took effect
        os._exit(128 + int(signal.SIGKILL))


def write_rank_outcome(
    rank: int,
    *,
    exit_code: int,
    reason: str,
    detail: str,
    step: int | None,
    attempt_no: int | None = None,
    deferred_end: bool = False,
    cpu_seconds: float = 0.0,
    gpu_seconds: float = 0.0,
) -> None:
    """Called by each rank on its way out, when launched by this module."""
    directory = envvars.TRACKS_RANK_OUTCOME_DIR.get()
    if directory is None:
        return
    from pipeline.durable import replace_atomically

    payload = {
        "rank": rank,
        "exit_code": exit_code,
        "reason": reason,
        "detail": detail,
        "step": step,
        "attempt_no": attempt_no,
        "ended_at": time.time(),
        "deferred_end": deferred_end,
        "cpu_seconds": cpu_seconds,
        "gpu_seconds": gpu_seconds,
    }
    replace_atomically(Path(directory) / f"outcome-{rank}.json", json.dumps(payload).encode())


def read_outcomes(directory: Path, world_size: int, failures: dict[int, Any]) -> list[RankOutcome]:
    """Every rank's outcome: its own file, else the agent's record of its death."""
    outcomes = []
    for rank in range(world_size):
        path = directory / f"outcome-{rank}.json"
        failure = failures.get(rank)
        try:
            data = json.loads(path.read_text())
            outcomes.append(
                RankOutcome(
                    rank=rank,
                    exit_code=int(data["exit_code"]),
                    reason=data.get("reason"),
                    detail=str(data.get("detail", "")),
                    step=data.get("step"),
                    ended_at=float(data.get("ended_at", 0.0)),
                    attempt_no=data.get("attempt_no"),
                    deferred_end=data.get("deferred_end") is True,
                    cpu_seconds=float(data.get("cpu_seconds") or 0.0),
                    gpu_seconds=float(data.get("gpu_seconds") or 0.0),
                )
            )
            continue
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if failure is None:
            # Rank on another node, or one that ended cleanly without a word (not ours).
            continue
        code = int(failure.exitcode)
        signal_name = failure.signal_name() if code < 0 else None
        outcomes.append(
            RankOutcome(
                rank=rank,
                exit_code=128 - code if code < 0 else code,
                reason=None,
                detail=(
                    f"rank {rank} was killed by {signal_name} without last words"
                    if code < 0
                    else f"rank {rank} exited {code} without last words"
                ),
                step=None,
                ended_at=float(failure.timestamp),
                signal=signal_name,
            )
        )
    return outcomes


# How a rank ends when another one failed: its collective broke (74), or the agent, seeing the
# failure, stopped it with SIGTERM (it saved and exited 75, or died of the signal: 128 + 15).
_COLLATERAL_EXIT_CODES = frozenset(
    {exit_codes.INFRA_TRANSIENT, exit_codes.PREEMPTED, 128 + int(signal.SIGTERM)}
)


def _failed_and_causes(outcomes: list[RankOutcome]) -> tuple[list[RankOutcome], list[RankOutcome]]:
    """The failed ranks, and those among them that failed on their own account.

    A rank that ended as ranks do after a peer's failure (see ``_COLLATERAL_EXIT_CODES``) is no
    cause: the peer's failure, or a signal sent to every rank, ended it.
    """
    failed = [o for o in outcomes if o.exit_code != exit_codes.SUCCEEDED]
    return failed, [o for o in failed if o.exit_code not in _COLLATERAL_EXIT_CODES]


def _ended_alike(outcomes: list[RankOutcome]) -> bool:
    failed = [o for o in outcomes if o.exit_code != exit_codes.SUCCEEDED]
    return bool(failed) and len(failed) == len(outcomes) and len({o.exit_code for o in failed}) == 1


def _when(outcome: RankOutcome) -> tuple[float, int]:
    return outcome.ended_at, outcome.rank


def decide_exit(outcomes: list[RankOutcome]) -> tuple[int, RankOutcome | None]:
    """The launcher's exit code, and the rank that failed first (None when no rank did).

    No rank failed first when all succeeded, when every rank ended alike (a signal delivered
    to all of them, a loss every rank saw), when none failed on its own account, or when those
    that did ended within :data:`ORDER_MARGIN_SECONDS` of each other: their times do not order
    them. The exit code is then still the earliest-stamped failure's.
    """
    failed, causes = _failed_and_causes(outcomes)
    if not failed:
        return exit_codes.SUCCEEDED, None
    if not causes or _ended_alike(outcomes):
        # A rank that saved on the signal speaks for the exit code before a broken collective.
        said = [o for o in failed if o.exit_code != exit_codes.INFRA_TRANSIENT] or failed
        return min(said, key=_when).exit_code, None
    ordered = sorted(causes, key=_when)
    first = ordered[0]
    if len(ordered) > 1 and ordered[1].ended_at - first.ended_at <= ORDER_MARGIN_SECONDS:
        return first.exit_code, None
    return first.exit_code, first


def write_termination_message(first: RankOutcome | None, exit_code: int, world_size: int) -> None:
    """Kubernetes shows this file's content as the container's termination message."""
    target = envvars.TRACKS_TERMINATION_LOG.get()
    path = Path(target) if target else _K8S_TERMINATION_LOG
    if not target and not path.exists():
        return
    message = {"exit_code": exit_code, "world_size": world_size}
    if first is not None:
        message.update(first.as_dict())
    reason = exit_codes.REASON_BY_EXIT_CODE.get(exit_code)
    message["reason"] = message.get("reason") or (str(reason) if reason else None)
    try:
        path.write_text(json.dumps(message, sort_keys=True)[:4000])  # the kubelet keeps 4 KiB
    except OSError as exc:
        print(f"pipeline.distributed.launch: cannot write {path}: {exc}", file=sys.stderr)


def launched_here() -> bool:
    """True in a rank started by this module (its outcome reaches the launcher)."""
    return envvars.TRACKS_RANK_OUTCOME_DIR.is_set()


def _trainer_args(trainer_args: list[str]) -> argparse.Namespace:
    trainer = argparse.ArgumentParser(add_help=False)
    trainer.add_argument("--store")
    trainer.add_argument("--run-id")
    trainer.add_argument("--attempt-no", type=int)
    trainer.add_argument("--ledger-url")
    known, _ = trainer.parse_known_args(trainer_args)
    return known


def end_deferred_attempt(
    trainer_args: list[str], outcomes: list[RankOutcome], exit_code: int, first: RankOutcome | None
) -> None:
    """Close a self-owned attempt whose rank 0 left its end to this launcher.

    Orchestrated attempts (``--attempt-no``) are closed by their orchestrator, which reads the
    ranks summary; self-owned ones had only rank 0 to close them, which saw its peers' failures
    only as a broken collective. Rank 0 SIGKILLed leaves no outcome: the attempt it began is
    closed all the same, with what the other ranks and the agent saw.
    """
    known = _trainer_args(trainer_args)
    url = known.ledger_url or envvars.TRACKS_LEDGER_URL.get()
    rank0 = next((o for o in outcomes if o.rank == 0), None)
    numbers = {o.attempt_no for o in outcomes if o.attempt_no is not None}
    if (
        known.attempt_no is not None
        or not (url and known.store and known.run_id and len(numbers) == 1)
        # Rank 0 spoke (reason set: its own outcome file) and closed the attempt itself.
        or (rank0 is not None and rank0.reason is not None and not rank0.deferred_end)
    ):
        return
    from pipeline.attempts import end_self_owned_attempt
    from pipeline.ledger import Ledger

    steps = [o.step for o in outcomes if o.step is not None]
    end_self_owned_attempt(
        Ledger.open(url),
        store=Path(known.store),
        run_id=known.run_id,
        attempt_no=numbers.pop(),
        exit_code=exit_code,
        first_failure=first.as_dict() if first else None,
        reached=max(steps, default=None),
        cpu_seconds=sum(o.cpu_seconds for o in outcomes),
        gpu_seconds=rank0.gpu_seconds if rank0 else 0.0,
    )


def _with_signals_from_last_words(
    outcomes: list[RankOutcome], store: str, run_id: str, attempt_no: int
) -> list[RankOutcome]:
    """A rank that caught a signal exits on its own (75): its last words name the signal."""
    from pipeline.reasons import read_last_words
    from pipeline.trainer.attempt import last_words_path

    filled = []
    for o in outcomes:
        if o.signal is None and o.reason is not None:
            words = read_last_words(last_words_path(store, run_id, attempt_no, rank=o.rank))
            said = (words or {}).get("signal")
            if isinstance(said, str) and (words or {}).get("attempt_no") == attempt_no:
                o = replace(o, signal=said)
        filled.append(o)
    return filled


def summarize_ranks(
    outcomes: list[RankOutcome], exit_code: int, first: RankOutcome | None, world_size: int
) -> dict[str, Any]:
    """The ranks summary: every rank's ending, and what orders them or says they stopped alike.

    ``first_failure``: the rank that failed first (see :func:`decide_exit`). ``together``:
    every rank ended alike (their exit code, and the signal and step when all agree; ``killed``
    when none spoke, so the agent saw them die). ``unordered``: ranks that failed on their own
    too close together to order. A rank's ``collateral`` flag: a peer's failure ended it; its
    own words stay in its ``detail``.
    """
    failed, causes = _failed_and_causes(outcomes)
    collateral = {o.rank for o in failed} - {o.rank for o in causes} if causes else set()
    together = None
    if _ended_alike(outcomes) and len(failed) > 1:
        signals = {o.signal for o in failed}
        steps = {o.step for o in failed}
        together = {
            "exit_code": exit_code,
            "signal": signals.pop() if len(signals) == 1 else None,
            "step": steps.pop() if len(steps) == 1 else None,
            "killed": all(o.reason is None for o in failed),
            "ranks": len(failed),
            "world_size": world_size,
        }
    ordered = first is not None or together is not None or len(causes) < 2
    unordered = [] if ordered else sorted(o.rank for o in causes)
    ranks = sorted(outcomes, key=lambda o: o.rank)
    return {
        "world_size": world_size,
        "exit_code": exit_code,
        "first_failure": next((o.as_dict() for o in ranks if first and o.rank == first.rank), None),
        "together": together,
        "unordered": unordered,
        "ranks": [{**o.as_dict(), "collateral": o.rank in collateral} for o in ranks],
    }


def write_ranks_summary(
    trainer_args: list[str],
    outcomes: list[RankOutcome],
    exit_code: int,
    first: RankOutcome | None,
    world_size: int,
) -> Path | None:
    """Beside the last words, so the attempt's receipt says how each rank ended and why."""
    known = _trainer_args(trainer_args)
    numbers = {o.attempt_no for o in outcomes if o.attempt_no is not None}
    attempt_no = known.attempt_no or (numbers.pop() if len(numbers) == 1 else None)
    if not (known.store and known.run_id and attempt_no):
        return None
    from pipeline.durable import replace_atomically

    path = ranks_summary_path(known.store, known.run_id, attempt_no)
    outcomes = _with_signals_from_last_words(outcomes, known.store, known.run_id, attempt_no)
    summary = summarize_ranks(outcomes, exit_code, first, world_size)
    replace_atomically(path, json.dumps(summary, indent=1, sort_keys=True).encode())
    return path


class LaunchEnvError(ValueError):
    """A ``PET_*`` variable (torchrun's conventions) set to something that cannot work."""

    def __init__(self, name: str, value: str, problem: str) -> None:
        super().__init__(f"environment variable {name}={value!r}: {problem}")
        self.name = name
        self.value = value


@dataclass(frozen=True)
class NodeEnv:
    """This node's place in the job, from torchrun's ``PET_*`` variables (defaults: one node)."""

    nproc_per_node: int | None  # None: not set, the command line (or 1) decides
    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int


def _pet_int(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise LaunchEnvError(name, raw, f"expected a whole number from {low} to {high}")
    return value


def node_env(env: Mapping[str, str] | None = None) -> NodeEnv:
    """Read and check the ``PET_*`` variables; :class:`LaunchEnvError` names a malformed one."""
    env = os.environ if env is None else env
    most = 1 << 20  # no job has more nodes or ranks per node; a larger number is a typo
    nnodes = _pet_int(env, "PET_NNODES", 1, 1, most)
    addr = env.get("PET_MASTER_ADDR")
    if addr is not None and not addr.strip():
        raise LaunchEnvError("PET_MASTER_ADDR", addr, "expected a host name or address")
    if nnodes > 1 and addr is None:
        raise LaunchEnvError("PET_NNODES", str(nnodes), "more than one node needs PET_MASTER_ADDR")
    return NodeEnv(
        nproc_per_node=(
            _pet_int(env, "PET_NPROC_PER_NODE", 1, 1, most) if "PET_NPROC_PER_NODE" in env else None
        ),
        nnodes=nnodes,
        node_rank=_pet_int(env, "PET_NODE_RANK", 0, 0, nnodes - 1),
        master_addr=addr.strip() if addr else None,
        master_port=_pet_int(env, "PET_MASTER_PORT", 29500, 1, 65535),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's arguments; a bad count or ``PET_*`` variable exits 2, like argparse."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.distributed.launch",
        description="Run the trainer as N ranks per node under torchrun.",
    )
    parser.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this node")
    parser.add_argument("--log-dir", help="where ranks' outcomes and non-zero ranks' logs go")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then trainer args")
    args = parser.parse_args(argv)
    if args.trainer_args and args.trainer_args[0] == "--":
        args.trainer_args = args.trainer_args[1:]
    # Checked before the environment's count can stand in for it: 0 given is 0, not "unset".
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, not {args.nproc_per_node}")
    try:
        node = node_env()
    except LaunchEnvError as exc:
        parser.error(str(exc))
    if args.nproc_per_node is None:
        args.nproc_per_node = node.nproc_per_node or 1
    return args


def _launch_config(nproc: int, log_dir: Path) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    env = os.environ
    node = node_env(env)  # checked by parse_args already: a bad value never gets this far
    nnodes, node_rank = node.nnodes, node.node_rank
    # Only global rank 0 keeps this process's stdout: its lines carry the Pipes messages.
    redirects = {r: Std.ALL for r in range(nproc) if node_rank > 0 or r > 0}
    logs = DefaultLogsSpecs(log_dir=str(log_dir / "ranks"), redirects=redirects)
    if nnodes == 1 and "PET_MASTER_ADDR" not in env:
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "rdzv_configs": {}}
    else:
        endpoint = f"{node.master_addr}:{node.master_port}"
        rdzv = {"rdzv_backend": "static", "rdzv_endpoint": endpoint}
        rdzv["rdzv_configs"] = {"rank": node_rank}
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        logs_specs=logs,
        run_id=env.get("PET_RDZV_ID") or f"tracks-{uuid.uuid4().hex[:12]}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        **rdzv,
    )


def main(argv: list[str] | None = None) -> int:
    """Launch the ranks and exit with the code their outcomes decide.

    SIGTERM/SIGINT: before the ranks start, no rank is started and the exit is 75 (nothing was
    trained); once they run, torchrun's agent forwards the signal, waits for them to save and
    exit, and their own exit 75 becomes this process's.
    """
    # The signals that came before any rank was started: these handlers are replaced by the
    # agent's own just before it starts the ranks.
    stops: list[str] = []

    def remember(signum: int, _frame: Any) -> None:
        stops.append(signal.Signals(signum).name)

    # Before torch is imported (seconds): a stop that comes this early is remembered, and no
    # rank is started for it (the default action would kill this process without a word).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, remember)
    args = parse_args(argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    def stop_launch(signum: int, _frame: Any) -> None:
        # What torchrun's agent raises from its own handler once the ranks run (it forwards
        # the signal to them and waits for them); raised earlier too, during the rendezvous.
        remember(signum, _frame)
        name = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {name}", sigval=name)

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tracks-ranks-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    outcome_dir = log_dir / "outcomes"
    outcome_dir.mkdir(exist_ok=True)
    os.environ[OUTCOME_DIR_ENV] = str(outcome_dir)  # inherited by every rank
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the agent runs in this process
    config = _launch_config(args.nproc_per_node, log_dir)
    world_size = config.max_nodes * args.nproc_per_node
    failures: dict[int, Any] = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop_launch)
        if not stops:
            elastic_launch(config, sys.executable)("-m", "pipeline.trainer", *args.trainer_args)
    except ChildFailedError as exc:
        failures = dict(exc.failures)
    except SignalException as exc:
        # The agent forwarded the signal and waited for the ranks: they speak for themselves.
        print(f"pipeline.distributed.launch: {exc}", file=sys.stderr)
    finally:
        # Every rank has ended: a repeated signal must not cut the bookkeeping below short.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
    outcomes = read_outcomes(outcome_dir, world_size, failures)
    code, first = decide_exit(outcomes)
    if first is None and len(outcomes) < args.nproc_per_node:
        code = exit_codes.INFRA_TRANSIENT  # a local rank said nothing: never report success
    if stops:
        # Stopped before any rank was started: nothing was trained, and the run's newest
        # committed checkpoint stands, as after any stop.
        code = exit_codes.PREEMPTED
        said = f"stopped on {stops[0]} before any rank started"
        print(f"pipeline.distributed.launch: {said}", file=sys.stderr)
    write_termination_message(first, code, world_size)
    try:
        write_ranks_summary(args.trainer_args, outcomes, code, first, world_size)
    except (OSError, ValueError) as exc:
        print(f"pipeline.distributed.launch: no ranks summary: {exc}", file=sys.stderr)
    try:
        end_deferred_attempt(args.trainer_args, outcomes, code, first)
    except Exception as exc:  # the ledger unreachable: the silent-attempt sweep closes it later
        said = redact.text(f"{type(exc).__name__}: {exc}")[:500]
        print(f"pipeline.distributed.launch: attempt not closed: {said}", file=sys.stderr)
    if first is not None:
        print(
            f"pipeline.distributed.launch: rank {first.rank} failed first "
            f"(exit {first.exit_code}): {first.detail}",
            file=sys.stderr,
        )
    return code


if __name__ == "__main__":
    exit_process(main())
