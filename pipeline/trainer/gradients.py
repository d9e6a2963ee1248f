"""The parameters' gradients as views into one flat tensor per device and dtype.

A contiguous gradient buffer, as DDP's ``gradient_as_bucket_view``, Megatron-LM and DeepSpeed
keep one: each parameter's ``.grad`` is a view into a flat tensor that lives as long as the
optimizer. Zeroing the gradients is then one kernel, backward accumulates into the views in
place (``0 + g`` is ``g``), and the global gradient norm the spike detector judges is one
reduction over each flat tensor instead of one per parameter. Measured on the demo config's
2-vCPU CPU step: the per-parameter norm cost 350 us a step after backward, this one 90 us
(bench/results/2026-11-28-health-cost.md).

What changes against ``zero_grad(set_to_none=True)``: a parameter that took no part in a
step's forward has a zero gradient rather than none, so the optimizer visits it (Adam's moments
decay, weight decay applies). Tracks' model families use every parameter in every step.

Among ranks the buffer is also what is averaged: pipeline/trainer/averaging.py cuts it into
buckets (:meth:`GradientBuffer.buckets`) and all-reduces each as backward fills it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

import torch

T = TypeVar("T", bound=torch.Tensor)
# The dtypes whose squares are summed as they are (others are widened to float32 first).
_WIDE = (torch.float32, torch.float64)


class GradientBuffer:
    """Binds the gradients of an optimizer's parameters to flat buffers, once."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # A frozen parameter keeps no gradient: the optimizer must go on passing it by.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        groups = by_device_and_dtype(params)
        self._flats: list[torch.Tensor] = []
        # Each flat's parameters, in its order, with where each one's gradient starts in it.
        self._members: list[tuple[tuple[torch.nn.Parameter, int], ...]] = []
        for (device, dtype), members in groups.items():
            flat = torch.zeros(sum(p.numel() for p in members), device=device, dtype=dtype)
            offset, placed = 0, []
            for param in members:
                # A view with the parameter's shape and (contiguous) strides: the layout
                # autograd would give a fresh gradient, so backward accumulates into it.
                param.grad = flat[offset : offset + param.numel()].view_as(param)
                placed.append((param, offset))
                offset += param.numel()
            self._flats.append(flat)
            self._members.append(tuple(placed))
        self._params = tuple(params)
        self._checked = False
        # The common case, one float32 or float64 flat: its norm without a loop (the norm runs
        # after every backward, where each Python line is a cold cache's).
        only = self._flats[0] if len(self._flats) == 1 else None
        self._only = only if only is not None and only.dtype in _WIDE else None

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, current: GradientBuffer | None) -> GradientBuffer:
        """``current`` while it still serves ``optimizer``; else a new buffer bound to it."""
        if current is not None and current.optimizer is optimizer:
            return current
        return cls(optimizer)

    def zero(self) -> None:
        """Every gradient to zero, before the next backward."""
        for flat in self._flats:
            flat.zero_()

    def norm(self) -> float:
        """The global L2 norm of the gradients (inf or nan where any is not finite, or where
        the sum of squares overflows; 0.0 for an optimizer without parameters)."""
        only = self._only
        if only is not None:
            return math.sqrt(torch.dot(only, only).item())
        return math.sqrt(math.fsum(_squares(flat) for flat in self._flats))

    def buckets(self, max_bytes: int) -> list[tuple[torch.Tensor, tuple[torch.nn.Parameter, ...]]]:
        """The buffer cut into contiguous views of at most ``max_bytes`` (or of one parameter's
        gradient, where that alone is larger), each with the parameters whose gradients it
        holds: from each flat tensor's end to its start, the order backward fills them in."""
        out: list[tuple[torch.Tensor, tuple[torch.nn.Parameter, ...]]] = []
        for flat, members in zip(self._flats, self._members, strict=True):
            most = max(max_bytes // flat.element_size(), 1)  # elements a bucket may hold
            end, start, taken = flat.numel(), flat.numel(), []
            for param, offset in reversed(members):
                if taken and end - offset > most:
                    out.append((flat[start:end], tuple(taken)))
                    end, taken = start, []
                start = offset
                taken.append(param)
            if taken:
                out.append((flat[start:end], tuple(taken)))
        return out

    def check_bound(self) -> None:
        """Raise where a parameter's ``.grad`` is not a view of the buffer (something set it
        to None or replaced it): the norm would judge stale gradients. Checked once, after the
        first backward (the loop's and DDP's code paths are the same at every step)."""
        if self._checked:
            return
        for param in self._params:
            grad = param.grad
            if grad is None or not any(grad._base is flat for flat in self._flats):
                raise GradientBufferError(
                    f"the gradient of a {tuple(param.shape)} parameter is not a view of the "
                    "gradient buffer (replaced or set to None after it was bound): the "
                    "gradient norm would be stale"
                )
        self._checked = True


def by_device_and_dtype(tensors: Iterable[T]) -> dict[tuple[torch.device, torch.dtype], list[T]]:
    """``tensors`` grouped by where they live and what they hold, each group in their order:
    the tensors one flat tensor can hold."""
    groups: dict[tuple[torch.device, torch.dtype], list[T]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _squares(flat: torch.Tensor) -> float:
    """The sum of ``flat``'s squares: a dot product (one BLAS call, the cheapest reduction
    after backward: 90 us against vector_norm's 125 on the 2-vCPU VM), accumulated in float32
    at least."""
    wide = flat if flat.dtype in _WIDE else flat.float()
    return float(torch.dot(wide, wide).item())


class GradientBufferError(RuntimeError):
    """A parameter's gradient left the buffer it was bound to."""
