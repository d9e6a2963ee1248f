"""The checkpoint protocol in-process: write order, verification, no pickle, resume, retention."""

from __future__ import annotations

import errno
import json
import math
import shutil
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import blake3
import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from pipeline.checkpoint import (
    COMMITTED_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    TRAINER_STATE_FILE,
    CorruptCheckpointError,
    RestoreDivergedError,
    UnsafeCheckpointError,
    checkpoint_dirs,
    refuse_pickle,
    verify_checkpoint,
)
from pipeline.checkpoint import load as checkpoint_load
from pipeline.checkpoint import manager as manager_module
from pipeline.checkpoint import writer as checkpoint_writer
from pipeline.checkpoint.codec import StateEncodingError, decode_state, encode_state
from pipeline.checkpoint.layout import TENSOR_FILE_METADATA
from pipeline.checkpoint.state import live_tensors
from pipeline.checkpoint.tensorfile import FileImage, safetensors_chunks
from pipeline.checkpoint.verify import ListedFile
from pipeline.digests import sha256_bytes
from pipeline.ledger import EvaluationRecord, StaleFencingTokenError
from pipeline.states import CheckpointState
from pipeline.trainer.model import build_model
from tests.checkpoint_support import RUN_ID, recommit_in_ledger, resign
from tests.checkpoint_support import begin_attempt as _begin
from tests.checkpoint_support import checkpoint_manager as _manager
from tests.checkpoint_support import ledger_run as _ledger_run
from tests.checkpoint_support import save_at as _save_at
from tests.checkpoint_support import train_steps as _steps
from tests.checkpoint_support import training_data as _data
from tests.checkpoint_support import training_state as _state


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


# -- codec ------------------------------------------------------------------------------------


def test_codec_round_trips_tuples_int_keys_bytes_and_non_finite_floats() -> None:
    state = {
        "state": {0: {"step": torch.tensor(3.0), "buf": torch.arange(4.0)}, 1: {"m": None}},
        "param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "params": [0, 1]}],
        "odd": [math.inf, -math.inf, b"\x00\xff", "text", True],
    }
    encoded, tensors = encode_state(state, "optimizer")
    json.dumps(encoded)  # plain JSON, nothing else
    assert set(tensors) == {"optimizer.state.0.step", "optimizer.state.0.buf"}
    decoded = decode_state(json.loads(json.dumps(encoded)), tensors)
    assert decoded["param_groups"][0]["betas"] == (0.9, 0.999)
    assert set(decoded["state"]) == {0, 1}
    assert torch.equal(decoded["state"][0]["buf"], torch.arange(4.0))
    assert decoded["odd"] == [math.inf, -math.inf, b"\x00\xff", "text", True]


def test_codec_refuses_values_it_would_have_to_pickle() -> None:
    with pytest.raises(StateEncodingError, match=r"lr_scheduler\.fn"):
        encode_state({"fn": object()}, "lr_scheduler")


# -- save and restore -----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_restore_in_a_fresh_state_continues_bit_exact(tmp_path: Path, optimizer: str) -> None:
    data = _data()
    original = _state(data, optimizer=optimizer)
    _steps(original, data, 9)  # crosses an epoch boundary (6 batches per epoch)
    manager = _manager(tmp_path)
    manager.save(original, metrics={"eval_loss": 1.0})
    expected = _steps(original, data, 8)

    # Different init seed: everything must come from the checkpoint, RNG included (dropout).
    resumed = _state(data, seed=99, optimizer=optimizer)
    info = _manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.step == 9 and resumed.step == 9
    assert _steps(resumed, data, 8) == expected
    for key, value in original.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key


def test_checkpoint_is_safetensors_and_json_and_evaluators_can_rebuild_the_model(
    tmp_path: Path,
) -> None:
    data = _data()
    state = _state(data)
    _steps(state, data, 3)
    path = _manager(tmp_path).save(state).path
    refuse_pickle(path)
    trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text())
    assert trainer_state["step"] == 3 and trainer_state["config_sha256"] == "c" * 64
    assert {"optimizer", "lr_scheduler", "rng", "data_cursor"} <= set(trainer_state)
    # What the evaluation code does: config.model + model.safetensors → build_model.
    model = build_model(trainer_state["config"]["model"])
    model.load_state_dict(load_file(path / MODEL_FILE))
    model.eval()
    probe = load_file(path / PROBE_FILE)
    with torch.no_grad():
        assert torch.equal(model(probe["inputs"]), probe["logits"])
    info = verify_checkpoint(path)
    assert info.step == 3 and info.attempt_no == 1 and info.run_id == RUN_ID
    assert {f.name for f in path.iterdir()} == {*info.files, MANIFEST_FILE, COMMITTED_FILE}


def test_committed_is_written_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    durable, atomic = checkpoint_writer.write_file_durably, checkpoint_writer.replace_atomically
    chunks = checkpoint_writer.write_chunks_durably
    monkeypatch.setattr(
        checkpoint_writer, "write_file_durably", lambda p, d: (order.append(p.name), durable(p, d))
    )
    monkeypatch.setattr(
        checkpoint_writer,
        "write_chunks_durably",
        lambda p, c, **kw: (order.append(p.name), chunks(p, c, **kw))[1],
    )
    monkeypatch.setattr(
        checkpoint_writer, "replace_atomically", lambda p, d: (order.append(p.name), atomic(p, d))
    )
    data = _data()
    state = _state(data)
    _steps(state, data, 1)
    _manager(tmp_path).save(state)
    assert order[-2:] == [MANIFEST_FILE, COMMITTED_FILE]
    assert len(order) == 6


def test_directory_without_committed_is_ignored_on_resume(tmp_path: Path) -> None:
    data = _data()
    state = _state(data)
    manager = _manager(tmp_path)
    first, second = _save_at(manager, state, data, [10, 20])
    (second / COMMITTED_FILE).unlink()  # as if killed between MANIFEST.json and COMMITTED
    assert checkpoint_dirs(manager.run_dir) == [first]
    resumed = _state(data, seed=5)
    info = _manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.path == first and resumed.step == 10


# -- verification -------------------------------------------------------------------------------


def _flip_byte(path: Path) -> str:
    target = path / MODEL_FILE
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    return MODEL_FILE


def _truncate(path: Path) -> str:
    target = path / "optimizer.safetensors"
    target.write_bytes(target.read_bytes()[:-100])
    return "optimizer.safetensors"


def _drop_manifest(path: Path) -> str:
    (path / MANIFEST_FILE).unlink()
    return MANIFEST_FILE


def _point_committed_elsewhere(path: Path) -> str:
    committed = json.loads((path / COMMITTED_FILE).read_text())
    committed["manifest_sha256"] = sha256_bytes(b"another manifest")
    (path / COMMITTED_FILE).write_text(json.dumps(committed))
    return MANIFEST_FILE


def _extra_file(path: Path) -> str:
    (path / "notes.txt").write_text("not in the manifest")
    return "notes.txt"


def _missing_file(path: Path) -> str:
    (path / TRAINER_STATE_FILE).unlink()
    return TRAINER_STATE_FILE


CORRUPTIONS = {
    "flipped_byte": _flip_byte,
    "truncated_file": _truncate,
    "missing_manifest": _drop_manifest,
    "committed_points_at_another_manifest": _point_committed_elsewhere,
    "unlisted_extra_file": _extra_file,
    "missing_file": _missing_file,
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_verify_names_directory_file_and_difference(tmp_path: Path, corruption: str) -> None:
    data = _data()
    state = _state(data)
    _steps(state, data, 2)
    path = _manager(tmp_path).save(state).path
    file = CORRUPTIONS[corruption](path)
    with pytest.raises(CorruptCheckpointError) as caught:
        verify_checkpoint(path)
    assert caught.value.file == file
    assert str(path) in str(caught.value) and file in str(caught.value)


@pytest.mark.parametrize("kind", ["torch_save_pt", "pickle_magic_in_innocent_name"])
def test_pickle_in_checkpoint_directory_is_refused(tmp_path: Path, kind: str) -> None:
    data = _data()
    state = _state(data)
    manager = _manager(tmp_path)
    previous, newest = _save_at(manager, state, data, [10, 20])
    if kind == "torch_save_pt":
        name = "extra_state.pt"
        torch.save({"x": 1}, newest / name)
    else:
        import pickle

        name = "notes.json"
        (newest / name).write_bytes(pickle.dumps({"x": 1}, protocol=4))
    with pytest.raises(UnsafeCheckpointError) as caught:
        verify_checkpoint(newest)
    assert caught.value.file == name and name in str(caught.value)
    info = _manager(tmp_path, attempt=2).resume(_state(data, seed=3))
    assert info is not None and info.path == previous


def test_safetensors_header_length_that_looks_like_pickle_magic_is_not_refused(
    tmp_path: Path,
) -> None:
    # The header length is the first 8 bytes: 640 = 80 02 00 …, pickle protocol 2's magic.
    for pad in range(700):
        raw = safetensors_bytes({"w": torch.zeros(3)}, metadata={"pad": "x" * pad})
        if int.from_bytes(raw[:8], "little") == 0x0280:
            break
    assert raw[:2] == b"\x80\x02"
    (tmp_path / MODEL_FILE).write_bytes(raw)
    refuse_pickle(tmp_path)
    (tmp_path / "state.json").write_bytes(b"\x80\x04\x95" + b"\x00" * 20)
    with pytest.raises(UnsafeCheckpointError, match=r"state\.json"):
        refuse_pickle(tmp_path)


# -- resume with a ledger ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "corruption",
    ["flipped_byte", "truncated_file", "missing_manifest", "committed_points_at_another_manifest"],
)
def test_corrupt_newest_is_marked_in_ledger_and_previous_is_used(
    tmp_path: Path, corruption: str
) -> None:
    book = _ledger_run(tmp_path)
    data = _data()
    state = _state(data)
    manager = _manager(tmp_path, ledger=book.ledger, attempt=book.attempt_no, token=book.token)
    paths = _save_at(manager, state, data, [10, 20, 30])
    file = CORRUPTIONS[corruption](paths[-1])

    attempt_no, token = _begin(book.ledger)
    resumed = _state(data, seed=8)
    resumer = _manager(tmp_path, ledger=book.ledger, attempt=attempt_no, token=token)
    info = resumer.resume(resumed)
    assert info is not None and info.path == paths[1] and resumed.step == 20
    record = book.ledger.get_checkpoint(str(paths[-1]))
    assert record.state == CheckpointState.CORRUPT
    assert file in (record.state_detail or "")
    # Marked once, never a candidate again.
    assert paths[-1] not in resumer.committed_dirs()


def test_probe_mismatch_after_restore_is_corrupt_and_previous_is_used(tmp_path: Path) -> None:
    book = _ledger_run(tmp_path)
    data = _data()
    state = _state(data)
    manager = _manager(tmp_path, ledger=book.ledger, attempt=book.attempt_no, token=book.token)
    previous, newest = _save_at(manager, state, data, [10, 20])
    # Re-sign the checkpoint after changing the saved logits: bytes verify, the probe must not.
    probe = load_file(newest / PROBE_FILE)
    probe["logits"] = probe["logits"] + 1e-3
    raw = safetensors_bytes(probe, metadata={"format": "pt", "device": "cpu"})
    (newest / PROBE_FILE).write_bytes(raw)
    resign(newest, PROBE_FILE)
    recommit_in_ledger(book.ledger, newest, book.token)  # else the ledger refuses it first
    verify_checkpoint(newest)

    resumed = _state(data, seed=4)
    info = _manager(tmp_path, ledger=book.ledger, attempt=2, token=book.token).resume(resumed)
    assert info is not None and info.path == previous
    record = book.ledger.get_checkpoint(str(newest))
    assert record.state == CheckpointState.CORRUPT
    assert f"{PROBE_FILE}: post-restore probe logits differ" in (record.state_detail or "")
    # The failed candidate's weights did not leak into the state: it equals a clean restore.
    clean = _state(data, seed=6)
    _manager(tmp_path, ledger=book.ledger, attempt=2, token=book.token).resume(clean)
    for key, value in clean.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key])


def test_checkpoint_of_another_config_is_skipped_not_resumed(tmp_path: Path) -> None:
    # A run retried under a new config (e.g. a smaller batch after an OOM) must not continue
    # a trajectory written under the old one: those checkpoints are passed over, with a word.
    data = _data()
    state = _state(data)
    (older,) = _save_at(_manager(tmp_path), state, data, [10])
    newer_config = _manager(tmp_path, attempt=2)
    state.config_sha256 = "d" * 64
    _save_at(newer_config, state, data, [20])
    events: list[tuple[str, dict]] = []
    other = _state(data)
    other.config_sha256 = "e" * 64
    manager = _manager(tmp_path, attempt=3)
    manager._on_event = lambda name, fields: events.append((name, fields))
    assert manager.resume(other) is None and other.step == 0
    assert [name for name, _ in events] == ["checkpoint_skipped", "checkpoint_skipped"]
    original = _state(data)  # config "c" * 64: the step-10 checkpoint is its own
    info = _manager(tmp_path, attempt=4).resume(original)
    assert info is not None and info.path == older


def test_stale_fencing_token_commit_is_refused_and_leaves_no_committed(tmp_path: Path) -> None:
    book = _ledger_run(tmp_path)
    data = _data()
    state = _state(data)
    manager = _manager(tmp_path, ledger=book.ledger, attempt=book.attempt_no, token=book.token)
    _save_at(manager, state, data, [10])
    ledger = book.ledger
    commit = ledger.commit_checkpoint

    def newer_attempt_begins_first(**kwargs: object) -> object:
        _begin(ledger)  # a second worker takes the run while we were writing files
        return commit(**kwargs)  # type: ignore[arg-type]

    ledger.commit_checkpoint = newer_attempt_begins_first  # type: ignore[method-assign]
    _steps(state, data, 10)
    with pytest.raises(StaleFencingTokenError):
        manager.save(state)
    stale_dir = manager.run_dir / "step-0000000020-a01"
    assert (stale_dir / MANIFEST_FILE).is_file()
    assert not (stale_dir / COMMITTED_FILE).exists()
    assert ledger.get_checkpoint(str(stale_dir)).state == CheckpointState.WRITING
    assert [p.name for p in checkpoint_dirs(manager.run_dir)] == ["step-0000000010-a01"]
    # And the stale attempt cannot even start another checkpoint.
    with pytest.raises(StaleFencingTokenError):
        manager.save(state)


# -- retention ----------------------------------------------------------------------------------


def test_retention_keeps_last_k_best_k_referenced_and_newest(tmp_path: Path) -> None:
    book = _ledger_run(tmp_path)
    data = _data()
    state = _state(data)
    manager = _manager(
        tmp_path, ledger=book.ledger, attempt=book.attempt_no, token=book.token,
        keep_last_k=2, keep_best_k=1, best_metric="eval_loss", best_mode="min",
    )  # fmt: skip
    losses = {10: 0.9, 20: 0.1, 30: 0.8, 40: 0.7, 50: 0.6, 60: 0.5}
    paths = {step: _save_at(manager, state, data, [step], losses)[0] for step in (10, 20, 30)}
    book.ledger.record_evaluation(
        EvaluationRecord(
            evaluation_id="eval-1", run_id=RUN_ID, attempt_no=1, checkpoint_path=str(paths[30]),
            checkpoint_manifest_sha256="e" * 64, evaluator_name="accuracy",
            evaluator_version="1", evaluator_env_digest="env", task_set_version="t",
            decoding_params={}, judge_model="n/a", rubric_version="n/a", status="complete",
            started_at=datetime.now(UTC),
        )
    )  # fmt: skip
    for step in (40, 50, 60):
        paths[step] = _save_at(manager, state, data, [step], losses)[0]
    kept = {p.name for p in checkpoint_dirs(manager.run_dir)}
    assert kept == {paths[s].name for s in (20, 30, 50, 60)}
    for step in (10, 40):
        assert not paths[step].exists()
        assert book.ledger.get_checkpoint(str(paths[step])).state == CheckpointState.SUPERSEDED
    for step in (20, 30, 50, 60):
        assert book.ledger.get_checkpoint(str(paths[step])).state == CheckpointState.COMMITTED


def test_retention_never_deletes_the_newest_committed(tmp_path: Path) -> None:
    data = _data()
    state = _state(data)
    manager = _manager(
        tmp_path, keep_last_k=1, keep_best_k=1, best_metric="eval_loss", best_mode="min"
    )
    paths = _save_at(manager, state, data, [10, 20, 30], {10: 0.1, 20: 0.5, 30: 0.9})
    assert [p.name for p in checkpoint_dirs(manager.run_dir)] == [paths[2].name, paths[0].name]
    assert not paths[1].exists()


# -- digests --------------------------------------------------------------------------------------

# Written by the code before BLAKE3 (manifest entries carry only "sha256"): _steps(_state(), 9).
LEGACY_SHA256_CHECKPOINT = Path(__file__).parent / "fixtures" / "checkpoint-sha256"


def test_new_manifests_name_blake3_beside_each_digest(tmp_path: Path) -> None:
    data = _data()
    state = _state(data)
    _steps(state, data, 2)
    path = _manager(tmp_path).save(state).path
    entries = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert {e["algorithm"] for e in entries} == {"blake3"}
    for entry in entries:
        assert entry["digest"] == blake3.blake3((path / entry["name"]).read_bytes()).hexdigest()


def test_a_sha256_checkpoint_from_before_blake3_restores_bit_exact(tmp_path: Path) -> None:
    store = tmp_path / "store" / RUN_ID
    shutil.copytree(LEGACY_SHA256_CHECKPOINT, store)
    (legacy,) = store.iterdir()
    entries = json.loads((legacy / MANIFEST_FILE).read_text())["files"]
    assert all("sha256" in e and "algorithm" not in e for e in entries)
    data = _data()
    resumed = _state(data, seed=99)
    info = _manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.step == 9 and info.path == legacy
    # Bit-exact restore: the live weights are the bytes the old code wrote. (The fixture was
    # written on another CPU, so its trajectory is not compared with one trained here:
    # AVX2 and AVX512 kernels differ in the last bit.)
    saved = safetensors.torch.load_file(str(legacy / "model.safetensors"))
    live = resumed.model.state_dict()
    assert saved.keys() == live.keys()
    assert all(torch.equal(saved[name], live[name]) for name in saved)
    # And training goes on from there deterministically: two restores, the same 8 steps
    # (one after the other: a restore sets the process's global RNG).
    first = _steps(resumed, data, 8)
    again = _state(data, seed=7)
    _manager(tmp_path, attempt=3).resume(again)
    assert _steps(again, data, 8) == first
    # A changed byte is still caught by the digest the old manifest recorded.
    _flip_byte(legacy)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*sha256 is"):
        verify_checkpoint(legacy)


def test_a_manifest_naming_an_unknown_digest_algorithm_is_corrupt(tmp_path: Path) -> None:
    data = _data()
    state = _state(data)
    _steps(state, data, 2)
    path = _manager(tmp_path).save(state).path
    resign(path, edit=lambda manifest: manifest["files"][0].update(algorithm="md5"))
    with pytest.raises(CorruptCheckpointError, match="unknown digest algorithm 'md5'") as caught:
        verify_checkpoint(path)
    assert caught.value.file == MANIFEST_FILE


def test_resume_keeps_no_copy_of_the_live_state_when_the_weights_pass_their_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _data()
    original = _state(data)
    _steps(original, data, 9)
    _manager(tmp_path).save(original, metrics={"eval_loss": 1.0})
    expected = _steps(original, data, 4)

    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("resume copied the live state although the probe already matched")

    monkeypatch.setattr(manager_module, "stage_checkpoint", no_copy)
    resumed = _state(data, seed=99)
    info = _manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.step == 9
    assert _steps(resumed, data, 4) == expected


def _image(tensors: dict[str, torch.Tensor]) -> FileImage:
    """A file image of ``tensors``, filled as staging fills it."""
    image = FileImage(tensors, TENSOR_FILE_METADATA)
    for name, tensor in tensors.items():
        image.tensors[name].copy_(tensor)
    return image


@pytest.mark.parametrize("image", [False, True], ids=["gathered", "image"])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_large_files_are_written_byte_for_byte_and_the_fault_hook_sees_half(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, image: bool
) -> None:
    """Large files are written with O_DIRECT: a staged file image as it lies, or chunks of odd
    sizes gathered into aligned bounce buffers. Either way they end up byte for byte in the
    file (the padded last block truncated away), and the halfway hook runs with the first
    half (whole blocks) on disk, as on the buffered path. The digest fed while writing is the
    digest of the file."""
    if not direct:
        monkeypatch.setattr(checkpoint_writer, "use_direct_io", lambda fd: False)
    calls: list[int] = []
    writer = "write_image_direct" if image else "write_chunks_direct"
    real = getattr(checkpoint_writer, writer)
    monkeypatch.setattr(checkpoint_writer, writer, lambda fd, *a: calls.append(fd) or real(fd, *a))
    generator = torch.Generator().manual_seed(0)
    sizes = [13, 4096, 7 * 1024 * 1024 + 5, 1, 9 * 1024 * 1024 + 4093, 300_001]
    tensors = {
        f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
        for i, n in enumerate(sizes)
    }
    tensors["f"] = torch.randn(1001, generator=generator)  # laid out first: 4-byte elements
    chunks = safetensors_chunks(tensors, TENSOR_FILE_METADATA)
    expected = b"".join(bytes(c) for c in chunks)
    staged = _image(tensors) if image else None
    if staged is not None:
        assert bytes(staged.data) == expected and staged.size % 4096 != 0
        assert not any(staged.buffer[staged.size :])  # the padding O_DIRECT writes is zeros
        chunks = [staged.data]
    path = tmp_path / "big.safetensors"
    seen: list[int] = []

    def halfway() -> None:
        seen.append(path.stat().st_size)
        assert path.read_bytes() == expected[: seen[-1]]

    digest = blake3.blake3()
    written = checkpoint_writer.write_chunks_durably(
        path, chunks, halfway=halfway, digest=digest, image=staged
    )
    assert written == len(expected)
    assert path.read_bytes() == expected
    assert digest.hexdigest() == blake3.blake3(expected).hexdigest()  # hashed inline, no padding
    assert len(calls) == (1 if direct else 0)
    assert len(seen) == 1 and 0 <= len(expected) // 2 - seen[0] < (4096 if direct else 1)


def test_o_direct_writes_run_beside_the_gathering_and_their_error_keeps_its_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk writes one slice on a thread of its own while the caller gathers and hashes
    the next; a write that fails (ENOSPC on the third slice) is raised to the caller with its
    errno and the file's name, after the writes in flight, and no write thread outlives it."""
    writers: list[int] = []
    real = checkpoint_writer.os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        writers.append(threading.get_ident())
        if len(writers) == 3 and fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(checkpoint_writer.os, "pwrite", pwrite)
    data = torch.arange(20 * 1024 * 1024, dtype=torch.int32).view(torch.uint8)  # 80 MiB
    chunks = [memoryview(data[:-7].numpy()), memoryview(data[-7:].numpy())]
    fail = False
    path = tmp_path / "ok.safetensors"
    checkpoint_writer.write_chunks_durably(path, chunks)
    assert path.read_bytes() == data.numpy().tobytes()
    assert writers and threading.get_ident() not in writers

    fail, writers[:] = True, []
    path = tmp_path / "full.safetensors"
    with pytest.raises(OSError) as raised:
        checkpoint_writer.write_chunks_durably(path, chunks)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-write")]


def test_a_failed_write_of_a_file_image_keeps_its_errno_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checkpoint_writer.os.pwrite
    writes: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        writes.append(offset)
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(checkpoint_writer.os, "pwrite", pwrite)
    monkeypatch.setattr(checkpoint_writer, "_IMAGE_SLICE", 16 * 1024 * 1024)
    image = _image({"data": torch.arange(20 * 1024 * 1024, dtype=torch.int32)})  # 80 MiB
    path = tmp_path / "full.safetensors"
    with pytest.raises(OSError) as raised:
        checkpoint_writer.write_chunks_durably(path, [image.data], image=image)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert len(writes) <= 3 + 1  # stopped within the writes in flight
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-write")]


def test_an_async_save_writes_its_file_images_and_they_hold_what_a_synchronous_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With O_DIRECT for every file, an async save writes model and optimizer from their
    staged images (no gathering) and a synchronous save from the live tensors (gathered):
    the same bytes, which resume restores."""
    monkeypatch.setattr(checkpoint_writer, "DIRECT_MIN_BYTES", 1)
    images: list[str] = []
    real = checkpoint_writer.write_image_direct
    monkeypatch.setattr(
        checkpoint_writer,
        "write_image_direct",
        lambda fd, image, *args: images.append(sorted(image.tensors)[0]) or real(fd, image, *args),
    )
    data = _data()
    state = _state(data)
    _steps(state, data, 3)
    manager = _manager(tmp_path / "async")
    manager.save_async(state)
    manager.wait()
    expected = _steps(state, data, 2)
    assert len(images) == 2  # model.safetensors and optimizer.safetensors
    images.clear()
    twin = _state(data)  # the same trajectory, saved synchronously
    _steps(twin, data, 3)
    synchronous = _manager(tmp_path / "sync").save(twin).path
    assert images == []
    (written,) = checkpoint_dirs(manager.run_dir)
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        assert (written / name).read_bytes() == (synchronous / name).read_bytes()
    resumed = _state(data, seed=7)
    _manager(tmp_path / "async", attempt=2).resume(resumed)
    assert resumed.step == 3
    assert _steps(resumed, data, 2) == expected


# -- reading straight into the live tensors -----------------------------------------------------


def test_resume_reads_into_the_live_tensors_and_training_continues_bit_exact(
    tmp_path: Path,
) -> None:
    data = _data()
    original = _state(data)
    _steps(original, data, 9)
    _manager(tmp_path).save(original)
    expected = _steps(original, data, 4)
    # A state that has stepped already: its parameters and Adam moments exist to be read into.
    resumed = _state(data, seed=99)
    _steps(resumed, data, 3)
    params = {k: v.data_ptr() for k, v in resumed.model.state_dict().items()}
    moments = {
        k: v.data_ptr() for k, v in live_tensors(resumed)[OPTIMIZER_FILE].items() if v.numel()
    }
    info = _manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.step == 9
    # The same memory holds the checkpoint's values: nothing was mapped afresh or copied in.
    assert {k: v.data_ptr() for k, v in resumed.model.state_dict().items()} == params
    after = live_tensors(resumed)[OPTIMIZER_FILE]
    assert {k: after[k].data_ptr() for k in moments} == moments
    assert _steps(resumed, data, 4) == expected


def test_resume_runs_the_probe_pass_once_while_the_optimizer_state_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe batch needs only the model: once model.safetensors is read into the live
    model and verified, its pass runs while the optimizer's file is still being read."""
    data = _data()
    original = _state(data)
    _steps(original, data, 9)
    _manager(tmp_path).save(original)
    expected = _steps(original, data, 4)
    optimizer_read = threading.Event()
    real_read = checkpoint_load.read_verified_into

    def slow_optimizer(directory: Path, listed: ListedFile, into: dict, **kw: int) -> object:
        if listed.name == OPTIMIZER_FILE:
            time.sleep(0.5)  # a large optimizer state on a slow disk
            try:
                return real_read(directory, listed, into, **kw)
            finally:
                optimizer_read.set()
        return real_read(directory, listed, into, **kw)

    passes: list[bool] = []
    real_logits = manager_module.probe_logits

    def probe_logits(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        passes.append(optimizer_read.is_set())
        return real_logits(model, inputs)

    monkeypatch.setattr(checkpoint_load, "read_verified_into", slow_optimizer)
    monkeypatch.setattr(manager_module, "probe_logits", probe_logits)
    resumed = _state(data, seed=99)
    _steps(resumed, data, 3)
    info = _manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.step == 9
    assert passes == [False]  # one pass, before the optimizer's state had landed
    assert _steps(resumed, data, 4) == expected


def test_a_corrupt_checkpoint_read_into_the_live_state_is_overwritten_by_the_previous_one(
    tmp_path: Path,
) -> None:
    data = _data()
    state = _state(data)
    previous, newest = _save_at(_manager(tmp_path), state, data, [10, 20])
    _flip_byte(newest)  # found only once its bytes are in the live parameters
    resumed = _state(data, seed=5)
    _steps(resumed, data, 2)
    info = _manager(tmp_path, attempt=2).resume(resumed)
    assert info is not None and info.path == previous
    clean = _state(data, seed=6)
    assert _manager(tmp_path, attempt=3).resume(clean) is not None
    for key, value in clean.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    for key, value in live_tensors(clean)[OPTIMIZER_FILE].items():
        assert torch.equal(value, live_tensors(resumed)[OPTIMIZER_FILE][key]), key


def test_when_no_checkpoint_restores_after_one_changed_the_live_state_resume_says_so(
    tmp_path: Path,
) -> None:
    data = _data()
    state = _state(data)
    (only,) = _save_at(_manager(tmp_path), state, data, [10])
    _flip_byte(only)
    resumed = _state(data, seed=5)
    with pytest.raises(RestoreDivergedError, match="no older checkpoint restored"):
        _manager(tmp_path, attempt=2).resume(resumed)
    assert only not in _manager(tmp_path, attempt=3).committed_dirs()  # marked corrupt
    # A checkpoint of another config is passed over before a byte of it is read.
    other = _state(data, seed=5)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    _save_at(_manager(tmp_path / "other"), _state(data), data, [10])
    other.config_sha256 = "e" * 64
    assert _manager(tmp_path / "other", attempt=2).resume(other) is None
    assert all(torch.equal(v, other.model.state_dict()[k]) for k, v in before.items())


def test_a_header_that_places_bytes_outside_its_tensor_is_read_the_ordinary_way(
    tmp_path: Path,
) -> None:
    data = _data()
    state = _state(data)
    _steps(state, data, 2)
    path = _manager(tmp_path).save(state).path
    # Re-signed, so the digest matches: a header whose offsets overlap must not steer bytes.
    raw = (path / MODEL_FILE).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    entries = {n: e for n, e in header.items() if n != "__metadata__"}
    # The last tensor's bytes claimed to start where the first one's do: two tensors, one place.
    last = max(entries, key=lambda n: entries[n]["data_offsets"][0])
    begin, end = entries[last]["data_offsets"]
    entries[last]["data_offsets"] = [0, end - begin]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    assert len(text) == length
    (path / MODEL_FILE).write_bytes(raw[:8] + text + raw[8 + length :])
    resign(path, MODEL_FILE)
    resumed = _state(data, seed=5)
    before = {k: v.clone() for k, v in resumed.model.state_dict().items()}
    # Read whole and verified, nothing read in place: the parsed tensors fail their probe,
    # the copy taken before the restore puts the state back, and no checkpoint is left.
    assert _manager(tmp_path, attempt=2).resume(resumed) is None
    assert all(torch.equal(v, resumed.model.state_dict()[k]) for k, v in before.items())
    assert path not in _manager(tmp_path, attempt=3).committed_dirs()


def test_checkpoint_errors_survive_pickling_as_dcp_gathers_them() -> None:
    """DCP sends a rank's exception to every rank by pickle; ours must come back whole."""
    import pickle

    from pipeline.checkpoint.errors import (
        CheckpointMismatchError,
        RestoreDivergedError,
        UnsafeCheckpointError,
    )

    for error in (
        CorruptCheckpointError(Path("/ckpt/step-1"), "__0_0.distcp", "blake3 is a, says b"),
        UnsafeCheckpointError("/ckpt/step-1", "x.pt", "is a pickle"),
        CheckpointMismatchError("/ckpt/step-1", "config_sha256", "a", "b"),
        RestoreDivergedError("/ckpt/step-1", "probe differs"),
    ):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert back.directory == error.directory
