"""The flat gradient buffer (pipeline/trainer/gradients.py): the same training, a cheaper norm."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.trainer.gradients import GradientBuffer, GradientBufferError
from pipeline.trainer.model import DigitsCNN
from pipeline.trainer.optimizers import Adam


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(32, 1, 8, 8, generator=generator), torch.randint(
        0, 10, (32,), generator=generator
    )


def _train(steps: int, *, buffered: bool) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = DigitsCNN(dropout=0.1)
    optimizer = Adam(model.parameters(), lr=0.01, weight_decay=1e-4)
    gradients = GradientBuffer(optimizer) if buffered else None
    norms = []
    for step in range(steps):
        if gradients is not None:
            gradients.zero()
        else:
            optimizer.zero_grad(set_to_none=True)
        inputs, targets = _batch(step)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        if gradients is not None:
            gradients.check_bound()
            norms.append(gradients.norm())
        else:
            norms.append(
                torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])
                ).item()
            )
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms


def test_training_through_the_buffer_gives_the_same_weights_bit_for_bit() -> None:
    buffered, buffered_norms = _train(30, buffered=True)
    plain, plain_norms = _train(30, buffered=False)
    assert all(torch.equal(a, b) for a, b in zip(buffered, plain, strict=True))
    # The norm is one dot product rather than a norm of norms: equal to float32 rounding.
    for got, expected in zip(buffered_norms, plain_norms, strict=True):
        assert math.isclose(got, expected, rel_tol=1e-5), (got, expected)


def test_the_norm_spans_every_dtype_and_leaves_frozen_parameters_alone() -> None:
    wide = torch.nn.Parameter(torch.tensor([3.0], dtype=torch.float64))
    narrow = torch.nn.Parameter(torch.tensor([4.0, 0.0]))
    frozen = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    optimizer = torch.optim.SGD([wide, narrow, frozen], lr=0.1)
    gradients = GradientBuffer(optimizer)
    (wide.sum() + narrow.sum() * 2).backward()  # gradients 1 and (2, 2): norm 3
    assert frozen.grad is None
    assert gradients.norm() == 3.0
    gradients.zero()
    assert gradients.norm() == 0.0
    narrow.grad.add_(float("inf"))  # type: ignore[union-attr]
    assert gradients.norm() == math.inf


def test_a_gradient_set_aside_is_caught_before_its_norm_is_trusted() -> None:
    model = DigitsCNN()
    optimizer = Adam(model.parameters(), lr=0.01)
    gradients = GradientBuffer.of(optimizer, None)
    assert GradientBuffer.of(optimizer, gradients) is gradients  # bound once per optimizer
    optimizer.zero_grad(set_to_none=True)  # what the buffer replaces: the views are gone
    inputs, targets = _batch(0)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    with pytest.raises(GradientBufferError, match="not a view of the gradient buffer"):
        gradients.check_bound()
