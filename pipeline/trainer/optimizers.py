"""torch.optim's Adam and SGD, without the import of TorchDynamo that their first use costs.

``torch.optim.Optimizer`` marks ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` with ``torch._disable_dynamo``, and each optimizer's ``step`` with
``_use_grad_for_differentiable``, so that ``torch.compile`` leaves them alone; both import
``torch._dynamo`` on their first call. That import is 1.0-1.6 CPU-seconds (measured 2026-11-27 on
the 2-vCPU VM, torch 2.13: as much as importing torch itself), paid by every trainer process,
every rank, every resume after a preemption, for a compiler that Tracks never runs.

The classes below are torch's own, subclassed: the same ``__init__``, the same update functions
(``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``), the same ``state_dict`` format, the same
step hooks and LR schedulers. Only the five methods are replaced by the functions those
decorators wrap (``functools.wraps`` keeps each as ``__wrapped__``), and ``step`` runs under
``torch.no_grad()``, which is what ``_use_grad_for_differentiable`` does for an optimizer that
is not differentiable (Tracks' never are), less its ``torch._dynamo.graph_break()`` calls
(no-ops outside a compiled region). A torch whose methods are not wrapped so gives its own
methods back: correct, and only slower to start.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

_BASE = torch.optim.Optimizer


def _unwrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """The function under torch's decorators (and under the step hooks' wrapper, which
    ``Optimizer.__init__`` puts on each class's ``step`` and puts back on ours)."""
    return inspect.unwrap(method)


def _eager_step(step: Callable[..., Any]) -> Callable[..., Any]:
    update = _unwrapped(step)

    def eager_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        with torch.no_grad():
            return update(self, closure)

    eager_step.__doc__ = update.__doc__
    return eager_step


class _WithoutDynamo:
    """The base class's methods without their decorators (a mixin before torch's class)."""

    add_param_group = _unwrapped(_BASE.add_param_group)
    zero_grad = _unwrapped(_BASE.zero_grad)
    state_dict = _unwrapped(_BASE.state_dict)
    load_state_dict = _unwrapped(_BASE.load_state_dict)


class Adam(_WithoutDynamo, torch.optim.Adam):
    """``torch.optim.Adam``, bit for bit, that does not import ``torch._dynamo``."""

    step = _eager_step(torch.optim.Adam.step)  # type: ignore[assignment]


class SGD(_WithoutDynamo, torch.optim.SGD):
    """``torch.optim.SGD``, bit for bit, that does not import ``torch._dynamo``."""

    step = _eager_step(torch.optim.SGD.step)  # type: ignore[assignment]
