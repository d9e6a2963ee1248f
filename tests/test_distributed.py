"""Two ranks under torchrun (gloo, CPU): sharded checkpoints under the commit protocol.

Real processes and real signals: ``python -m pipeline.distributed.launch`` runs the trainer as
two ranks; the drill SIGKILLs one rank at seeded random moments (inside checkpoint writes too)
and SIGTERMs all of them, resumes each time in new processes, and compares the final weights
with an uninterrupted two-rank run, bit for bit. Resharding (2 ranks → 1, 1 → 2) is checked to
restore, finish, and be recorded on the attempt's receipt.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from bench.kill_drill import write_config as write_drill_config
from pipeline.checkpoint import (
    CorruptCheckpointError,
    checkpoint_dirs,
    load_checkpoint,
    verify_checkpoint,
)
from pipeline.checkpoint.layout import COMMITTED_FILE, DCP_METADATA_FILE
from pipeline.distributed.launch import RankOutcome, decide_exit, end_deferred_attempt
from pipeline.ledger import AttemptStart, Ledger
from pipeline.trainer import exit_codes
from tests.checkpoint_support import resign
from tests.distributed_support import drill_config, launch_ranks, trainer_rank_pids

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 160
INTERVAL = 2
KILLS = 12


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def config(workdir: Path) -> Path:
    return drill_config(workdir, max_steps=MAX_STEPS, interval=INTERVAL, keep_last_k=2)


def _launch(
    config: Path,
    store: Path,
    run_id: str,
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> subprocess.Popen:
    if nproc > 1:
        return launch_ranks(config, store, run_id, nproc=nproc, env=env, log=log).process
    # One rank: the trainer itself, without the launcher (the reshard tests' 2 -> 1 and 1 -> 2).
    command = [sys.executable, "-m", "pipeline.trainer", "--config", str(config),
               "--run-id", run_id, "--store", str(store)]  # fmt: skip
    log = log or store / f"{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(process: subprocess.Popen, timeout: float = 120) -> int:
    return process.wait(timeout=timeout)


def _final_weights(store: Path, run_id: str) -> dict[str, torch.Tensor]:
    newest = checkpoint_dirs(store / run_id)[0]
    contents = load_checkpoint(newest)
    assert contents.info.step == MAX_STEPS
    return {**contents.model, **{f"opt/{k}": v for k, v in contents.training_tensors.items()}}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bit-exact: {different[:5]}"


# A deadline for a failure, never a timing: a two-rank start (a launcher, two interpreters
# importing torch and, then, DDP's TorchDynamo) took over 60 s on a slow 2-vCPU VM with the
# suite's four workers beside it.
STARTUP_SECONDS = 240


def _wait_for(path: Path, text: str, timeout: float = STARTUP_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never appeared in {path}:\n{path.read_text()[-3000:]}")


def _count(path: Path, text: str) -> int:
    return path.read_text(errors="replace").count(text) if path.exists() else 0


def _wait_for_count(path: Path, text: str, count: int, timeout: float = STARTUP_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _count(path, text) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} did not appear {count} times in {path}")


@pytest.fixture(scope="module")
def reshard_config(workdir: Path, config: Path) -> Path:
    # Checkpoints only where the test stops the run: resharding is what is tested here.
    return write_drill_config(
        workdir / "reshard-config",
        Path(yaml.safe_load(config.read_text())["snapshot_dir"]),
        max_steps=MAX_STEPS,
        checkpoint_every_steps=MAX_STEPS,
        keep_last_k=2,
    )


@pytest.fixture(scope="module")
def reference(workdir: Path, config: Path) -> dict[str, torch.Tensor]:
    store = workdir / "reference"
    assert _finish(_launch(config, store, "ref")) == 0, (store / "ref.log").read_text()[-3000:]
    return _final_weights(store, "ref")


def _all_committed_verify(run_dir: Path) -> int:
    dirs = checkpoint_dirs(run_dir)
    for directory in dirs:
        verify_checkpoint(directory)
    return len(dirs)


@pytest.mark.slow
def test_kill_one_rank_at_random_moments_then_sigterm_all(
    workdir: Path, config: Path, reference: dict[str, torch.Tensor]
) -> None:
    store, run_id = workdir / "drill", "drill"
    rng = random.Random(0)
    log = store / "drill.log"
    kills = 0
    for kill in range(KILLS):
        # Every third kill lands between MANIFEST.json and COMMITTED (inside a write).
        env = {}
        if kill % 3 == 2:
            env["TRACKS_FAULT_SLEEP_BEFORE_COMMIT"] = "5"
        started = _count(log, '"attempt_started"')
        process = _launch(config, store, run_id, env=env, log=log)
        _wait_for_count(log, '"attempt_started"', started + 1)
        time.sleep(rng.uniform(0.0, 0.25))
        ranks = trainer_rank_pids(process.pid)
        victim = rng.choice(sorted(ranks)) if ranks else None
        if victim is not None:
            try:
                os.kill(ranks[victim], signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass
        code = _finish(process)
        if code == exit_codes.SUCCEEDED:
            break  # the run finished before the kill landed
        assert code in (128 + signal.SIGKILL, exit_codes.INFRA_TRANSIENT), (code, kill)
        # The launcher's record names the killed rank as the one that failed first.
        summaries = sorted((store / run_id).glob("attempt-*.ranks.json"), key=os.path.getmtime)
        if victim is not None and code == 128 + signal.SIGKILL and summaries:
            first = json.loads(summaries[-1].read_text())["first_failure"]
            assert first["rank"] == victim and first["exit_code"] == 137, first
        # Nothing without COMMITTED is ever read; everything with it verifies.
        _all_committed_verify(store / run_id)
    assert kills >= KILLS - 2, f"only {kills} kills landed"

    # SIGTERM every rank (through the launcher): they agree on a step, save, and exit 75.
    started = _count(log, '"attempt_started"')
    process = _launch(config, store, run_id, env={"TRACKS_FAULT_SLEEP_AFTER_STEP": "60"}, log=log)
    _wait_for_count(log, '"attempt_started"', started + 1)
    os.kill(process.pid, signal.SIGTERM)
    code = _finish(process)
    if code != exit_codes.SUCCEEDED:
        assert code == exit_codes.PREEMPTED, log.read_text()[-3000:]
    assert _finish(_launch(config, store, run_id, log=log)) == 0, log.read_text()[-3000:]
    _all_committed_verify(store / run_id)
    _assert_equal(_final_weights(store, run_id), reference)


@pytest.mark.slow
def test_reshard_two_ranks_to_one_and_one_to_two(workdir: Path, reshard_config: Path) -> None:
    config = reshard_config
    from pipeline.explain import explain

    store = workdir / "reshard"
    ledger_url = f"sqlite:///{workdir / 'reshard-ledger.db'}"
    env = {"TRACKS_LEDGER_URL": ledger_url}
    for run_id, first, second in (("two-to-one", 2, 1), ("one-to-two", 1, 2)):
        stop_at = {**env, "TRACKS_FAULT_SLEEP_AFTER_STEP": "60@10"}
        log = store / f"{run_id}.log"
        process = _launch(config, store, run_id, nproc=first, env=stop_at, log=log)
        try:
            _wait_for(log, '"step": 10,')
        except AssertionError:
            os.killpg(process.pid, signal.SIGKILL)  # not left to train on beside the suite
            raise
        os.killpg(process.pid, signal.SIGTERM)
        assert _finish(process) == exit_codes.PREEMPTED, log.read_text()[-3000:]
        assert _finish(_launch(config, store, run_id, nproc=second, env=env, log=log)) == 0, (
            log.read_text()[-3000:]
        )
        ledger = Ledger.open(ledger_url)
        resumed = ledger.get_attempt(run_id, 2)
        assert resumed.placement["world_size"] == second
        assert resumed.placement["resharded_from"] == first, resumed.placement
        assert resumed.resumed_from_checkpoint.endswith("step-0000000010-a01")
        assert '"resharded"' in log.read_text()
        assert f"resharded from {first}" in explain(ledger, run_id)
        final = load_checkpoint(checkpoint_dirs(store / run_id)[0])
        assert final.info.step == MAX_STEPS and final.info.world_size == second
        assert all(torch.isfinite(t).all() for t in final.model.values())


class _Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch /tmp/tracks-dcp-metadata-pwned",))


@pytest.mark.slow  # shares the two-rank reference run with the drill
def test_dcp_metadata_is_read_only_through_the_allow_list(
    workdir: Path, reference: dict[str, torch.Tensor]
) -> None:
    import shutil

    source = checkpoint_dirs(workdir / "reference" / "ref")[0]
    directory = workdir / "tampered" / "ref" / source.name
    shutil.copytree(source, directory)
    load_checkpoint(directory)  # the copy is sound before tampering

    # Changed without re-signing: the digest catches it before anything is unpickled.
    (directory / DCP_METADATA_FILE).write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        load_checkpoint(directory)
    # Re-signed by an attacker: the allow-list refuses os.system before it is called.
    resign(directory, DCP_METADATA_FILE)
    marker = Path("/tmp/tracks-dcp-metadata-pwned")
    marker.unlink(missing_ok=True)
    with pytest.raises(CorruptCheckpointError, match="allow-list"):
        load_checkpoint(directory)
    assert not marker.exists()


@pytest.mark.slow  # shares the two-rank reference run with the drill
def test_a_shard_changed_after_verification_is_caught_where_dcp_reads_it(
    workdir: Path, reference: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No window between the digest check and DCP's read: a shard that changes right after
    every file verified is caught on the bytes DCP would parse, not loaded."""
    import shutil

    from pipeline.checkpoint import sharded_read

    source = checkpoint_dirs(workdir / "reference" / "ref")[0]
    directory = workdir / "toctou" / "ref" / source.name
    shutil.copytree(source, directory)
    clean = load_checkpoint(directory)
    [shard, *_] = sorted(directory.glob("*.distcp"))
    verify = sharded_read.verify_files

    def verify_then_change(*args: Any, **kwargs: Any) -> None:
        verify(*args, **kwargs)
        data = bytearray(shard.read_bytes())
        data[-200] ^= 0xFF  # inside the last tensor's bytes, the size unchanged
        shard.write_bytes(bytes(data))

    monkeypatch.setattr(sharded_read, "verify_files", verify_then_change)
    with pytest.raises(CorruptCheckpointError, match=shard.name):
        load_checkpoint(directory)
    assert clean.info.step > 0


def test_launcher_names_the_first_failed_rank_not_the_collateral() -> None:
    killed = RankOutcome(1, 128 + 9, None, "rank 1 was killed by SIGKILL", None, 10.0)
    collateral = RankOutcome(0, exit_codes.INFRA_TRANSIENT, "infra_transient", "peer gone", 3, 9.0)
    assert decide_exit([collateral, killed]) == (128 + 9, killed)
    saved = [
        RankOutcome(r, exit_codes.PREEMPTED, "preempted", "saved", 12, 5.0 + r) for r in (0, 1)
    ]
    assert decide_exit(saved) == (exit_codes.PREEMPTED, None)  # all stopped alike: no first
    ok = [RankOutcome(r, 0, "succeeded", "", 40, 1.0) for r in (0, 1)]
    assert decide_exit(ok) == (0, None)


def test_gpu_seconds_count_one_accelerator_per_rank() -> None:
    from pipeline.attempts import accelerators_held

    assert accelerators_held({"accelerator_count": 0, "world_size": 4}) == 0  # CPU ranks
    assert accelerators_held({"accelerator_count": 8, "world_size": 1}) == 8  # one process, 8 GPUs
    assert accelerators_held({"accelerator_count": 8, "world_size": 16}) == 16  # 2 nodes x 8 ranks


@pytest.mark.slow
def test_an_orchestrated_attempt_whose_rank_1_is_killed_names_it_on_the_receipt(
    tracks_home: Path,
) -> None:
    """The Dagster path's receipt, without Dagster: prepare, launch two ranks, SIGKILL rank 1,
    finish. The receipt and `tracks explain` name rank 1 as the rank that failed first."""
    from pipeline.attempts import finish_attempt, prepare_attempt
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot
    from pipeline.explain import explain
    from pipeline.settings import TracksSettings
    from pipeline.trainer.config import TrainConfig

    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    ledger = Ledger.open(settings.ledger_url)
    write_digits_landing(settings.landing_root)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    config = TrainConfig.from_dict(
        {
            "seed": 5, "max_steps": 400, "checkpoint_every_steps": 5, "batch_size": 32,
            "learning_rate": 0.003, "optimizer": "adam", "keep_last_k": 3,
            "model": {"channels": 4, "hidden": 16}, "snapshot_dir": str(snapshot.path),
        },
        source="test",
    )  # fmt: skip
    prepared = prepare_attempt(
        ledger, snapshot=snapshot, train_config=config, work_root=settings.work_root
    )
    run_id = prepared.run.run_id
    store = settings.checkpoint_root
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.distributed.launch", "--nproc-per-node", "2",
         "--log-dir", str(settings.work_root / "ranks"), "--", *prepared.trainer_args(store)],
        cwd=REPO, env={**os.environ, **prepared.trainer_env(ledger.url),
                       "TRACKS_FAULT_SLEEP_AFTER_STEP": "60@12"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while (latest := ledger.latest_committed_checkpoint(run_id)) is None or latest.step < 10:
            assert process.poll() is None and time.monotonic() < deadline, "no commit at step 10"
            time.sleep(0.1)
        time.sleep(0.3)  # both ranks wait in the pause after step 12
        os.kill(trainer_rank_pids(process.pid)[1], signal.SIGKILL)
        killed = time.monotonic()
        # torchrun's agent now SIGTERMs rank 0, whose final save needs its dead peer: it gives
        # up within the checkpoint group's 20 s timeout, well inside a 30 s grace period.
        returncode = process.wait(timeout=60)
        gave_up = time.monotonic() - killed
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert returncode == 128 + signal.SIGKILL
    assert gave_up < 25, gave_up
    # The previous committed checkpoint stands: step 10, verified; nothing at 12 is committed.
    run_dir = store / run_id
    steps = [verify_checkpoint(d).step for d in checkpoint_dirs(run_dir)]  # all of them verify
    assert steps[0] == 10, steps
    assert not [d for d in run_dir.glob("step-0000000012-*") if (d / COMMITTED_FILE).exists()]
    assert ledger.latest_committed_checkpoint(run_id).step == 10
    finished = finish_attempt(
        ledger, prepared, store=store, returncode=returncode, signal_name=None
    )
    assert finished.termination.reason == "preempted", finished.termination
    assert "Rank 1 failed first" in finished.termination.detail, finished.termination.detail
    assert "SIGKILL" in finished.termination.detail
    # Rank 0 said where the ranks were when rank 1 died: past the last commit, at step 12.
    assert finished.attempt.last_step == 12, finished.attempt.last_step
    attempt = ledger.get_attempt(run_id, 1)
    assert attempt.placement["world_size"] == 2
    page = explain(ledger, run_id)
    assert "Rank 1 failed first" in page
    assert "2 ranks" in page or "2 (" in page, page


@pytest.mark.slow
def test_a_self_owned_attempt_whose_rank_1_is_killed_is_closed_by_the_launcher(
    workdir: Path, config: Path
) -> None:
    """``--ledger-url`` without ``--attempt-no``: rank 0 begins the attempt, and the launcher,
    the one process that saw every rank end, closes it naming the rank that failed first."""
    from pipeline.explain import explain

    store = workdir / "self-owned"
    ledger_url = f"sqlite:///{workdir / 'self-owned-ledger.db'}"
    run_id = "self-owned-kill"
    env = {"TRACKS_LEDGER_URL": ledger_url, "TRACKS_FAULT_SLEEP_AFTER_STEP": "60@12"}
    process = _launch(config, store, run_id, env=env)
    ledger = Ledger.open(ledger_url)
    try:
        deadline = time.monotonic() + 90
        while (latest := ledger.latest_committed_checkpoint(run_id)) is None or latest.step < 10:
            assert process.poll() is None and time.monotonic() < deadline, "no commit at step 10"
            time.sleep(0.1)
        time.sleep(0.3)  # both ranks wait in the pause after step 12
        os.kill(trainer_rank_pids(process.pid)[1], signal.SIGKILL)
        returncode = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert returncode == 128 + signal.SIGKILL
    attempt = ledger.get_attempt(run_id, 1)
    assert attempt.ended_at is not None, "the launcher did not close the attempt"
    assert attempt.termination_reason == "preempted", attempt.termination_detail
    assert "Rank 1 failed first" in attempt.termination_detail, attempt.termination_detail
    assert "SIGKILL" in attempt.termination_detail
    assert attempt.exit_code == 128 + signal.SIGKILL
    # Rank 0 said where the ranks were when rank 1 died: past the last commit, at step 12.
    assert attempt.last_step == 12, attempt.last_step
    assert attempt.cpu_seconds > 0  # the ranks' clocks, added up by the launcher
    assert "Rank 1 failed first" in explain(ledger, run_id)


def _open_attempt(tmp_path: Path, run_id: str = "deferred") -> tuple[str, Ledger]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger.open(url)
    ledger.create_run(
        run_id=run_id, model_family="digits-cnn", owner="test", purpose="baseline",
        config_sha256="c" * 64, snapshot_id="digits-0123",
    )  # fmt: skip
    ledger.begin_attempt(
        run_id,
        AttemptStart(
            config_snapshot={},
            config_sha256="c" * 64,
            data_manifest_sha256="d" * 64,
            container_digest="env:test",
        ),
    )
    return url, ledger


def _outcome(rank: int, code: int, **fields: Any) -> RankOutcome:
    return RankOutcome(
        rank=rank, exit_code=code, reason=fields.pop("reason", None),
        detail=fields.pop("detail", f"rank {rank} said {code}"), step=fields.pop("step", None),
        ended_at=fields.pop("ended_at", 1.0), attempt_no=fields.pop("attempt_no", 1), **fields,
    )  # fmt: skip


def test_the_launcher_closes_only_a_self_owned_attempt_rank_0_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ledger = _open_attempt(tmp_path)
    monkeypatch.delenv("TRACKS_LEDGER_URL", raising=False)
    args = ["--config", "c.yaml", "--run-id", "deferred", "--store", str(tmp_path / "store")]
    said = "rank 1 was killed by SIGKILL without last words"
    killed = _outcome(1, 137, detail=said, ended_at=0.5)
    broke = {"reason": "infra_transient", "detail": "a peer rank is gone"}
    rank0 = _outcome(0, 74, step=7, deferred_end=True, cpu_seconds=2.0, **broke)
    outcomes = [rank0, killed]
    code, first = decide_exit(outcomes)

    # Orchestrated (--attempt-no): its orchestrator closes it. No ledger: nothing to close.
    end_deferred_attempt([*args, "--attempt-no", "1", "--ledger-url", url], outcomes, code, first)
    end_deferred_attempt(args, outcomes, code, first)
    # Rank 0 closed it itself (an older trainer, or not under this launcher's outcome dir).
    not_left = [_outcome(0, 74, **broke), killed]
    end_deferred_attempt([*args, "--ledger-url", url], not_left, code, first)
    assert ledger.get_attempt("deferred", 1).ended_at is None

    end_deferred_attempt([*args, "--ledger-url", url], outcomes, code, first)
    attempt = ledger.get_attempt("deferred", 1)
    assert attempt.ended_at is not None and attempt.exit_code == 137
    assert attempt.termination_reason == "preempted", attempt.termination_detail
    assert attempt.termination_detail.endswith(
        "Rank 1 failed first: rank 1 was killed by SIGKILL without last words."
    )
    assert attempt.last_step == 7 and attempt.cpu_seconds == 2.0


def test_a_self_owned_attempt_whose_rank_0_was_killed_is_closed_from_the_others_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ledger = _open_attempt(tmp_path)
    monkeypatch.setenv("TRACKS_LEDGER_URL", url)  # the trainer's default, read here too
    args = ["--run-id", "deferred", "--store", str(tmp_path / "store")]
    outcomes = [
        _outcome(0, 137, detail="rank 0 was killed by SIGKILL without last words", attempt_no=None),
        _outcome(1, exit_codes.INFRA_TRANSIENT, step=9, ended_at=2.0, cpu_seconds=1.5),
    ]
    code, first = decide_exit(outcomes)
    end_deferred_attempt(args, outcomes, code, first)
    attempt = ledger.get_attempt("deferred", 1)
    assert attempt.ended_at is not None and attempt.exit_code == 137
    assert "Rank 0 failed first: rank 0 was killed by SIGKILL" in attempt.termination_detail
    assert attempt.last_step == 9
