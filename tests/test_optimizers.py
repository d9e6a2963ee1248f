"""Tracks' optimizers are torch.optim's, bit for bit, without importing TorchDynamo.

Same updates, same state_dict (a checkpoint written by either loads into the other and the run
goes on identically), the step hooks the async checkpoint relies on, torch's LR schedulers; and
a fresh interpreter that builds, steps, saves and loads one never imports ``torch._dynamo``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pipeline.trainer import optimizers
from tests.trainer_support import REPO

OPTIONS: dict[str, tuple[type[torch.optim.Optimizer], type[torch.optim.Optimizer], dict]] = {
    "adam": (torch.optim.Adam, optimizers.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, optimizers.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    restored: tuple[dict, dict] | None = None,
) -> tuple[list[float], dict]:
    """Train ``steps`` under an LR schedule; ``restored``: the optimizer's and the schedule's
    states to go on from, loaded after both are built, as the trainer restores a checkpoint.
    The losses and the schedule's state after them."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    if restored is not None:
        optimizer.load_state_dict(restored[0])
        scheduler.load_state_dict(restored[1])
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(16, 6, generator=generator)
        targets = torch.randint(3, (16,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses, scheduler.state_dict()


def _same_tensors(left: object, right: object) -> bool:
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and torch.equal(left, right)
    if isinstance(left, dict):
        return (
            isinstance(right, dict)
            and left.keys() == right.keys()
            and all(_same_tensors(left[k], right[k]) for k in left)
        )
    if isinstance(left, list):
        return (
            isinstance(right, list)
            and len(left) == len(right)
            and all(_same_tensors(a, b) for a, b in zip(left, right, strict=True))
        )
    return left == right


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_updates_and_the_state_dict_are_torchs_bit_for_bit(name: str) -> None:
    theirs_class, ours_class, options = OPTIONS[name]
    theirs_model, ours_model = _model(), _model()
    theirs = theirs_class(theirs_model.parameters(), **options)
    ours = ours_class(ours_model.parameters(), **options)
    assert isinstance(ours, theirs_class)  # what the LR schedulers and type checks ask for
    assert _train(theirs_model, theirs, range(12))[0] == _train(ours_model, ours, range(12))[0]
    for mine, reference in zip(ours_model.parameters(), theirs_model.parameters(), strict=True):
        assert torch.equal(mine, reference)
    assert _same_tensors(ours.state_dict(), theirs.state_dict())


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("direction", ["torch's into ours", "ours into torch's"])
def test_a_state_dict_of_either_resumes_in_the_other_identically(name: str, direction: str) -> None:
    theirs_class, ours_class, options = OPTIONS[name]
    writer, reader = theirs_class, ours_class
    if direction == "ours into torch's":
        writer, reader = ours_class, theirs_class
    # The uninterrupted run, then the same run saved at step 6 and resumed by the other class.
    whole_model = _model()
    _train(whole_model, writer(whole_model.parameters(), **options), range(12))
    first_model = _model()
    first = writer(first_model.parameters(), **options)
    _, schedule = _train(first_model, first, range(6))
    saved_model, saved_optimizer = first_model.state_dict(), first.state_dict()
    resumed_model = _model()
    resumed_model.load_state_dict(saved_model)
    resumed = reader(resumed_model.parameters(), **options)
    _train(resumed_model, resumed, range(6, 12), (saved_optimizer, schedule))
    for mine, reference in zip(resumed_model.parameters(), whole_model.parameters(), strict=True):
        assert torch.equal(mine, reference)


def test_step_hooks_run_around_each_step_as_torchs_do() -> None:
    model = _model()
    optimizer = optimizers.Adam(model.parameters(), lr=0.01)
    seen: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))
    optimizer.register_step_post_hook(lambda *_: seen.append("post"))
    _train(model, optimizer, range(2))
    assert seen == ["pre", "post", "pre", "post"]


def test_a_fresh_interpreter_using_them_never_imports_dynamo() -> None:
    probe = (
        "import sys, torch\n"
        "from pipeline.trainer import optimizers\n"
        "from tests.test_optimizers import _model, _train\n"
        "for make in (optimizers.Adam, optimizers.SGD):\n"
        "    model = _model()\n"
        "    optimizer = make(model.parameters(), lr=0.01)\n"
        "    _train(model, optimizer, range(3))\n"
        "    optimizer.load_state_dict(optimizer.state_dict())\n"
        "compiler = ('torch._dynamo', 'torch._inductor')\n"
        "print(sorted(m for m in sys.modules if m.startswith(compiler)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
