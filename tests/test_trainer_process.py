"""``python -m pipeline.trainer`` as real processes: train, kill, resume, bit for bit.

The uninterrupted reference run is computed once per session; every interrupted run is
compared with it: the same loss at every step and identical bytes of the final
model.safetensors.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.checkpoint import COMMITTED_FILE, MANIFEST_FILE, MODEL_FILE, verify_checkpoint
from pipeline.ledger import AttemptStart, Ledger
from pipeline.states import CheckpointState, TerminationReason
from pipeline.trainer import TrainConfig, exit_codes
from tests.trainer_support import CONFIG, MAX_STEPS, Finished, Trainer, write_config


def run_trainer(config: Path, store: Path, run_id: str, *args: str,
                env: dict[str, str] | None = None) -> Finished:  # fmt: skip
    return Trainer(config, store, run_id, *args, env=env).wait()


def final_dir(store: Path, run_id: str) -> Path:
    (found,) = sorted((store / run_id).glob(f"step-{MAX_STEPS:010d}-a*"))
    return found


@pytest.fixture(scope="session")
def config_path(snapshot_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("config"), snapshot_dir)


@dataclass
class Reference:
    store: Path
    run_id: str
    result: Finished

    @property
    def final_model(self) -> bytes:
        return (final_dir(self.store, self.run_id) / MODEL_FILE).read_bytes()


@pytest.fixture(scope="session")
def reference(config_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run every interrupted one must equal, bit for bit."""
    store = tmp_path_factory.mktemp("reference") / "store"
    result = run_trainer(config_path, store, "ref")
    assert result.returncode == 0, result.stderr
    return Reference(store, "ref", result)


def assert_bit_exact(reference: Reference, store: Path, run_id: str, *runs: Finished) -> None:
    expected = reference.result.losses()
    seen: dict[int, float] = {}
    for run in runs:
        for step, loss in run.losses().items():
            assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"
            seen[step] = loss
    assert sorted(seen) == list(range(1, MAX_STEPS + 1)), "some steps were never trained"
    assert (final_dir(store, run_id) / MODEL_FILE).read_bytes() == reference.final_model


def last_words(store: Path, run_id: str, attempt_no: int) -> dict[str, Any]:
    return json.loads((store / run_id / f"attempt-{attempt_no}.last_words.json").read_text())


# -- the happy path -------------------------------------------------------------------------------


def test_trains_on_digits_snapshot_loss_falls_and_final_checkpoint_verifies(
    reference: Reference,
) -> None:
    losses = reference.result.losses()
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    first = [losses[s] for s in range(1, 6)]
    last = [losses[s] for s in range(MAX_STEPS - 4, MAX_STEPS + 1)]
    assert sum(last) / 5 < 0.5 * sum(first) / 5, (first, last)
    final = final_dir(reference.store, reference.run_id)
    assert (final / COMMITTED_FILE).is_file()
    info = verify_checkpoint(final)
    assert info.step == MAX_STEPS and info.attempt_no == 1
    committed = reference.result.committed()
    assert [c["step"] for c in committed] == [10, 20, 30, 40, 50, 60]
    assert committed[-1]["manifest_sha256"] == info.manifest_sha256
    assert committed[-1]["metrics"]["eval_accuracy"] > 0.5
    finished = reference.result.events[-1]
    assert finished["event"] == "attempt_finished" and finished["reason"] == "succeeded"
    # Retention kept the last 3 (the best by eval_loss is among them: loss falls).
    kept = sorted(p.name for p in (reference.store / "ref").iterdir())
    assert kept == [f"step-{s:010d}-a01" for s in (40, 50, 60)]


def test_final_checkpoint_already_committed_exits_zero_at_once(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(reference.store / "ref", store / "ref")
    result = run_trainer(config_path, store, "ref")
    assert result.returncode == exit_codes.SUCCEEDED, result.stderr
    assert result.losses() == {} and result.committed() == []
    assert "already committed" in result.events[-1]["detail"]


# -- kills and resumes ----------------------------------------------------------------------------


def test_resume_after_sigkill_mid_run_is_bit_exact(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    first = Trainer(config_path, store, "kill", env={"TRACKS_FAULT_SLEEP_AFTER_STEP": "60@25"})
    first.wait_for_step(25)
    # Saves are async: step 20's may still be in flight when step 25 is logged.
    first.wait_until(lambda: (store / "kill" / "step-0000000020-a01" / COMMITTED_FILE).is_file())
    first.process.send_signal(signal.SIGKILL)
    killed = first.wait()
    assert killed.returncode == -signal.SIGKILL
    assert max(killed.losses()) == 25

    resumed = run_trainer(config_path, store, "kill")
    assert resumed.returncode == 0, resumed.stderr
    started = next(e for e in resumed.events if e["event"] == "attempt_started")
    assert started["step"] == 20 and started["resumed_from"].endswith("step-0000000020-a01")
    assert min(resumed.losses()) == 21
    assert_bit_exact(reference, store, "kill", killed, resumed)


def test_resume_after_sigkill_during_checkpoint_write_ignores_uncommitted_dir_and_is_bit_exact(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    half_written = store / "write" / "step-0000000020-a01"
    first = Trainer(config_path, store, "write", env={"TRACKS_FAULT_SLEEP_BEFORE_COMMIT": "60@20"})
    first.wait_until(lambda: (half_written / MANIFEST_FILE).is_file())
    first.process.send_signal(signal.SIGKILL)
    killed = first.wait()
    assert killed.returncode == -signal.SIGKILL
    assert not (half_written / COMMITTED_FILE).exists()

    resumed = run_trainer(config_path, store, "write")
    assert resumed.returncode == 0, resumed.stderr
    started = next(e for e in resumed.events if e["event"] == "attempt_started")
    assert started["resumed_from"].endswith("step-0000000010-a01")
    assert min(resumed.losses()) == 11
    assert_bit_exact(reference, store, "write", killed, resumed)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_commits_checkpoint_at_its_step_and_resume_loses_no_steps(
    reference: Reference, config_path: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    store = tmp_path / "store"
    first = Trainer(config_path, store, "stop", env={"TRACKS_FAULT_SLEEP_AFTER_STEP": "60@25"})
    first.wait_for_step(25)
    first.process.send_signal(signum)
    stopped = first.wait()
    assert stopped.returncode == exit_codes.PREEMPTED, stopped.stderr
    assert stopped.committed()[-1]["step"] == 25
    assert verify_checkpoint(store / "stop" / "step-0000000025-a01").step == 25
    words = last_words(store, "stop", 1)
    assert words["reason"] == TerminationReason.PREEMPTED
    assert words["signal"] == signum.name and words["step"] == 25
    if signum == signal.SIGINT:
        return  # handled alike; one bit-exact resume is enough

    resumed = run_trainer(config_path, store, "stop")
    assert resumed.returncode == 0, resumed.stderr
    assert min(resumed.losses()) == 26
    assert_bit_exact(reference, store, "stop", stopped, resumed)


# -- ledger: corruption and fencing ---------------------------------------------------------------


def test_corrupt_newest_checkpoint_is_marked_in_ledger_and_resume_uses_previous(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    store, url = tmp_path / "store", f"sqlite:///{tmp_path / 'ledger.db'}"
    first = run_trainer(config_path, store, "corrupt", "--ledger-url", url)
    assert first.returncode == 0, first.stderr
    newest = final_dir(store, "corrupt")
    model = newest / MODEL_FILE
    os.chmod(model, 0o644)
    raw = bytearray(model.read_bytes())
    raw[-7] ^= 0x10
    model.write_bytes(bytes(raw))

    second = run_trainer(config_path, store, "corrupt", "--ledger-url", url)
    assert second.returncode == 0, second.stderr
    ledger = Ledger(url)
    record = ledger.get_checkpoint(str(newest))
    assert record.state == CheckpointState.CORRUPT
    assert MODEL_FILE in (record.state_detail or "") and "blake3" in (record.state_detail or "")
    one, two = ledger.attempts("corrupt")
    assert one.termination_reason == two.termination_reason == TerminationReason.SUCCEEDED
    assert two.resumed_from_checkpoint == str(store.resolve() / "corrupt" / "step-0000000050-a01")
    assert two.config_sha256 == TrainConfig.load(config_path).sha256()
    assert ledger.get_run("corrupt").owner
    assert min(second.losses()) == 51
    rebuilt = store / "corrupt" / f"step-{MAX_STEPS:010d}-a02" / MODEL_FILE
    assert rebuilt.read_bytes() == reference.final_model
    latest = ledger.latest_committed_checkpoint("corrupt")
    assert latest is not None and latest.path == str(rebuilt.parent)
    assert latest.parent_path == str(store.resolve() / "corrupt" / "step-0000000050-a01")


def test_when_every_checkpoint_is_corrupt_the_trainer_starts_over_from_the_seed(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    """Checkpoints are read straight into the live tensors, so one that fails its digest has
    already changed them; with nothing older to restore, the trainer builds its initial state
    again and the run equals one that never had a checkpoint, bit for bit."""
    store, url = tmp_path / "store", f"sqlite:///{tmp_path / 'ledger.db'}"
    first = run_trainer(config_path, store, "all-corrupt", "--ledger-url", url)
    assert first.returncode == 0, first.stderr
    corrupted = [d for d in (store / "all-corrupt").iterdir() if (d / MODEL_FILE).exists()]
    assert corrupted
    for directory in corrupted:
        model = directory / MODEL_FILE
        os.chmod(model, 0o644)
        raw = bytearray(model.read_bytes())
        raw[-7] ^= 0x10
        model.write_bytes(bytes(raw))

    second = run_trainer(config_path, store, "all-corrupt", "--ledger-url", url)
    assert second.returncode == 0, second.stderr
    assert [e for e in second.events if e["event"] == "restore_diverged"]
    ledger = Ledger(url)
    for directory in corrupted:
        assert ledger.get_checkpoint(str(directory.resolve())).state == CheckpointState.CORRUPT
    _, two = ledger.attempts("all-corrupt")
    assert two.resumed_from_checkpoint is None
    assert min(second.losses()) == 1  # trained from the first step
    final = store / "all-corrupt" / f"step-{MAX_STEPS:010d}-a02" / MODEL_FILE
    assert final.read_bytes() == reference.final_model


def test_stale_fencing_token_refuses_commit_and_leaves_no_committed(
    config_path: Path, tmp_path: Path
) -> None:
    store, url = tmp_path / "store", f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger.open(url)
    config = TrainConfig.load(config_path)
    ledger.create_run(
        run_id="fenced", model_family="digits-cnn", owner="test", purpose="baseline",
        config_sha256=config.sha256(), snapshot_id="digits",
    )  # fmt: skip
    start = AttemptStart(
        config_snapshot=config.to_dict(), config_sha256=config.sha256(),
        data_manifest_sha256="unknown", container_digest="test",
    )  # fmt: skip
    first = ledger.begin_attempt("fenced", start)
    writing = store / "fenced" / "step-0000000010-a01"
    trainer = Trainer(
        config_path, store, "fenced", "--ledger-url", url,
        "--attempt-no", str(first.attempt_no), "--fencing-token", str(first.fencing_token),
        env={"TRACKS_FAULT_SLEEP_BEFORE_COMMIT": "1.5@10"},
    )  # fmt: skip
    trainer.wait_until(lambda: (writing / MANIFEST_FILE).is_file())
    second = ledger.begin_attempt("fenced", start)  # a second worker takes over the run
    assert second.fencing_token > first.fencing_token
    result = trainer.wait()
    assert result.returncode == exit_codes.FENCED, result.stderr
    assert not (writing / COMMITTED_FILE).exists()
    assert result.committed() == []
    words = last_words(store, "fenced", first.attempt_no)
    assert words["exception_type"] == "StaleFencingTokenError"
    assert words["reason"] == TerminationReason.FENCED
    assert ledger.get_checkpoint(str(writing)).state == CheckpointState.WRITING
    # The orchestrator owns begin/end in this mode: the trainer left the attempt open.
    assert ledger.get_attempt("fenced", first.attempt_no).ended_at is None


# -- classified failures --------------------------------------------------------------------------


def test_nan_loss_exits_diverged_with_last_words(snapshot_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg", snapshot_dir, learning_rate=1e30)
    result = run_trainer(config, tmp_path / "store", "nan")
    assert result.returncode == exit_codes.DIVERGED, result.stderr
    words = last_words(tmp_path / "store", "nan", 1)
    assert words["reason"] == TerminationReason.DIVERGED and "nan" in words["detail"]
    assert words["step"] == max(result.losses()) + 1


def test_snapshot_bytes_differing_from_manifest_exit_bad_input(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    spoiled = tmp_path / snapshot_dir.name
    shutil.copytree(snapshot_dir, spoiled)
    (data_file,) = (spoiled / "data").glob("*.parquet")
    os.chmod(data_file, 0o644)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    result = run_trainer(write_config(tmp_path / "cfg", spoiled), tmp_path / "store", "bad")
    assert result.returncode == exit_codes.BAD_INPUT, result.stderr
    words = last_words(tmp_path / "store", "bad", 1)
    assert words["reason"] == TerminationReason.BAD_INPUT
    assert words["exception_type"] == "SnapshotIntegrityError"
    assert data_file.name in words["detail"]


def test_config_with_unknown_key_exits_config_error(snapshot_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg", snapshot_dir, learning_rat=0.1)
    result = run_trainer(config, tmp_path / "store", "cfg")
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stderr
    words = last_words(tmp_path / "store", "cfg", 1)
    assert words["exception_type"] == "ConfigError"
    assert str(config) in words["detail"] and "learning_rat" in words["detail"]


# -- storage faults -------------------------------------------------------------------------------


def _assert_storage_fault_receipt(store: Path, run_id: str, result: Finished, step: int) -> None:
    """Exit INFRA_TRANSIENT; last words name the file and ENOSPC; the previous checkpoint holds."""
    assert result.returncode == exit_codes.INFRA_TRANSIENT, result.stderr
    words = last_words(store, run_id, 1)
    assert words["reason"] == TerminationReason.INFRA_TRANSIENT
    assert words["errno"] == errno.ENOSPC and words["exception_type"] == "OSError"
    half_written = store / run_id / f"step-{step:010d}-a01"
    assert str(half_written) in words["detail"] and "No space left on device" in words["detail"]
    assert f"checkpoint of step {step}" in words["detail"]
    assert not half_written.exists(), "the half-written directory is removed, never committed"
    previous = step - CONFIG["checkpoint_every_steps"]
    info = verify_checkpoint(store / run_id / f"step-{previous:010d}-a01")
    assert words["last_checkpoint"] == str(info.path.resolve())
    assert [c["step"] for c in result.committed()] == list(range(10, step, 10))


def test_enospc_during_a_background_write_keeps_previous_checkpoint_and_ends_infra_transient(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    result = run_trainer(config_path, store, "enospc", env={"TRACKS_FAULT_ENOSPC_AT_STEP": "30"})
    _assert_storage_fault_receipt(store.resolve(), "enospc", result, step=30)
    assert "optimizer.safetensors" in last_words(store, "enospc", 1)["detail"]
    # The next attempt resumes from step 20 as if nothing had happened.
    resumed = run_trainer(config_path, store, "enospc")
    assert resumed.returncode == 0, resumed.stderr
    assert min(resumed.losses()) == 21
    assert_bit_exact(reference, store, "enospc", result, resumed)


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mounts a tmpfs of a given size (needs root, or CAP_SYS_ADMIN); skips where not allowed."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        target = tmp_path / f"tmpfs-{len(mounted)}"
        target.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(target)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real small filesystem needs root to mount a tmpfs")
    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_enospc_on_a_full_filesystem_keeps_previous_checkpoint_and_ends_infra_transient(
    reference: Reference, config_path: Path, small_filesystem: Callable[[int], Path]
) -> None:
    # Room for two checkpoints and a half (tmpfs counts whole pages per file): the third fills it.
    page = 4096
    final = final_dir(reference.store, reference.run_id)
    files = [p.stat().st_size for p in final.iterdir()]
    checkpoint_pages = sum(-(-size // page) for size in files)
    store = small_filesystem(page * (2 * checkpoint_pages + checkpoint_pages // 2 + 2))
    result = run_trainer(config_path, store, "full")
    _assert_storage_fault_receipt(store.resolve(), "full", result, step=30)


# -- two attempts at once -------------------------------------------------------------------------


def _assert_single_lineage(
    ledger: Ledger, run_id: str, stale_attempt: int, newer_attempt: int
) -> None:
    """Ever-committed checkpoints form one chain; none of the stale attempt's after the takeover."""
    rows = [c for c in ledger.checkpoints(run_id) if c.committed_at is not None]
    assert rows, "nothing was committed"
    steps = [c.step for c in rows]
    assert steps == sorted(set(steps)), f"two checkpoints at one step: {steps}"
    assert rows[0].parent_path is None
    for parent, child in itertools.pairwise(rows):
        assert child.parent_path == parent.path, f"{child.path} branches off {child.parent_path}"
    taken_over = ledger.get_attempt(run_id, newer_attempt).started_at
    stale = [c for c in rows if c.attempt_no == stale_attempt and c.committed_at > taken_over]
    assert stale == [], "the stale attempt committed after the newer one took the token"


def test_stale_attempt_paused_mid_write_is_refused_and_the_run_keeps_one_lineage(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    store, url = tmp_path / "store", f"sqlite:///{tmp_path / 'ledger.db'}"
    writing = store / "two" / "step-0000000020-a01"
    stale = Trainer(config_path, store, "two", "--ledger-url", url,
                    env={"TRACKS_FAULT_SLEEP_BEFORE_COMMIT": "1@20"})  # fmt: skip
    stale.wait_until(lambda: (writing / MANIFEST_FILE).is_file())
    # A zombie: paused (GC, network partition) between its files and its commit.
    stale.process.send_signal(signal.SIGSTOP)
    try:
        newer = Trainer(config_path, store, "two", "--ledger-url", url)
        newer.wait_until(lambda: any(e["event"] == "attempt_started" for e in newer.events()))
    finally:
        stale.process.send_signal(signal.SIGCONT)
    stale_result, newer_result = stale.wait(), newer.wait()

    assert stale_result.returncode == exit_codes.FENCED, stale_result.stderr
    assert last_words(store, "two", 1)["exception_type"] == "StaleFencingTokenError"
    assert not (writing / COMMITTED_FILE).exists()
    assert [c["step"] for c in stale_result.committed()] == [10]
    assert newer_result.returncode == 0, newer_result.stderr
    started = next(e for e in newer_result.events if e["event"] == "attempt_started")
    assert started["attempt_no"] == 2 and started["resumed_from"].endswith("step-0000000010-a01")
    ledger = Ledger(url)
    _assert_single_lineage(ledger, "two", stale_attempt=1, newer_attempt=2)
    fenced = ledger.get_attempt("two", 1)
    assert fenced.termination_reason == TerminationReason.FENCED, fenced.termination_detail
    assert "attempt 2" in fenced.termination_detail
    # The newer attempt continued the stale one's step-10 checkpoint exactly.
    assert_bit_exact(reference, store, "two", stale_result, newer_result)


def test_two_attempts_started_together_one_is_fenced_and_the_run_keeps_one_lineage(
    reference: Reference, config_path: Path, tmp_path: Path
) -> None:
    store, url = tmp_path / "store", f"sqlite:///{tmp_path / 'ledger.db'}"
    Ledger.open(url)  # migrated once, so neither process races the other to create the schema
    slow = {"TRACKS_FAULT_SLEEP_AFTER_STEP": "2@5"}  # both are alive while the other begins
    first = Trainer(config_path, store, "pair", "--ledger-url", url, env=slow)
    second = Trainer(config_path, store, "pair", "--ledger-url", url, env=slow)
    results = [first.wait(), second.wait()]
    codes = sorted(r.returncode for r in results)
    assert codes == [exit_codes.SUCCEEDED, exit_codes.FENCED], [r.stderr for r in results]
    winner = next(r for r in results if r.returncode == exit_codes.SUCCEEDED)
    loser = next(r for r in results if r.returncode == exit_codes.FENCED)
    loser_attempt = next(e for e in loser.events if e["event"] == "attempt_started")["attempt_no"]
    winner_attempt = next(e for e in winner.events if e["event"] == "attempt_started")["attempt_no"]
    assert loser_attempt < winner_attempt  # the attempt that began last holds the token
    ledger = Ledger(url)
    _assert_single_lineage(
        ledger, "pair", stale_attempt=loser_attempt, newer_attempt=winner_attempt
    )
    assert_bit_exact(reference, store, "pair", winner)


# -- synchronous saving ---------------------------------------------------------------------------


def test_synchronous_saving_writes_the_same_checkpoints_bit_for_bit(
    reference: Reference, snapshot_dir: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "cfg", snapshot_dir, async_save=False)
    result = run_trainer(config, tmp_path / "store", "sync")
    assert result.returncode == 0, result.stderr
    assert [c["step"] for c in result.committed()] == [10, 20, 30, 40, 50, 60]
    assert result.losses() == reference.result.losses()
    assert (
        final_dir(tmp_path / "store", "sync") / MODEL_FILE
    ).read_bytes() == reference.final_model
