"""Async saving in-process: staging into reused buffers, one save in flight, errors surface.

Also the streaming safetensors files, and the two clean-ups that keep a run to one lineage:
reconciling with the ledger after taking the token, and removing dead attempts' leftovers.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from pipeline.checkpoint import (
    COMMITTED_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CheckpointInfo,
    TrainingState,
    checkpoint_dirs,
    load_checkpoint,
    verify_checkpoint,
)
from pipeline.checkpoint import manager as manager_module
from pipeline.checkpoint.tensorfile import parse_safetensors, safetensors_chunks
from pipeline.states import CheckpointState
from pipeline.trainer.data import TrainingData
from tests.checkpoint_support import (
    RUN_ID,
    begin_attempt,
    checkpoint_manager,
    ledger_run,
    resign,
    train_steps,
    training_data,
    training_state,
)


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def _model_bytes(path: Path) -> bytes:
    return (path / MODEL_FILE).read_bytes()


def _twin_run(tmp_path: Path, data: TrainingData, steps: int) -> Path:
    """The same trajectory saved synchronously at ``steps``: what an async save must equal."""
    twin = training_state(data)
    train_steps(twin, data, steps)
    return checkpoint_manager(tmp_path / "twin").save(twin, metrics={"eval_loss": 1.0}).path


def test_async_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path: Path) -> None:
    data = training_data()
    state = training_state(data)
    train_steps(state, data, 5)
    committed: list[CheckpointInfo] = []
    manager = checkpoint_manager(tmp_path)
    manager._on_commit = committed.append
    manager.save_async(state, metrics={"eval_loss": 1.0})
    train_steps(state, data, 7)  # the loop mutates the live state while the writer writes
    manager.wait()
    expected = train_steps(state, data, 4)
    (info,) = committed
    assert info.step == 5 and verify_checkpoint(info.path).step == 5
    # The resumed trajectory is the uninterrupted one …
    resumed = training_state(data, seed=42)
    checkpoint_manager(tmp_path, attempt=2).resume(resumed)
    assert resumed.step == 5
    train_steps(resumed, data, 7)
    assert train_steps(resumed, data, 4) == expected
    # … and the files are those a synchronous save at step 5 writes.
    twin = _twin_run(tmp_path, data, 5)
    assert _model_bytes(info.path) == _model_bytes(twin)
    assert (info.path / OPTIMIZER_FILE).read_bytes() == (twin / OPTIMIZER_FILE).read_bytes()


def test_staging_copies_into_the_same_file_images_every_save(tmp_path: Path) -> None:
    """A CPU model's two tensor files are staged into one image each, mapped by the first save
    and reused by every save after it; the files written are those images' bytes."""
    data = training_data()
    state = training_state(data)
    manager = checkpoint_manager(tmp_path)
    pointers = []
    for _ in range(3):
        train_steps(state, data, 2)
        manager.save_async(state)
        images = manager._buffers._images
        pointers.append(
            {name: {k: t.data_ptr() for k, t in im.tensors.items()} for name, im in images.items()}
        )
    manager.wait()
    assert pointers[0] == pointers[1] == pointers[2]
    assert set(pointers[0]) == {MODEL_FILE, OPTIMIZER_FILE}
    assert "head.1.weight" in pointers[0][MODEL_FILE]
    assert any(k.startswith("optimizer.") for k in pointers[0][OPTIMIZER_FILE])
    assert manager._buffers._buffers == {}  # no tensor staged outside its file's image
    live = {t.data_ptr() for t in state.model.state_dict().values()}
    staged = {ptr for file in pointers[0].values() for ptr in file.values()}
    assert live.isdisjoint(staged), "staged tensors must not alias live ones"
    newest = max(checkpoint_dirs(manager.run_dir), key=lambda path: path.name)
    for name, image in images.items():
        assert (newest / name).read_bytes() == bytes(image.data)


def test_next_save_waits_for_the_one_in_flight_before_reusing_its_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = training_data()
    state = training_state(data)
    manager = checkpoint_manager(tmp_path)
    release = threading.Event()
    in_flight = threading.Event()

    def held_before_commit(step: int) -> None:
        if step == 2:
            in_flight.set()
            assert release.wait(10)

    monkeypatch.setattr(manager_module, "_fault_sleep_before_commit", held_before_commit)
    train_steps(state, data, 2)
    manager.save_async(state)
    assert in_flight.wait(10) and manager.save_in_flight
    train_steps(state, data, 2)
    threading.Timer(0.3, release.set).start()
    began = time.monotonic()
    manager.save_async(state)  # must block until step 2 is committed
    assert time.monotonic() - began >= 0.25
    assert (manager.run_dir / "step-0000000002-a01" / COMMITTED_FILE).is_file()
    manager.wait()
    # Step 2's bytes are step 2's, although step 4 was staged into the same buffers after.
    assert _model_bytes(manager.run_dir / "step-0000000002-a01") == _model_bytes(
        _twin_run(tmp_path, data, 2)
    )
    assert [p.name for p in checkpoint_dirs(manager.run_dir)] == [
        "step-0000000004-a01",
        "step-0000000002-a01",
    ]


def test_commits_are_reported_on_the_training_thread_in_order(tmp_path: Path) -> None:
    data = training_data()
    state = training_state(data)
    seen: list[tuple[int, str]] = []
    manager = checkpoint_manager(tmp_path)
    manager._on_commit = lambda info: seen.append((info.step, threading.current_thread().name))
    for _ in range(3):
        train_steps(state, data, 3)
        manager.save_async(state)
    train_steps(state, data, 3)
    manager.save(state)  # synchronous: waits for the one in flight, then commits its own
    main = threading.current_thread().name
    assert seen == [(3, main), (6, main), (9, main), (12, main)]
    assert not manager.save_in_flight


def test_writer_error_is_raised_on_the_training_thread_and_the_previous_checkpoint_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = training_data()
    state = training_state(data)
    manager = checkpoint_manager(tmp_path)
    train_steps(state, data, 4)
    previous = manager.save(state).path
    monkeypatch.setenv("TRACKS_FAULT_ENOSPC_AT_STEP", "8")
    events: list[tuple[str, dict]] = []
    manager._on_event = lambda name, fields: events.append((name, fields))
    train_steps(state, data, 4)
    manager.save_async(state)
    manager._writer.join()  # type: ignore[union-attr]
    assert events == [], "nothing is told from the writer thread"
    with pytest.raises(OSError) as caught:
        manager.poll()
    assert caught.value.errno == errno.ENOSPC
    failed = manager.run_dir / "step-0000000008-a01"
    assert caught.value.filename == str(failed / OPTIMIZER_FILE)
    assert "checkpoint of step 8" in str(caught.value)
    assert not failed.exists()
    assert [name for name, _ in events] == ["checkpoint_abandoned"]
    assert verify_checkpoint(previous).step == 4
    manager.poll()  # raised once, then cleared
    resumed = training_state(data, seed=1)
    assert checkpoint_manager(tmp_path, attempt=2).resume(resumed).path == previous  # type: ignore[union-attr]


def test_synchronous_save_raises_the_error_of_the_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = training_data()
    state = training_state(data)
    manager = checkpoint_manager(tmp_path)
    monkeypatch.setenv("TRACKS_FAULT_ENOSPC_AT_STEP", "2")
    train_steps(state, data, 2)
    manager.save_async(state)
    train_steps(state, data, 2)
    with pytest.raises(OSError, match="No space left on device"):
        manager.save(state)
    assert checkpoint_dirs(manager.run_dir) == []


def test_sync_and_async_saves_write_identical_bytes(tmp_path: Path) -> None:
    data = training_data()
    one = training_state(data)  # seeds the global RNG (dropout): build and train one run at a time
    train_steps(one, data, 3)
    sync = checkpoint_manager(tmp_path / "sync").save(one, metrics={"eval_loss": 0.5}).path
    two = training_state(data)
    train_steps(two, data, 3)
    manager = checkpoint_manager(tmp_path / "async")
    manager.save_async(two, metrics={"eval_loss": 0.5})
    manager.wait()
    (asynchronous,) = checkpoint_dirs(manager.run_dir)
    for name in (MODEL_FILE, OPTIMIZER_FILE, "probe.safetensors"):
        assert (sync / name).read_bytes() == (asynchronous / name).read_bytes(), name
    # Hashed on every core and on one: the same digests.
    digests = [
        {f["name"]: f["digest"] for f in json.loads((path / MANIFEST_FILE).read_text())["files"]}
        for path in (sync, asynchronous)
    ]
    assert digests[0] == digests[1]


def test_a_synchronous_save_writes_the_live_tensors_and_hashes_on_every_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save the training loop waits for copies nothing and may use every core; a save in
    the background hashes on the cores the training loop's threads leave (at least one), and
    resume on every core."""
    from pipeline.checkpoint import verify as verify_module
    from pipeline.checkpoint import writer as writer_module

    threads: list[tuple[str, int]] = []

    def counted(module: Any) -> Callable[..., Any]:
        real, where = module.new_hasher, module.__name__.rsplit(".", 1)[1]

        def new_hasher(algorithm: Any, *, threads_: int = 1) -> Any:
            threads.append((where, threads_))
            return real(algorithm, threads=threads_)

        return lambda algorithm, *, threads=1: new_hasher(algorithm, threads_=threads)

    for module in (writer_module, verify_module):
        monkeypatch.setattr(module, "new_hasher", counted(module))
    monkeypatch.setattr(manager_module, "usable_cores", lambda: 3)
    intra_op_threads = [1]
    monkeypatch.setattr(torch, "get_num_threads", lambda: intra_op_threads[0])
    data = training_data()
    state = training_state(data)
    train_steps(state, data, 3)
    manager = checkpoint_manager(tmp_path)
    manager.save(state)
    assert manager._buffers.nbytes == 0  # nothing staged: the live tensors were written
    assert {n for where, n in threads if where == "writer"} == {3}
    threads.clear()
    train_steps(state, data, 1)
    manager.save_async(state)
    manager.wait()
    assert manager._buffers.nbytes > 0
    assert {n for where, n in threads if where == "writer"} == {2}  # 3 cores, 1 trains
    threads.clear()
    intra_op_threads[0] = 3  # a loop that takes every core still leaves the writer one
    train_steps(state, data, 1)
    manager.save_async(state)
    manager.wait()
    assert {n for where, n in threads if where == "writer"} == {1}
    threads.clear()
    checkpoint_manager(tmp_path, attempt=2).resume(training_state(data, seed=5))
    # The tensor files on every core (a small JSON file read on its own may use one).
    assert [n for where, n in threads if where == "verify"].count(3) >= 2


# -- tensor files -------------------------------------------------------------------------------


TENSORS = {
    "f32": torch.randn(3, 5),
    "f64": torch.randn(2, dtype=torch.float64),
    "bf16": torch.randn(7, dtype=torch.bfloat16),
    "i64": torch.arange(5),
    "u8": torch.arange(3, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


def test_streamed_tensor_files_are_safetensors_and_parse_back_as_views() -> None:
    raw = b"".join(bytes(c) for c in safetensors_chunks(TENSORS, {"format": "pt"}))
    loaded = safetensors_load(raw)
    buffer = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    parsed, metadata = parse_safetensors(buffer)
    assert metadata == {"format": "pt"}
    for name, tensor in TENSORS.items():
        for got in (loaded[name], parsed[name]):
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    assert parsed["f32"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # Files written by safetensors itself (older checkpoints) parse too.
    foreign, _ = parse_safetensors(
        torch.frombuffer(bytearray(safetensors_save(TENSORS)), dtype=torch.uint8)
    )
    assert all(torch.equal(foreign[n], t) for n, t in TENSORS.items())


def test_tensor_file_whose_header_lies_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    data = training_data()
    state = training_state(data)
    train_steps(state, data, 1)
    path = checkpoint_manager(tmp_path).save(state).path
    # Rewrite model.safetensors with offsets past the end, and re-vouch for it in the manifest:
    # the bytes match their hashes but do not parse.
    model = path / MODEL_FILE
    raw = model.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] += 4096
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    model.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + header_len :])
    resign(path, MODEL_FILE)
    verify_checkpoint(path)  # the bytes are what the manifest says …
    with pytest.raises(Exception, match=r"model\.safetensors: does not load: .*offsets"):
        load_checkpoint(path)  # … but they are not a tensor file


# -- one lineage --------------------------------------------------------------------------------


def _committed_without_marker(tmp_path: Path, state: TrainingState, data: TrainingData) -> Path:
    """What a stale attempt leaves when stopped between its ledger commit and COMMITTED."""
    book = ledger_run(tmp_path)
    manager = checkpoint_manager(
        tmp_path, ledger=book.ledger, attempt=book.attempt_no, token=book.token
    )
    train_steps(state, data, 4)
    manager.save(state)
    train_steps(state, data, 4)
    newest = manager.save(state).path
    (newest / COMMITTED_FILE).unlink()
    return newest


def test_ledger_commit_without_committed_marker_is_marked_corrupt_after_taking_the_token(
    tmp_path: Path,
) -> None:
    data = training_data()
    newest = _committed_without_marker(tmp_path, training_state(data), data)
    from pipeline.ledger import Ledger

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    resumed_state = training_state(data, seed=3)
    manager = checkpoint_manager(tmp_path, ledger=ledger, attempt=2)
    resumed = manager.resume(resumed_state)
    assert resumed is not None and resumed.step == 4
    attempt_no, token = begin_attempt(ledger)
    manager.bind_attempt(attempt_no, token)
    assert manager.reconcile_with_ledger(resumed_state, resumed) == resumed
    record = ledger.get_checkpoint(str(newest))
    assert record.state == CheckpointState.CORRUPT and COMMITTED_FILE in (record.state_detail or "")
    latest = ledger.latest_committed_checkpoint(RUN_ID)
    assert latest is not None and latest.step == 4


def test_commit_renamed_after_resume_looked_is_picked_up_after_taking_the_token(
    tmp_path: Path,
) -> None:
    data = training_data()
    newest = _committed_without_marker(tmp_path, training_state(data), data)
    from pipeline.ledger import Ledger

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    resumed_state = training_state(data, seed=3)
    manager = checkpoint_manager(tmp_path, ledger=ledger, attempt=2)
    resumed = manager.resume(resumed_state)
    assert resumed is not None and resumed.step == 4
    # The stale attempt wakes and renames COMMITTED into place before we take the token.
    (newest / COMMITTED_FILE).write_text(
        json.dumps({**json.loads(json.dumps(_commit_payload(newest)))})
    )
    attempt_no, token = begin_attempt(ledger)
    manager.bind_attempt(attempt_no, token)
    again = manager.reconcile_with_ledger(resumed_state, resumed)
    assert again is not None and again.step == 8 and resumed_state.step == 8


def _commit_payload(directory: Path) -> dict:
    from pipeline.digests import sha256_bytes

    manifest = json.loads((directory / MANIFEST_FILE).read_bytes())
    return {
        "manifest_sha256": sha256_bytes((directory / MANIFEST_FILE).read_bytes()),
        "run_id": manifest["run_id"],
        "attempt_no": manifest["attempt_no"],
        "step": manifest["step"],
        "fencing_token": 1,
    }


def test_retention_removes_dead_attempts_half_written_dirs_but_not_newer_ones(
    tmp_path: Path,
) -> None:
    data = training_data()
    state = training_state(data)
    run_dir = tmp_path / "store" / RUN_ID
    leftovers = {
        name: run_dir / name
        for name in (
            "step-0000000002-a01",  # a dead attempt's write, older than the newest commit
            "step-0000000009-a01",  # … newer than the newest commit: left alone
            "step-0000000004-a03",  # a newer attempt's write in progress: never touched
        )
    }
    for directory in leftovers.values():
        directory.mkdir(parents=True)
        (directory / MODEL_FILE).write_bytes(b"half")
    manager = checkpoint_manager(tmp_path, attempt=2)
    train_steps(state, data, 6)
    manager.save(state)
    assert not leftovers["step-0000000002-a01"].exists()
    assert leftovers["step-0000000009-a01"].exists()
    assert leftovers["step-0000000004-a03"].exists()


# -- the probe batch off the training thread -------------------------------------------------------


def test_probe_runs_on_the_staged_weights_in_the_writer_and_matches_the_live_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.checkpoint import state as state_module
    from pipeline.checkpoint.state import ProbeSkeleton

    data = training_data()
    state = training_state(data)
    manager = checkpoint_manager(tmp_path)
    train_steps(state, data, 2)
    manager.save_async(state)  # the first: probe on the training thread, skeleton checked
    manager.wait()
    assert isinstance(manager._skeleton, ProbeSkeleton)
    live_probes: list[str] = []
    real = state_module.probe_logits
    monkeypatch.setattr(
        state_module,
        "probe_logits",
        lambda *a: (live_probes.append(threading.current_thread().name), real(*a))[1],
    )
    train_steps(state, data, 3)
    manager.save_async(state)
    manager.wait()
    assert live_probes == [], "the staging stall no longer runs the probe batch"
    monkeypatch.setattr(state_module, "probe_logits", real)
    (newest, _) = checkpoint_dirs(manager.run_dir)
    twin = _twin_run(tmp_path, data, 5)
    assert (newest / "probe.safetensors").read_bytes() == (twin / "probe.safetensors").read_bytes()
    resumed = training_state(data, seed=9)
    assert checkpoint_manager(tmp_path, attempt=2).resume(resumed).path == newest  # type: ignore[union-attr]


def test_model_with_non_persistent_buffers_keeps_the_probe_on_the_training_thread(
    tmp_path: Path,
) -> None:
    data = training_data()
    state = training_state(data)
    state.model.register_buffer("scale", torch.ones(1), persistent=False)
    manager = checkpoint_manager(tmp_path)
    train_steps(state, data, 1)
    manager.save_async(state)
    manager.wait()
    assert manager._skeleton is False
    train_steps(state, data, 1)
    manager.save_async(state)
    manager.wait()
    assert verify_checkpoint(checkpoint_dirs(manager.run_dir)[0]).step == 2


def _slow_background_copy(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[str]:
    """Delay the copy of parameters and optimizer state; returns the threads that ran it."""
    from pipeline.checkpoint.state import CapturedCheckpoint

    real = CapturedCheckpoint.enqueue
    threads: list[str] = []

    def slow(self: CapturedCheckpoint) -> object:
        if self.pending:
            threads.append(threading.current_thread().name)
            time.sleep(seconds)
        return real(self)

    monkeypatch.setattr(CapturedCheckpoint, "enqueue", slow)
    return threads


def test_optimizer_step_waits_for_the_background_copy_of_parameters_and_optimizer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = training_data()
    state = training_state(data)
    manager = checkpoint_manager(tmp_path)
    train_steps(state, data, 2)
    manager.save_async(state)  # the first save stages everything on the training thread
    manager.wait()
    threads = _slow_background_copy(monkeypatch, 0.5)
    train_steps(state, data, 3)
    manager.save_async(state, metrics={"eval_loss": 1.0})
    assert manager.last_stall is not None and manager.last_stall.capture < 0.4
    train_steps(state, data, 4)  # optimizer.step() must hold until the copy of step 5 is done
    manager.wait()
    assert threads and all(name.startswith("checkpoint-writer") for name in threads)
    assert manager.last_stall.step == 5 and manager.last_stall.staging_wait >= 0.3
    (newest, _) = checkpoint_dirs(manager.run_dir)
    twin = _twin_run(tmp_path, data, 5)
    assert _model_bytes(newest) == _model_bytes(twin)
    assert (newest / OPTIMIZER_FILE).read_bytes() == (twin / OPTIMIZER_FILE).read_bytes()


def test_buffers_that_forward_changes_are_captured_when_the_save_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(
        model=model,
        optimizer=optimizer,
        data_cursor=_Cursor(),
        config={},
        config_sha256="d" * 64,
        probe_inputs=torch.randn(3, 4),
    )
    manager = checkpoint_manager(tmp_path)
    manager.save_async(state)
    manager.wait()
    _slow_background_copy(monkeypatch, 0.3)
    state.step = 1
    manager.save_async(state)
    running_mean = model[1].running_mean.clone()
    weight = model[0].weight.detach().clone()
    model(torch.randn(16, 4)).sum().backward()  # forward moves BatchNorm's running stats
    optimizer.step()
    manager.wait()
    assert not torch.equal(model[1].running_mean, running_mean)
    saved = load_checkpoint(checkpoint_dirs(manager.run_dir)[0]).model
    assert torch.equal(saved["1.running_mean"], running_mean)
    assert torch.equal(saved["0.weight"], weight)


class _Cursor:
    def state_dict(self) -> dict[str, int]:
        return {"position": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass
