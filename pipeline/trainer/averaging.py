"""Data parallelism's gradient average: bucket by bucket over the flat gradient buffer.

Every rank trains the same model on its own slice of the global batch; before the update the
gradients are averaged over the ranks, so every rank applies the same update. This is what
``torch.nn.parallel.DistributedDataParallel`` does, done here on the flat gradient buffer
(pipeline/trainer/gradients.py) as Megatron-LM's own DDP does it:

- at construction, every rank checks that it holds the same parameters (names, shapes, dtypes)
  as the others and takes rank 0's values (DDP's start-up broadcast);
- the buffer is cut into buckets of at most :data:`BUCKET_BYTES` (DDP's default 25 MiB), in the
  reverse of the parameters' order, the order backward produces their gradients;
- a hook on each parameter (``register_post_accumulate_grad_hook``) counts the gradients backward
  has finished; when a bucket's last one is in, the bucket is divided by the world size and its
  all-reduce (a sum) starts asynchronously, overlapped with the rest of backward;
- :meth:`GradientAverager.finish`, after backward, starts any bucket whose parameters took no
  part in this step's forward (their gradients are zeros) and waits for every all-reduce.

Why not DDP itself: its constructor reads ``torch._dynamo.utils.get_optimize_ddp_mode()``, which
imports TorchDynamo, a compiler Tracks never runs: 1.05 CPU-seconds in every rank of every
attempt, measured 2026-11-28 on the 2-vCPU VM, 2.1 of a two-rank attempt's 7.1, and about a
second of each rank's start-up before its first step (bench/results/2026-11-28-make-test.md).
The division before the sum is DDP's (it keeps a half-precision sum from overflowing), so the
averages are DDP's bit for bit (tests/test_averaging.py trains both side by side).

Every rank must launch the same all-reduces in the same order: the buckets are launched in the
order backward fills them, which is the same on every rank for the same model; the ones no hook
launched are launched by :meth:`finish` in bucket order.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from pipeline.distributed import CollectiveError
from pipeline.trainer.gradients import GradientBuffer, by_device_and_dtype

if TYPE_CHECKING:
    from pipeline.distributed.world import World

# DDP's default bucket_cap_mb: large enough that launching an all-reduce costs little beside
# it, small enough that the first buckets start while backward still has most of its work.
BUCKET_BYTES = 25 * 1024 * 1024


class ModelMismatchError(RuntimeError):
    """The ranks do not hold the same parameters: averaging their gradients would be wrong."""


class GradientAverager:
    """Averages a model's gradients over the ranks of ``world``, overlapped with backward."""

    def __init__(
        self, model: torch.nn.Module, world: World, *, bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.world = world
        self.bucket_bytes = bucket_bytes
        _check_same_model(model, world)
        _take_rank_zero_values(model)
        # For the process's life: the trainer builds one averager per attempt, per model.
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._gradient_ready)
        self._buffer: GradientBuffer | None = None
        self._buckets: tuple[torch.Tensor, ...] = ()
        self._bucket_of: dict[int, int] = {}  # id(parameter) -> its bucket
        self._sizes: tuple[int, ...] = ()  # parameters per bucket
        # Gradients each bucket still waits for: empty outside a prepared step.
        self._left: list[int] = []
        self._works: list[Any] = []  # each bucket's all-reduce, once started

    def prepare(self, buffer: GradientBuffer) -> None:
        """Before backward: this step's buckets, over ``buffer`` (cut again when it changes)."""
        if buffer is not self._buffer:
            self._buffer = buffer
            buckets = buffer.buckets(self.bucket_bytes)
            self._buckets = tuple(view for view, _ in buckets)
            self._sizes = tuple(len(params) for _, params in buckets)
            self._bucket_of = {
                id(param): index for index, (_, params) in enumerate(buckets) for param in params
            }
        self._left = list(self._sizes)
        self._works = [None] * len(self._buckets)

    def finish(self) -> None:
        """After backward: start the buckets no hook started, then wait for every all-reduce.

        Raises :class:`CollectiveError` where one fails (a peer rank gone)."""
        if self._buffer is None:
            raise RuntimeError("GradientAverager.finish() before prepare()")
        for index, work in enumerate(self._works):
            if work is None:
                self._start(index)
        self._left = []  # a backward from here to the next prepare() is refused
        try:
            for work in self._works:
                work.wait()
        except Exception as exc:
            raise CollectiveError("averaging the gradients", self.world.rank, exc) from exc

    def _gradient_ready(self, param: torch.Tensor) -> None:
        index = self._bucket_of.get(id(param))
        if index is None or not self._left:
            # A parameter the buffer does not hold, or a backward outside a prepared step:
            # finish() would average stale or missing gradients.
            raise RuntimeError(
                f"a gradient of a {tuple(param.shape)} parameter arrived outside the "
                "averaged step (GradientAverager.prepare() was not called with its buffer)"
            )
        self._left[index] -= 1
        if self._left[index] == 0:
            self._start(index)

    def _start(self, index: int) -> None:
        import torch.distributed as dist

        bucket = self._buckets[index]
        bucket.div_(self.world.world_size)
        self._works[index] = dist.all_reduce(bucket, async_op=True)


def _check_same_model(model: torch.nn.Module, world: World) -> None:
    """Raise :class:`ModelMismatchError` unless every rank holds the same parameters and
    buffers (names, shapes, dtypes): one all-reduce of a digest, as DDP checks at start-up."""
    import torch.distributed as dist

    named = [*model.named_parameters(), *model.named_buffers()]
    layout = ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in named)
    mine = int.from_bytes(hashlib.sha256(layout.encode()).digest()[:7], "big")
    digests = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(digests, op=dist.ReduceOp.MAX)
    if (int(digests[0]), -int(digests[1])) != (mine, mine):
        raise ModelMismatchError(
            f"rank {world.rank}: the ranks' models differ (parameter names, shapes or dtypes): "
            f"this rank's {len(named)} tensors are {layout[:300]}"
        )


def _take_rank_zero_values(model: torch.nn.Module) -> None:
    """Every rank's parameters and buffers become rank 0's: one broadcast per dtype and device."""
    import torch.distributed as dist

    groups = by_device_and_dtype([*model.parameters(), *model.buffers()])
    with torch.no_grad():
        for tensors in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            dist.broadcast(flat, src=0)
            offset = 0
            for tensor in tensors:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
