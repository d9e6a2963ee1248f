"""Reading a sharded checkpoint's DCP files, below every manager that loads one.

A sharded checkpoint (``SHARDED_FORMAT``, written by :mod:`pipeline.checkpoint.sharded`) keeps
its model and optimizer tensors in torch.distributed.checkpoint (DCP) files. DCP's tensors load
with ``torch.load(weights_only=True)``; ``.metadata`` is a pickle, so it is read only from bytes
whose digest matches the manifest, through an allow-list unpickler that lets nothing set state
on a class, and refused if it describes any non-tensor (``BytesStorageMetadata``) item, whose
loading would unpickle arbitrary objects, or a tensor whose dtype is not a dtype or whose size
does not fit in the shard bytes listed for it. Any failure while planning or loading makes the
candidate corrupt. Every other value is JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.errors import CheckpointError, CorruptCheckpointError
from pipeline.checkpoint.layout import (
    DCP_METADATA_FILE,
    PROBE_FILE,
    TRAINER_STATE_FILE,
    is_dcp_file,
)
from pipeline.checkpoint.tensorfile import TensorFileError, parse_safetensors
from pipeline.checkpoint.verify import (
    CheckpointContents,
    CheckpointInfo,
    ListedFile,
    read_verified,
    verify_files,
)
from pipeline.distributed.world import Groups

MODEL_PREFIX, TRAINING_PREFIX = "model/", "training/"

# Everything a DCP ``.metadata`` pickle of tensors-only state may name (torch 2.13). Anything
# else (os.system, a lambda, a BytesIO payload) is refused before it is constructed.
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch", "strided"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
    | {("torch", name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32")}
    | {("torch", name) for name in ("int16", "int8", "uint8", "bool", "complex64")}
)


class _AllowListUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata from allow-listed names, and lets nothing set state on them.

    The allow-list alone is not enough: BUILD applied to an allowed *class* (or function) sets
    its attributes for the whole process (``pathlib.PosixPath``, say), and SETITEMS or APPENDS
    on something other than a fresh container calls whatever it holds. So this is the
    pure-Python unpickler, whose opcodes can be overridden: BUILD only on an instance of the
    metadata dataclasses, with the state their own pickling writes; SETITEM(S) only on a dict,
    APPEND(S) only on a list, ADDITEMS only on a set. The C unpickler cannot be told this.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, directory: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._directory = directory

    def _refuse(self, detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self._directory, DCP_METADATA_FILE, detail)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _METADATA_GLOBALS:
            raise self._refuse(
                f"names {module}.{name}, which is not on the allow-list for DCP metadata"
            )
        return super().find_class(module, name)

    def _under_mark(self) -> Any:
        # SETITEMS, APPENDS, ADDITEMS act on the object just below their MARK.
        below = self.metastack[-1] if self.metastack else []
        if not below:
            raise self._refuse("has a MARK with nothing below it")
        return below[-1]

    def _require(self, target: Any, kinds: tuple[type, ...], opcode: str) -> None:
        if type(target) not in kinds:
            raise self._refuse(
                f"sets state on {_name_of(target)} ({opcode}), which is not DCP metadata"
            )

    def _load_build(self) -> None:
        if len(self.stack) < 2:
            raise self._refuse("has a BUILD with nothing to build")
        target, state = self.stack[-2], self.stack[-1]
        self._require(target, tuple(_build_fields()), "BUILD")
        fields = _build_fields()[type(target)]
        if fields is None:  # TensorProperties.__setstate__ takes its five-tuple
            valid = isinstance(state, tuple) and len(state) == 5
        else:
            valid = isinstance(state, dict) and all(
                type(key) is str and key in fields for key in state
            )
        if not valid:
            raise self._refuse(
                f"BUILDs {type(target).__name__} from a {type(state).__name__} that is not "
                "the state its pickling writes"
            )
        pickle._Unpickler.load_build(self)

    def _load_setitem(self) -> None:
        if len(self.stack) < 3:
            raise self._refuse("has a SETITEM with nothing to set")
        self._require(self.stack[-3], (dict, OrderedDict), "SETITEM")
        pickle._Unpickler.load_setitem(self)

    def _load_setitems(self) -> None:
        self._require(self._under_mark(), (dict, OrderedDict), "SETITEMS")
        pickle._Unpickler.load_setitems(self)

    def _load_append(self) -> None:
        if len(self.stack) < 2:
            raise self._refuse("has an APPEND with nothing to append to")
        self._require(self.stack[-2], (list,), "APPEND")
        pickle._Unpickler.load_append(self)

    def _load_appends(self) -> None:
        self._require(self._under_mark(), (list,), "APPENDS")
        pickle._Unpickler.load_appends(self)

    def _load_additems(self) -> None:
        self._require(self._under_mark(), (set,), "ADDITEMS")
        pickle._Unpickler.load_additems(self)

    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.ADDITEMS[0]] = _load_additems


@functools.cache
def _build_fields() -> dict[type, frozenset[str] | None]:
    """The classes BUILD may act on (instances only), each with the fields its state may set
    (None: TensorProperties, which sets its own from a tuple)."""
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    classes = [
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        _StorageInfo,
    ]
    built: dict[type, frozenset[str] | None] = {
        cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in classes
    }
    built[dcp_metadata.TensorProperties] = None
    return built


def _name_of(target: Any) -> str:
    if isinstance(target, type):
        return f"the class {target.__module__}.{target.__qualname__}"
    if callable(target):
        module, name = getattr(target, "__module__", "?"), getattr(target, "__qualname__", "?")
        return f"the callable {module}.{name}"
    return f"a {type(target).__module__}.{type(target).__qualname__}"


def read_dcp_metadata(directory: Path, listed: dict[str, ListedFile]) -> Any:
    """DCP's ``.metadata``, from bytes that match the manifest, through the allow-list, then
    held to what the manifest lists: every tensor a real dtype and a size whose bytes fit in
    the shard ranges its chunks point at, so nothing is allocated or read on a lie."""
    from torch.distributed.checkpoint.metadata import Metadata

    raw = read_verified(directory, listed[DCP_METADATA_FILE]).numpy().tobytes()
    try:
        metadata = _AllowListUnpickler(raw, directory).load()
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(directory, DCP_METADATA_FILE, f"does not load: {exc}") from exc
    if type(metadata) is not Metadata:
        raise CorruptCheckpointError(directory, DCP_METADATA_FILE, "is not DCP Metadata")
    _check_metadata(directory, metadata, listed)
    return metadata


def _plain_fields(directory: Path, metadata: Any) -> None:
    """Metadata's fields beside the tensors hold what DCP writes there, never an allowed class
    or function: the reader sets ``storage_meta.load_id``, which on a class would set it for the
    whole process."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    for name, kinds in (
        ("storage_meta", (type(None), StorageMeta)),
        ("planner_data", (type(None), dict)),
        ("version", (type(None), str)),
    ):
        value = getattr(metadata, name, None)
        if type(value) not in kinds:
            raise CorruptCheckpointError(
                directory, DCP_METADATA_FILE, f"{name} is {_name_of(value)}, not what DCP writes"
            )


def _check_metadata(directory: Path, metadata: Any, listed: dict[str, ListedFile]) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    def corrupt(detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(directory, DCP_METADATA_FILE, detail)

    _plain_fields(directory, metadata)
    storage = metadata.storage_data
    items = metadata.state_dict_metadata
    if type(storage) is not dict or type(items) is not dict:
        raise corrupt("state_dict_metadata or storage_data is not a dict")
    for index, where in storage.items():
        # DCP opens <directory>/<relative_path>: only a shard the manifest lists may be named,
        # and only a byte range that lies inside it.
        if not (
            type(index) is MetadataIndex
            and type(where) is _StorageInfo
            and isinstance(where.relative_path, str)
            and is_dcp_file(where.relative_path)
            and where.relative_path in listed
            and where.relative_path != DCP_METADATA_FILE
        ):
            raise corrupt(f"points at a file the manifest does not list: {where}")
        if not (
            _is_count(where.offset)
            and _is_count(where.length)
            and where.offset + where.length <= listed[where.relative_path].size
        ):
            raise corrupt(
                f"reads bytes {where.offset!r}+{where.length!r} of {where.relative_path}, "
                f"which holds {listed[where.relative_path].size} bytes"
            )
        if where.transform_descriptors:  # decompression and the like: never written by Tracks
            raise corrupt(f"transforms {where.relative_path}: {where.transform_descriptors!r}")
    shard_bytes = sum(
        f.size for name, f in listed.items() if name != DCP_METADATA_FILE and is_dcp_file(name)
    )
    total = 0
    for key, item in items.items():
        if type(item) is not TensorStorageMetadata:
            raise corrupt(
                f"item {key!r} is {type(item).__name__}: only tensors are read from DCP files"
            )
        if not isinstance(key, str) or not key.startswith((MODEL_PREFIX, TRAINING_PREFIX)):
            raise corrupt(f"unexpected item {key!r}")
        dtype = getattr(item.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise corrupt(f"item {key!r} has dtype {dtype!r}, not a torch.dtype")
        size = _shape(item.size)
        if size is None:
            raise corrupt(f"item {key!r} has size {item.size!r}, not a torch.Size of counts")
        needed = math.prod(size) * dtype.itemsize
        total += needed
        if total > shard_bytes:
            raise corrupt(
                f"item {key!r} of size {list(size)} ({dtype}) needs {needed} bytes, but the "
                f"listed shards hold {shard_bytes} bytes in all"
            )
        _check_chunks(key, item, size, dtype.itemsize, storage, corrupt)


def _check_chunks(
    key: str,
    item: Any,
    size: tuple[int, ...],
    itemsize: int,
    storage: dict[Any, Any],
    corrupt: Callable[[str], CorruptCheckpointError],
) -> None:
    """The chunks of a tensor tile it exactly (inside it, pairwise disjoint, covering every
    element), and each one's bytes fit in the shard range stored for it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    chunks = item.chunks
    if type(chunks) is not list:
        raise corrupt(f"item {key!r} has chunks {type(chunks).__name__}, not a list")
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    covered = 0
    for chunk in chunks:
        offsets = _shape(getattr(chunk, "offsets", None))
        sizes = _shape(getattr(chunk, "sizes", None))
        if (
            type(chunk) is not ChunkStorageMetadata
            or offsets is None
            or sizes is None
            or len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + n > whole for o, n, whole in zip(offsets, sizes, size, strict=True))
        ):
            raise corrupt(f"item {key!r} of size {list(size)} has a chunk outside it: {chunk}")
        boxes.append((offsets, sizes))
        where = storage.get(MetadataIndex(key, torch.Size(offsets)))
        if where is None:
            raise corrupt(f"item {key!r} has a chunk at {list(offsets)} stored nowhere")
        needed = math.prod(sizes) * itemsize
        if needed > where.length:
            raise corrupt(
                f"item {key!r} has a chunk of {needed} bytes at {list(offsets)}, but its "
                f"storage is {where.length} bytes of {where.relative_path}"
            )
        covered += math.prod(sizes)
    if (overlap := _first_overlap(boxes)) is not None:
        raise corrupt(f"item {key!r} has overlapping chunks at {list(overlap)}")
    if covered != math.prod(size):
        raise corrupt(
            f"item {key!r} of size {list(size)} has chunks covering {covered} of "
            f"{math.prod(size)} elements"
        )


def _first_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The offsets of a chunk that shares an element with an earlier one, else None.

    A sweep along the axis the chunks are split on most: a row- or column-wise sharding over N
    ranks costs N log N, not the N * N of comparing every pair.
    """
    boxes = [box for box in boxes if math.prod(box[1]) > 0]  # an empty chunk holds nothing
    if len(boxes) < 2:
        return None
    if not boxes[0][0]:
        return boxes[1][0]  # two chunks of one scalar
    axis = max(range(len(boxes[0][0])), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in sorted(boxes, key=lambda box: box[0][axis]):
        active = [(o, n) for o, n in active if o[axis] + n[axis] > offsets[axis]]
        for other_offsets, other_sizes in active:
            if all(
                o < p + m and p < o + n
                for o, n, p, m in zip(offsets, sizes, other_offsets, other_sizes, strict=True)
            ):
                return offsets
        active.append((offsets, sizes))
    return None


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _shape(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape (a torch.Size of non-negative ints), or None."""
    if type(value) is not torch.Size or not all(_is_count(n) for n in value):
        return None
    return tuple(value)


def _verified_reader(directory: Path, metadata: Any, listed: dict[str, ListedFile]) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedFiles(FileSystem):
        """DCP's file access, except that a shard is read once, whole, and hashed: DCP parses
        exactly the bytes whose digest matched MANIFEST.json. Reading the file again after an
        earlier verification pass would leave a window in which it could change unseen."""

        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            if mode != "rb":
                raise CorruptCheckpointError(directory, str(path), f"opened with mode {mode!r}")
            name = Path(path).name
            if name not in listed or Path(path).parent != directory:
                raise CorruptCheckpointError(directory, name, "is not listed in MANIFEST.json")
            yield io.BytesIO(read_verified(directory, listed[name]).numpy().tobytes())

    class VerifiedReader(FileSystemReader):
        """DCP's file reader, handed the metadata already read through the allow-list."""

        def __init__(self) -> None:
            super().__init__(directory)
            self.fs = VerifiedFiles()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader()


def load_sharded(
    info: CheckpointInfo,
    listed: dict[str, ListedFile],
    *,
    groups: Groups | None = None,
    verified: bool = False,
) -> CheckpointContents:
    """Read a sharded checkpoint whose layout verified, on any number of ranks (resharding).

    ``verified``: the DCP shards and rank files were already hashed (by the ranks, each its
    share); otherwise they are hashed here first, so a bad candidate is refused whole. Either
    way DCP parses only bytes hashed as it reads them (``VerifiedFiles``): a shard changed after
    that first pass is caught too.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = info.path
    if not verified:
        verify_files(
            directory,
            listed,
            [n for n in listed if n not in (DCP_METADATA_FILE, TRAINER_STATE_FILE, PROBE_FILE)],
        )
    try:
        metadata = read_dcp_metadata(directory, listed)
        # Whatever the checks above missed (DCP's planner, a shard that does not unpickle as a
        # tensor, an allocation that fails) is this candidate's fault: it is corrupt, and the
        # resume falls back to the previous one, never ending the attempt as user code's error.
        tensors = {
            key: torch.empty(item.size, dtype=item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
        }
        with warnings.catch_warnings():
            # One process reading N ranks' shards is resharding on purpose, not a mistake.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(
                tensors,
                storage_reader=_verified_reader(directory, metadata, listed),
                process_group=groups.checkpoint if groups else None,
                no_dist=groups is None,
            )
    except CorruptCheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        # DCP gathers every rank's failure into CheckpointException, a BaseException (not an
        # Exception). A digest mismatch found where DCP read a shard is reported as itself,
        # naming the shard.
        failures = exc.failures.values() if isinstance(exc, CheckpointException) else ()
        for failure, _ in failures:
            if isinstance(failure, CheckpointError):
                raise failure from exc
        detail = f"does not load: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        raise CorruptCheckpointError(directory, "__*.distcp", detail) from exc
    name = TRAINER_STATE_FILE
    try:
        trainer_state = json.loads(read_verified(directory, listed[name]).numpy().tobytes())
        name = PROBE_FILE
        probe, probe_meta = parse_safetensors(read_verified(directory, listed[name]))
    except (TensorFileError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(directory, name, f"does not load: {exc}") from exc
    if not isinstance(trainer_state, dict):
        raise CorruptCheckpointError(directory, TRAINER_STATE_FILE, "is not a JSON object")
    return CheckpointContents(
        info=info,
        model={k[len(MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)},
        training_tensors={
            k[len(TRAINING_PREFIX) :]: v
            for k, v in tensors.items()
            if k.startswith(TRAINING_PREFIX)
        },
        trainer_state=trainer_state,
        probe=probe,
        probe_device=probe_meta.get("device", "cpu"),
        probe_cpu_capability=probe_meta.get("cpu_capability"),
    )
