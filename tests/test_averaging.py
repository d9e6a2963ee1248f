"""The gradients' average over the ranks (pipeline/trainer/averaging.py), against DDP's.

Real ranks: each case starts two processes of tests/averaging_worker.py on a gloo group over
loopback, which train the same few Adam steps on their own slices of one batch and save their
final weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.trainer.gradients import GradientBuffer
from tests.dagster_dev import free_port

REPO = Path(__file__).resolve().parent.parent


def _train(tmp_path: Path, name: str, *flags: str) -> list[dict[str, torch.Tensor]]:
    """Both ranks' final weights (each rank's file), after a run with ``flags``."""
    port, outs = free_port(), [tmp_path / f"{name}-{rank}.pt" for rank in range(2)]
    ranks = []
    for rank in range(2):
        place = ["--rank", str(rank), "--world", "2", "--port", str(port)]
        command = [sys.executable, "-m", "tests.averaging_worker", *place, "--out", str(outs[rank])]
        command += flags
        ranks.append(
            subprocess.Popen(
                command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    for rank, process in enumerate(ranks):
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0, f"{name}: rank {rank} exited {process.returncode}:\n{err}"
    return [torch.load(out) for out in outs]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_average_is_ddps_bit_for_bit_in_one_bucket_or_many(tmp_path: Path) -> None:
    """Ranks that start from different weights end with the same ones, equal bit for bit to
    DDP's; cutting the buffer into 64-byte buckets (a bucket per parameter or two, started as
    backward fills them) changes no bit."""
    ddp = _train(tmp_path, "ddp", "--how", "ddp")
    one = _train(tmp_path, "one-bucket", "--how", "averager")
    many = _train(tmp_path, "many-buckets", "--how", "averager", "--bucket-bytes", "64")
    assert _same(ddp[0], ddp[1])
    for name, ranks in (("one bucket", one), ("64-byte buckets", many)):
        assert _same(ranks[0], ranks[1]), f"{name}: the ranks' weights differ"
        assert _same(ranks[0], ddp[0]), f"{name}: not DDP's weights"


def test_a_parameter_no_forward_used_is_averaged_as_zeros_and_the_rest_unchanged(
    tmp_path: Path,
) -> None:
    """A parameter outside forward: no hook starts its bucket; finish() starts it, so every
    rank launches the same all-reduces and the step does not hang. Its weights stay rank 0's
    (zero gradients move no Adam weight), and the others train as without it."""
    spare = _train(tmp_path, "spare", "--how", "averager", "--spare", "--bucket-bytes", "64")
    plain = _train(tmp_path, "plain", "--how", "averager", "--bucket-bytes", "64")
    assert _same(spare[0], spare[1])
    torch.manual_seed(0)
    from tests.averaging_worker import Net

    rank_zero = Net(8, spare=True).state_dict()
    assert torch.equal(spare[0]["spare.weight"], rank_zero["spare.weight"])
    body = {k: v for k, v in spare[0].items() if k.startswith("body.")}
    assert _same(body, plain[0])


def test_ranks_holding_different_models_are_refused_before_any_step(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"ModelMismatchError: rank [01]: the ranks' models"):
        _train(tmp_path, "mismatch", "--how", "averager", "--mismatch")


def test_buckets_cut_the_buffer_from_its_end_in_order() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    buffer = GradientBuffer(torch.optim.SGD(model.parameters(), lr=0.1))
    shapes = {
        cap: [(view.storage_offset(), view.numel(), [tuple(p.shape) for p in params])
              for view, params in buffer.buckets(cap)]
        for cap in (1, 48, 1000)
    }  # fmt: skip
    # One parameter's gradient per bucket where it alone is larger than the cap.
    assert shapes[1] == [(21, 2, [(2,)]), (15, 6, [(2, 3)]), (12, 3, [(3,)]), (0, 12, [(3, 4)])]
    assert shapes[48] == [(12, 11, [(2,), (2, 3), (3,)]), (0, 12, [(3, 4)])]
    assert shapes[1000] == [(0, 23, [(2,), (2, 3), (3,), (3, 4)])]
    for view, params in buffer.buckets(48):
        assert all(p.grad is not None and p.grad._base is view._base for p in params)
