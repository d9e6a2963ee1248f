"""One rank of tests/test_averaging.py: a few Adam steps on a small model, its gradients
averaged over the ranks by DDP or by Tracks' GradientAverager; the final weights go to a file.

    python -m tests.averaging_worker --rank R --world N --port P --how ddp|averager --out F
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.distributed import World
from pipeline.trainer.averaging import GradientAverager, ModelMismatchError
from pipeline.trainer.gradients import GradientBuffer
from pipeline.trainer.optimizers import Adam

STEPS, PER_RANK, FEATURES, CLASSES = 12, 5, 6, 3


class Net(torch.nn.Module):
    """Three layers; ``spare``, where asked for, takes no part in forward (its gradients stay
    zero, so no hook ever starts its bucket)."""

    def __init__(self, hidden: int, spare: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 8),
            torch.nn.ReLU(),
            torch.nn.Linear(8, CLASSES),
        )
        if spare:
            self.spare = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def model_for(rank: int, *, mismatch: bool, spare: bool) -> torch.nn.Module:
    torch.manual_seed(rank)  # every rank starts from other weights: rank 0's must win
    return Net(9 if mismatch and rank == 1 else 8, spare)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--how", choices=("ddp", "averager"), required=True)
    parser.add_argument("--bucket-bytes", type=int, default=25 * 1024 * 1024)
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--spare", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
    )
    model = model_for(args.rank, mismatch=args.mismatch, spare=args.spare)
    optimizer = Adam(model.parameters(), lr=0.01)
    gradients = GradientBuffer.of(optimizer, None)  # the trainer's layout under both
    forward, averager = model, None
    try:
        if args.how == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            forward = DistributedDataParallel(model)
        else:
            averager = GradientAverager(
                model, World(args.rank, args.world), bucket_bytes=args.bucket_bytes
            )
    except ModelMismatchError as exc:
        print(f"ModelMismatchError: {exc}", file=sys.stderr)
        return 3
    data = torch.Generator().manual_seed(123)
    rows = STEPS * PER_RANK * args.world
    inputs = torch.randn(rows, FEATURES, generator=data)
    targets = torch.randint(0, CLASSES, (rows,), generator=data)
    for step in range(STEPS):
        gradients.zero()
        if averager is not None:
            averager.prepare(gradients)
        first = (step * args.world + args.rank) * PER_RANK
        batch = slice(first, first + PER_RANK)
        F.cross_entropy(forward(inputs[batch]), targets[batch]).backward()
        gradients.check_bound()
        if averager is not None:
            averager.finish()
        optimizer.step()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
