"""A hostile store cannot launder bytes: the ledger, not the folder, says what was committed.

Reproduced on the code before this file: a checkpoint folder rewritten with another run's weights
and re-signed digests (MANIFEST.json and COMMITTED rewritten consistently) was resumed, and the
next honest commit named it as its parent; a folder the ledger never committed was resumed; a
DCP ``.metadata`` that used only allow-listed names set an attribute on ``pathlib.PosixPath``
for the whole process; a huge size or a string dtype in ``.metadata`` ended the resume with an
uncaught error instead of falling back; a false ``world_size`` in MANIFEST.json was believed.
"""

from __future__ import annotations

import pickle
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path, PosixPath

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from pipeline.checkpoint import (
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PROBE_FILE,
    CheckpointConfig,
    CheckpointManager,
    CorruptCheckpointError,
    load_checkpoint,
    verify_checkpoint,
)
from pipeline.checkpoint.layout import CORRUPT_FILE, DCP_METADATA_FILE
from pipeline.checkpoint.sharded import ShardedCheckpointManager
from pipeline.digests import sha256_bytes
from pipeline.distributed.world import Groups, World
from pipeline.ledger import Ledger
from pipeline.states import CheckpointState
from tests.checkpoint_support import (
    begin_attempt,
    gloo_world_of_one,
    ledger_with_run,
    resign,
    train_to,
    training_data,
    training_state,
)

RUN_ID = "run-hostile"
Events = list[tuple[str, dict]]


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Bit-exact probes and weights: one thread, deterministic kernels.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def groups() -> Iterator[Groups]:
    with gloo_world_of_one() as world:
        yield world


def _manager(
    run_dir: Path,
    *,
    ledger: Ledger | None = None,
    attempt: int = 1,
    token: int | None = None,
    events: Events | None = None,
) -> CheckpointManager:
    manager = CheckpointManager(
        run_dir,
        CheckpointConfig(interval_steps=10, keep_last_k=10),
        run_id=RUN_ID,
        ledger=ledger,
        on_event=lambda name, fields: (events if events is not None else []).append((name, fields)),
    )
    manager.bind_attempt(attempt, token)
    return manager


def _sharded(
    run_dir: Path,
    groups: Groups,
    *,
    ledger: Ledger | None = None,
    attempt: int = 1,
    token: int | None = None,
    events: Events | None = None,
) -> ShardedCheckpointManager:
    manager = ShardedCheckpointManager(
        run_dir,
        CheckpointConfig(interval_steps=10, keep_last_k=10),
        run_id=RUN_ID,
        world=World(),
        groups=groups,
        ledger=ledger,
        on_event=lambda name, fields: (events if events is not None else []).append((name, fields)),
    )
    manager.bind_attempt(attempt, token)
    return manager


def _save_at(manager: CheckpointManager, steps: list[int], *, seed: int = 0) -> list[Path]:
    data = training_data()
    state = training_state(data, seed=seed)
    paths = []
    for step in steps:
        train_to(state, data, step)
        paths.append(manager.save(state, metrics={"eval_loss": 1.0}).path)
    return paths


def _swap_in(directory: Path, source: Path, *names: str) -> str:
    """Another checkpoint's files, copied in and re-signed: the folder is self-consistent again.
    Returns the forged MANIFEST.json's sha256."""
    for name in names:
        shutil.copyfile(source / name, directory / name)
    resign(directory, *names)
    verify_checkpoint(directory)  # every digest in the folder agrees with its bytes
    return sha256_bytes((directory / MANIFEST_FILE).read_bytes())


def _corrupt_details(events: Events, directory: Path) -> list[str]:
    return [
        fields["detail"]
        for name, fields in events
        if name == "checkpoint_corrupt" and fields["path"] == str(directory)
    ]


# -- the ledger is the record: a re-signed folder is not a commit -------------------------------


def test_a_resigned_checkpoint_with_another_runs_weights_is_refused_and_the_previous_resumed(
    tmp_path: Path,
) -> None:
    ledger = ledger_with_run(tmp_path / "ledger.db", RUN_ID)
    attempt, token = begin_attempt(ledger, RUN_ID)
    run_dir = tmp_path / "store" / RUN_ID
    writer = _manager(run_dir, ledger=ledger, attempt=attempt, token=token)
    previous, newest = _save_at(writer, [10, 20])
    honest_model = (newest / MODEL_FILE).read_bytes()
    (other,) = _save_at(_manager(tmp_path / "other" / RUN_ID), [20], seed=5)
    vouched = ledger.get_checkpoint(str(newest)).manifest_sha256
    assert vouched is not None
    forged = _swap_in(newest, other, MODEL_FILE, OPTIMIZER_FILE, PROBE_FILE)

    attempt, token = begin_attempt(ledger, RUN_ID)
    data = training_data()
    state = training_state(data, seed=9)
    resumer = _manager(run_dir, ledger=ledger, attempt=attempt, token=token)
    info = resumer.resume(state)
    assert info is not None and info.path == previous and state.step == 10
    record = ledger.get_checkpoint(str(newest))
    assert record.state == CheckpointState.CORRUPT
    for named in (str(newest), forged, vouched):
        assert named in (record.state_detail or "")
    assert (newest / CORRUPT_FILE).is_file()
    # The next honest commit descends from the previous one and holds this run's weights.
    train_to(state, data, 20)
    honest = resumer.save(state)
    assert ledger.get_checkpoint(str(honest.path)).parent_path == str(previous)
    assert (honest.path / MODEL_FILE).read_bytes() == honest_model


def test_a_committed_folder_the_ledger_has_no_committed_row_for_is_refused(
    tmp_path: Path,
) -> None:
    ledger = ledger_with_run(tmp_path / "ledger.db", RUN_ID)
    attempt, token = begin_attempt(ledger, RUN_ID)
    run_dir = tmp_path / "store" / RUN_ID
    _, newest = _save_at(_manager(run_dir, ledger=ledger, attempt=attempt, token=token), [10, 20])
    # Planted beside them: a checkpoint that verifies, written where no ledger saw it.
    (planted,) = _save_at(_manager(run_dir, attempt=7), [30], seed=5)
    verify_checkpoint(planted)

    attempt, token = begin_attempt(ledger, RUN_ID)
    events: Events = []
    state = training_state(training_data(), seed=9)
    info = _manager(run_dir, ledger=ledger, attempt=attempt, token=token, events=events).resume(
        state
    )
    assert info is not None and info.path == newest and state.step == 20
    [detail] = _corrupt_details(events, planted)
    assert "no committed row" in detail and str(planted) in detail
    assert (planted / CORRUPT_FILE).is_file()
    with pytest.raises(LookupError):
        ledger.get_checkpoint(str(planted))  # nothing was recorded for it, then or now


def test_a_resigned_sharded_checkpoint_with_another_runs_shards_is_refused(
    tmp_path: Path, groups: Groups
) -> None:
    ledger = ledger_with_run(tmp_path / "ledger.db", RUN_ID)
    attempt, token = begin_attempt(ledger, RUN_ID)
    run_dir = tmp_path / "store" / RUN_ID
    writer = _sharded(run_dir, groups, ledger=ledger, attempt=attempt, token=token)
    previous, newest = _save_at(writer, [10, 20])
    (other,) = _save_at(_sharded(tmp_path / "other" / RUN_ID, groups), [20], seed=5)
    vouched = ledger.get_checkpoint(str(newest)).manifest_sha256
    assert vouched is not None
    shards = sorted(p.name for p in other.glob("*.distcp"))
    forged = _swap_in(newest, other, DCP_METADATA_FILE, *shards, PROBE_FILE)

    attempt, token = begin_attempt(ledger, RUN_ID)
    data = training_data()
    state = training_state(data, seed=9)
    resumer = _sharded(run_dir, groups, ledger=ledger, attempt=attempt, token=token)
    info = resumer.resume(state)
    assert info is not None and info.path == previous and state.step == 10
    record = ledger.get_checkpoint(str(newest))
    assert record.state == CheckpointState.CORRUPT
    for named in (str(newest), forged, vouched):
        assert named in (record.state_detail or "")
    train_to(state, data, 20)
    honest = resumer.save(state)
    assert ledger.get_checkpoint(str(honest.path)).parent_path == str(previous)


# -- DCP .metadata: a re-signed pickle is still only data -----------------------------------------


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory, groups: Groups) -> Path:
    """A run folder with two sharded checkpoints (steps 10 and 20), written without a ledger."""
    run_dir = tmp_path_factory.mktemp("sharded") / RUN_ID
    _save_at(_sharded(run_dir, groups), [10, 20])
    return run_dir


def _copy_run(sharded_run: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    run_dir = tmp_path / "store" / RUN_ID
    shutil.copytree(sharded_run, run_dir)
    previous, newest = sorted(run_dir.iterdir())
    return run_dir, previous, newest


def _rewrite_metadata(directory: Path, change: Callable[[Metadata], None]) -> None:
    # The test's own bytes, written moments ago: unpickled here only to forge a variant.
    metadata = pickle.loads((directory / DCP_METADATA_FILE).read_bytes())
    change(metadata)
    (directory / DCP_METADATA_FILE).write_bytes(pickle.dumps(metadata))
    resign(directory, DCP_METADATA_FILE)


def _first_model_item(metadata: Metadata) -> str:
    return next(key for key in sorted(metadata.state_dict_metadata) if key.startswith("model/"))


def _huge_size(directory: Path) -> None:
    def change(metadata: Metadata) -> None:
        key = _first_model_item(metadata)
        item = metadata.state_dict_metadata[key]
        huge = torch.Size([2**50])  # 4 PiB of float32, described in a few bytes
        [(index, where)] = [(i, w) for i, w in metadata.storage_data.items() if i.fqn == key]
        del metadata.storage_data[index]
        metadata.storage_data[MetadataIndex(key, torch.Size([0]), 0)] = where
        item.size = huge
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=huge)]

    _rewrite_metadata(directory, change)


def _string_dtype(directory: Path) -> None:
    def change(metadata: Metadata) -> None:
        item = metadata.state_dict_metadata[_first_model_item(metadata)]
        item.properties.dtype = "float32"

    _rewrite_metadata(directory, change)


def _false_world_size(directory: Path) -> None:
    resign(directory, edit=lambda manifest: manifest.update(world_size=2))


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        (_huge_size, "bytes"),
        (_string_dtype, "not a torch.dtype"),
        (_false_world_size, "world_size 2"),
    ],
    ids=["huge_size", "string_dtype", "false_world_size"],
)
def test_a_resigned_sharded_checkpoint_whose_metadata_lies_is_corrupt_and_the_previous_resumed(
    sharded_run: Path,
    groups: Groups,
    tmp_path: Path,
    tamper: Callable[[Path], None],
    says: str,
) -> None:
    run_dir, previous, newest = _copy_run(sharded_run, tmp_path)
    tamper(newest)  # and re-signed: every digest agrees, only what the bytes say can catch it
    with pytest.raises(CorruptCheckpointError, match=says):
        load_checkpoint(newest)  # an evaluator's read, one process
    events: Events = []
    state = training_state(training_data(), seed=9)
    info = _sharded(run_dir, groups, attempt=2, events=events).resume(state)
    assert info is not None and info.path == previous and state.step == 10
    [detail] = _corrupt_details(events, newest)
    assert says in detail
    assert (newest / CORRUPT_FILE).is_file()


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _build_on_the_class(directory: Path) -> str:
    raw = (directory / DCP_METADATA_FILE).read_bytes()
    assert raw[:2] == pickle.PROTO + b"\x04"
    # Before the real metadata: push the allowed class pathlib.PosixPath, BUILD it with the
    # slot state {"tracks_pwned": "yes"} (a setattr on the class itself), and pop it again.
    attack = (
        pickle.GLOBAL + b"pathlib\nPosixPath\n"
        + pickle.NONE
        + pickle.EMPTY_DICT + _unicode("tracks_pwned") + _unicode("yes") + pickle.SETITEM
        + pickle.TUPLE2
        + pickle.BUILD
        + pickle.POP
    )  # fmt: skip
    (directory / DCP_METADATA_FILE).write_bytes(raw[:2] + attack + raw[2:])
    resign(directory, DCP_METADATA_FILE)
    return "tracks_pwned"


def _class_as_storage_meta(directory: Path) -> str:
    # Only allowed names, and no BUILD on a class: the reader itself would then set
    # ``storage_meta.load_id``, on pathlib.PosixPath.
    _rewrite_metadata(directory, lambda metadata: setattr(metadata, "storage_meta", PosixPath))
    return "load_id"


@pytest.mark.parametrize(
    ("forge", "says"),
    [
        (_build_on_the_class, "sets state on the class pathlib.PosixPath (BUILD)"),
        (_class_as_storage_meta, "storage_meta is the class pathlib.PosixPath"),
    ],
    ids=["build_on_the_class", "class_as_storage_meta"],
)
def test_metadata_that_would_set_state_on_an_allowed_class_is_corrupt_and_changes_nothing(
    sharded_run: Path,
    groups: Groups,
    tmp_path: Path,
    forge: Callable[[Path], str],
    says: str,
) -> None:
    run_dir, previous, newest = _copy_run(sharded_run, tmp_path)
    attribute = forge(newest)
    verify_checkpoint(newest)
    assert not hasattr(PosixPath, attribute)
    events: Events = []
    try:
        with pytest.raises(CorruptCheckpointError, match=re.escape(says)):
            load_checkpoint(newest)
        state = training_state(training_data(), seed=9)
        info = _sharded(run_dir, groups, attempt=2, events=events).resume(state)
        assert not hasattr(PosixPath, attribute)
    finally:
        if hasattr(PosixPath, attribute):  # leave the process as it was, whatever happened
            delattr(PosixPath, attribute)
    assert info is not None and info.path == previous and state.step == 10
    [detail] = _corrupt_details(events, newest)
    assert says in detail
