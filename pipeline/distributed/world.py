"""Who this process is among the ranks of an attempt, and the process groups it talks on.

torchrun tells each worker its place through the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``). Outside torchrun a
trainer is world size 1 and never touches ``torch.distributed``.

Two process groups: the default one carries training collectives (gradients, the per-step
agreement on loss and stop); a separate gloo group with a shorter timeout carries checkpoint
collectives, so a save never shares a group with another thread's collective, and a save
that waits on a dead peer gives up inside the grace period (the previous COMMITTED stands).

Joining them waits for every rank to arrive, up to the group's timeout: a peer killed before it
arrived would hold the others there for minutes. So the join runs on a helper thread while the
main thread watches for a stop (torchrun's agent SIGTERMs the survivors of a dead rank) and
gives the join up when one comes: :class:`JoinAbandoned`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the ranks that need it, not by the launcher's import
    import torch

# Under the usual 30 s termination grace period, so the SIGTERM save gives up in time.
CHECKPOINT_GROUP_TIMEOUT_SECONDS = 20.0
TRAINING_GROUP_TIMEOUT_SECONDS = 300.0
# How often a rank waiting for its peers to join looks at its stop flag.
JOIN_POLL_SECONDS = 0.02


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died, or the network between them did."""

    def __init__(self, what: str, rank: int, cause: BaseException) -> None:
        self.what, self.rank = what, rank
        super().__init__(
            f"rank {rank}: {what} failed, a peer rank is gone or unreachable: "
            f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
        )


class PeerRankError(RuntimeError):
    """Another rank reported a failure in a step every rank takes together."""

    def __init__(self, what: str, failures: dict[int, str]) -> None:
        self.what, self.failures = what, failures
        named = "; ".join(f"rank {rank}: {detail}" for rank, detail in sorted(failures.items()))
        super().__init__(f"{what} failed on {len(failures)} rank(s): {named}")


class JoinAbandoned(RuntimeError):
    """A stop came while this rank waited for the other ranks to join the process groups."""

    def __init__(self, rank: int, waited_seconds: float) -> None:
        self.rank, self.waited_seconds = rank, waited_seconds
        super().__init__(
            f"rank {rank}: gave up joining the process groups after {waited_seconds:.1f} s, "
            "on a stop request (a peer rank may never arrive)"
        )


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``world_size``, ``local_rank`` of ``local_world_size``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local rank {self.local_rank} is not among {self.local_world_size} local ranks"
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one writer of run-level records (ledger, Pipes messages, COMMITTED)."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    def placement(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "ranks_per_node": self.local_world_size,
            "nodes": self.nodes,
        }

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> World:
        """The world torchrun describes in ``env`` (default: ``os.environ``); size 1 outside it."""
        env = dict(os.environ if env is None else env)

        def number(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        world_size = number("WORLD_SIZE", 1)
        return cls(
            rank=number("RANK", 0),
            world_size=world_size,
            local_rank=number("LOCAL_RANK", 0),
            local_world_size=number("LOCAL_WORLD_SIZE", world_size),
        )


class Groups:
    """The initialised process groups of a distributed attempt (world size > 1).

    ``abandon``: polled while the ranks join; when it returns True before every rank has
    arrived, the join is given up (:class:`JoinAbandoned`) and its thread left behind: the
    process is on its way out.
    """

    def __init__(
        self,
        world: World,
        device: torch.device,
        *,
        abandon: Callable[[], bool] | None = None,
    ) -> None:
        import torch.distributed as dist

        self.world = world
        # CPU tensors always go over gloo; CUDA ones over NCCL when training on a GPU.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"

        def join() -> Any:
            try:
                if not dist.is_initialized():
                    dist.init_process_group(
                        backend=backend, timeout=timedelta(seconds=TRAINING_GROUP_TIMEOUT_SECONDS)
                    )
                return dist.new_group(
                    backend="gloo", timeout=timedelta(seconds=CHECKPOINT_GROUP_TIMEOUT_SECONDS)
                )
            except Exception as exc:  # a peer that left, or never answered, while they met
                raise CollectiveError("joining the process groups", world.rank, exc) from exc

        self.checkpoint = join() if abandon is None else _join_unless(join, abandon, world.rank)

    def agree(self, what: str, error: str | None) -> None:
        """Every rank says whether its part of ``what`` worked; all raise if any did not."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world.world_size
        try:
            dist.all_gather_object(gathered, error, group=self.checkpoint)
        except Exception as exc:
            raise CollectiveError(what, self.world.rank, exc) from exc
        failures = {rank: str(e) for rank, e in enumerate(gathered) if e is not None}
        if failures:
            raise PeerRankError(what, failures)

    def broadcast(self, what: str, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (over the checkpoint group)."""
        import torch.distributed as dist

        box = [value if self.world.leader else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.checkpoint)
        except Exception as exc:
            raise CollectiveError(what, self.world.rank, exc) from exc
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _join_unless(join: Callable[[], Any], abandon: Callable[[], bool], rank: int) -> Any:
    """``join()`` on a helper thread; the main thread stays free to see a stop and leave."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["groups"] = join()
        except BaseException as exc:  # re-raised on the main thread
            result["error"] = exc

    # A daemon: a join given up must not keep the process from exiting.
    thread = threading.Thread(target=run, name=f"tracks-join-rank-{rank}", daemon=True)
    started = time.monotonic()
    thread.start()
    while thread.is_alive():
        thread.join(JOIN_POLL_SECONDS)
        if thread.is_alive() and abandon():
            raise JoinAbandoned(rank, time.monotonic() - started)
    if "error" in result:
        raise result["error"]
    return result["groups"]
