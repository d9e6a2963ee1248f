"""Sharded checkpoints: N ranks write one step directory under the same commit protocol.

Layout (``SHARDED_FORMAT``), inside the usual ``step-<step>-a<attempt>`` directory::

    .metadata  __<rank>_0.distcp …   model and optimizer tensors (torch.distributed.checkpoint)
    rank-<rank>.json                  that rank's RNG (JSON)
    digests-<rank>.json               size and digest of that rank's own files
    trainer_state.json  probe.safetensors  MANIFEST.json  COMMITTED     (rank 0; COMMITTED last)

Save order: rank 0 records the save as writing (fenced) and makes the directory; every rank
writes its DCP shard (``dcp.save`` returns only after every shard and ``.metadata`` are
fsynced), then its rank file and the digests of its own files, so hashing runs on every rank at
once; every rank agrees it is done; rank 0 hashes ``.metadata`` and its own JSON, writes
MANIFEST.json, commits the ledger under the fencing token, and renames COMMITTED into place.
A rank that dies anywhere in between leaves a directory without COMMITTED, which no reader uses.

Reading (the DCP files' allow-listed ``.metadata``, the checks on it, the verified load) is
:mod:`pipeline.checkpoint.sharded_read`, which the single-process reader uses too.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.codec import decode_state
from pipeline.checkpoint.errors import CheckpointError, CorruptCheckpointError
from pipeline.checkpoint.layout import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    PROBE_FILE,
    SHARDED_FORMAT,
    TRAINER_STATE_FILE,
    checkpoint_dir_name,
    digests_file,
    fsync_dir,
    make_dir_durably,
    rank_file,
    write_file_durably,
)
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manager import CheckpointConfig, CheckpointManager, _restore_staged
from pipeline.checkpoint.sharded_read import MODEL_PREFIX, TRAINING_PREFIX, load_sharded
from pipeline.checkpoint.state import StagedCheckpoint, TrainingState, stage_checkpoint
from pipeline.checkpoint.verify import (
    CheckpointContents,
    CheckpointInfo,
    LedgerCommit,
    ListedFile,
    _verify_layout,
    is_committed,
    read_verified,
    verify_files,
)
from pipeline.checkpoint.writer import (
    WrittenCheckpoint,
    chunks_digest,
    naming_step,
    serialize_staged,
    write_chunks_durably,
)
from pipeline.digests import FILE_DIGEST, file_digest, sha256_bytes
from pipeline.distributed.world import Groups, PeerRankError, World


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


class ShardedCheckpointManager(CheckpointManager):
    """The checkpoint manager of one rank of a distributed attempt (world size > 1).

    Every rank calls the same methods at the same steps; rank 0 alone talks to the ledger,
    writes the run-level files and applies retention. Saves are synchronous at this scale:
    the collective DCP write is the stall (see the README's notes on scale).
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: CheckpointConfig,
        *,
        run_id: str,
        world: World,
        groups: Groups,
        ledger: Any = None,
        on_event: Any = None,
        on_commit: Any = None,
    ) -> None:
        super().__init__(
            run_dir,
            config,
            run_id=run_id,
            ledger=ledger if world.leader else None,
            on_event=on_event,
            on_commit=on_commit,
        )
        self.world, self.groups = world, groups

    def bind_attempt(self, attempt_no: int, fencing_token: int | None) -> None:
        # Rank 0 began the attempt; every rank names its directories after the same number.
        attempt_no, fencing_token = self.groups.broadcast(
            "sharing the attempt number", (attempt_no, fencing_token)
        )
        super().bind_attempt(attempt_no, fencing_token)

    def save_async(self, state: TrainingState, *, metrics: dict[str, float] | None = None) -> None:
        self.save(state, metrics=metrics)

    def _agree(self, what: str, error: BaseException | None) -> None:
        """All ranks learn whether ``what`` worked everywhere; a rank's own error wins locally."""
        try:
            self.groups.agree(what, _describe(error))
        except PeerRankError:
            if error is not None:
                raise error from None
            raise

    def write_and_commit(self, staged: StagedCheckpoint) -> CheckpointInfo:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        attempt_no = self._require_attempt()
        directory = self.run_dir / checkpoint_dir_name(staged.step, attempt_no)
        parent = str(self.last_committed.path) if self.last_committed else None
        error: BaseException | None = None
        if self.world.leader:
            try:
                if is_committed(directory):
                    raise CheckpointError(f"checkpoint {directory} is already committed")
                if directory.exists():
                    shutil.rmtree(directory)  # this attempt's own half-written leftover
                make_dir_durably(self.run_dir)
                directory.mkdir()
                fsync_dir(self.run_dir)
                self._record_writing(directory, staged.step, attempt_no, parent)
            except BaseException as exc:
                error = exc
        self._agree(f"preparing checkpoint {directory.name}", error)

        try:
            tensors = {MODEL_PREFIX + k: v for k, v in staged.model.items()}
            tensors.update({TRAINING_PREFIX + k: v for k, v in staged.training_tensors.items()})
            dcp.save(
                tensors,
                storage_writer=FileSystemWriter(directory, sync_files=True, overwrite=False),
                process_group=self.groups.checkpoint,
            )
            self._write_rank_files(directory, staged)
        except BaseException as exc:
            error = exc
        try:
            self._agree(f"writing the shards of {directory.name}", error)
        except BaseException as exc:
            if self.world.leader:  # recorded as abandoned, like a single process's failed write
                self._abandon(directory, exc, ledger_committed=False)
            raise

        info_fields: dict[str, Any] | None = None
        if self.world.leader:
            try:
                try:
                    written = self._write_manifest(directory, staged, attempt_no)
                except BaseException as exc:
                    self._abandon(directory, exc, ledger_committed=False)
                    raise
                committed = self._commit(written, parent)
                info_fields = {
                    "manifest_sha256": written.manifest_sha256,
                    "committed_at": committed["committed_at"],
                    "size_bytes": written.size_bytes,
                }
            except BaseException as exc:
                error = exc
        self._agree(f"committing {directory.name}", error)
        info_fields = self.groups.broadcast("sharing the commit", info_fields)
        assert info_fields is not None
        info = CheckpointInfo(
            path=directory,
            run_id=self.run_id,
            attempt_no=attempt_no,
            step=staged.step,
            fencing_token=self.fencing_token,
            metrics=staged.metrics,
            format=SHARDED_FORMAT,
            world_size=self.world.world_size,
            **info_fields,
        )
        self.last_committed = info
        self._committed(info)
        if self.world.leader:
            try:
                self.apply_retention()
            except Exception as exc:  # the commit stands; a missed clean-up is retried next save
                self._event("retention_failed", {"path": str(directory), "error": str(exc)})
        return info

    def _write_rank_files(self, directory: Path, staged: StagedCheckpoint) -> None:
        """This rank's RNG, then the size and digest of every file this rank wrote."""
        rank = self.world.rank
        own = rank_file(rank)
        body = json.dumps(
            {"rank": rank, "step": staged.step, "rng": staged.trainer_state.get("rng")},
            sort_keys=True,
        ).encode()
        try:
            write_file_durably(directory / own, body)
        except OSError as exc:
            raise naming_step(exc, directory / own, staged.step) from exc
        names = [*sorted(p.name for p in directory.glob(f"__{rank}_*.distcp")), own]
        digests = {
            name: {
                "size": (directory / name).stat().st_size,
                "algorithm": FILE_DIGEST.value,
                "digest": file_digest(directory / name, FILE_DIGEST),
            }
            for name in names
        }
        path = directory / digests_file(rank)
        try:
            write_file_durably(path, json.dumps(digests, sort_keys=True).encode())
        except OSError as exc:
            raise naming_step(exc, path, staged.step) from exc

    def _write_manifest(
        self, directory: Path, staged: StagedCheckpoint, attempt_no: int
    ) -> WrittenCheckpoint:
        files: list[dict[str, Any]] = []
        for rank in range(self.world.world_size):
            name = digests_file(rank)
            raw = (directory / name).read_bytes()
            for listed_name, entry in json.loads(raw).items():
                files.append({"name": listed_name, **entry})
            files.append(
                {
                    "name": name,
                    "size": len(raw),
                    "algorithm": FILE_DIGEST.value,
                    "digest": chunks_digest([memoryview(raw)]),
                }
            )
        files.append(
            {
                "name": DCP_METADATA_FILE,
                "size": (directory / DCP_METADATA_FILE).stat().st_size,
                "algorithm": FILE_DIGEST.value,
                "digest": file_digest(directory / DCP_METADATA_FILE, FILE_DIGEST),
            }
        )
        contents = serialize_staged(staged)
        for name in (TRAINER_STATE_FILE, PROBE_FILE):
            try:
                size = write_chunks_durably(directory / name, contents[name])
            except OSError as exc:
                raise naming_step(exc, directory / name, staged.step) from exc
            files.append(
                {
                    "name": name,
                    "size": size,
                    "algorithm": FILE_DIGEST.value,
                    "digest": chunks_digest(contents[name]),
                }
            )
        manifest = {
            "format": SHARDED_FORMAT,
            "world_size": self.world.world_size,
            "torch_version": torch.__version__,
            "run_id": self.run_id,
            "attempt_no": attempt_no,
            "step": staged.step,
            "metrics": staged.metrics,
            "created_at": datetime.now(UTC).isoformat(),
            "files": sorted(files, key=lambda f: f["name"]),
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True, indent=1).encode()
        try:
            write_file_durably(directory / MANIFEST_FILE, manifest_bytes)
            fsync_dir(directory)
        except OSError as exc:
            raise naming_step(exc, directory / MANIFEST_FILE, staged.step) from exc
        return WrittenCheckpoint(
            path=directory,
            run_id=self.run_id,
            attempt_no=attempt_no,
            step=staged.step,
            manifest_sha256=sha256_bytes(manifest_bytes),
            size_bytes=sum(f["size"] for f in files) + len(manifest_bytes),
            metrics=staged.metrics,
        )

    # -- resuming -------------------------------------------------------------------------

    def resume(self, state: TrainingState) -> CheckpointInfo | None:
        """Every rank restores the same checkpoint, or none; rank 0 picks the candidates.

        Each rank hashes its share of the files (verification in parallel across ranks), the
        ranks agree on the verdict, then load the tensors (resharded by DCP when the world size
        differs) and each re-runs the probe.
        """
        listing: list[tuple[str, LedgerCommit | None]] | None = None
        if self.world.leader:
            # Rank 0 alone holds the ledger: each rank holds the manifest it reads to the
            # ledger's commit, so every rank verifies against the manifest the ledger vouches for.
            commits = self.ledger_commits()
            listing = [(str(d), self.ledger_commit_of(d, commits)) for d in self.committed_dirs()]
        candidates = self.groups.broadcast("listing committed checkpoints", listing)
        fresh = stage_checkpoint(state, run_id=self.run_id, attempt_no=0)
        rank, size = self.world.rank, self.world.world_size
        for candidate, vouched in candidates:
            directory = Path(candidate)
            error: BaseException | None = None
            info: CheckpointInfo | None = None
            listed: dict[str, ListedFile] = {}
            try:
                info, listed = _verify_layout(directory, vouched)
                verify_files(directory, listed, sorted(listed)[rank::size])
            except (CorruptCheckpointError, OSError) as exc:
                error = exc
            if not self._candidate_agreed(f"verifying {directory.name}", directory, error):
                continue
            assert info is not None
            contents: CheckpointContents | None = None
            try:
                contents = (
                    load_sharded(info, listed, groups=self.groups, verified=True)
                    if info.format == SHARDED_FORMAT
                    else load_checkpoint(directory, ledger_commit=vouched)
                )
            except (CorruptCheckpointError, OSError) as exc:
                error = exc
            if not self._candidate_agreed(f"loading {directory.name}", directory, error):
                continue
            assert contents is not None
            if contents.trainer_state.get("config_sha256") != state.config_sha256:
                self._event(
                    "checkpoint_skipped",
                    {"path": str(directory), "why": "written under a different config"},
                )
                continue
            self._check_belongs(contents.info.path, contents.trainer_state, state)
            try:
                self.restore(state, contents)
                if info.world_size == size:
                    self._restore_rank_rng(state, directory, listed)
            except (CorruptCheckpointError, OSError) as exc:
                error = exc
            if not self._candidate_agreed(f"restoring {directory.name}", directory, error):
                _restore_staged(state, fresh)
                continue
            self.last_committed = contents.info
            return contents.info
        return None

    def _candidate_agreed(self, what: str, directory: Path, error: BaseException | None) -> bool:
        try:
            self.groups.agree(what, _describe(error))
        except PeerRankError as exc:
            if self.world.leader:
                cause = error if isinstance(error, Exception) else None
                self.mark_corrupt(
                    directory, cause or CorruptCheckpointError(directory, ".", str(exc))
                )
            return False
        return True

    def _restore_rank_rng(
        self, state: TrainingState, directory: Path, listed: dict[str, ListedFile]
    ) -> None:
        """Each rank continues its own random streams (rank 0's are in trainer_state.json)."""
        name = rank_file(self.world.rank)
        if self.world.leader or name not in listed:
            return
        try:
            saved = json.loads(read_verified(directory, listed[name]).numpy().tobytes())
            if saved.get("rng") is not None:
                state.rng.load_state_dict(decode_state(saved["rng"], {}))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(directory, name, f"does not restore: {exc}") from exc

    def reconcile_with_ledger(
        self, state: TrainingState, resumed: CheckpointInfo | None
    ) -> CheckpointInfo | None:
        """As for one process, but the ranks decide together whether to resume again."""
        again = False
        if self.world.leader and self.ledger is not None:
            latest = self.ledger.latest_committed_checkpoint(self.run_id)
            again = latest is not None and (
                resumed is None
                or (latest.step, latest.attempt_no) > (resumed.step, resumed.attempt_no)
            )
            if again and latest is not None and not is_committed(Path(latest.path)):
                self.mark_corrupt(
                    Path(latest.path),
                    CheckpointError(
                        f"the ledger recorded checkpoint {latest.path} as committed but it has "
                        f"no COMMITTED: attempt {latest.attempt_no} stopped between the two"
                    ),
                )
        if not self.groups.broadcast("reconciling with the ledger", again):
            return resumed
        return self.resume(state)
