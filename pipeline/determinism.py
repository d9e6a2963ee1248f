"""Deterministic kernels for the trainer and the restore check, without importing Inductor.

``torch.use_deterministic_algorithms(True)`` sets two flags: ATen's, which decides which
kernels eager PyTorch runs, and Inductor's (``torch._inductor.config.deterministic``), which
only ``torch.compile`` reads. Setting the second imports ``torch._inductor``, which imports
dynamo and sympy: 1.5-2.1 s of CPU in every process on a 2-vCPU VM, more than the rest of a
trainer's set-up and paid again by every resume after a preemption. Nothing in Tracks compiles,
so the ATen flag is the one that matters; Inductor's is set too when something has already
imported it, so a process that does compile still gets what the public call gives.
"""

from __future__ import annotations

import sys

import torch


def use_deterministic_kernels() -> None:
    """Make every eager kernel deterministic, or raise when an op has no deterministic one."""
    set_flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_flag is None:  # a torch without the private setter: pay for the import
        torch.use_deterministic_algorithms(True)
        return
    set_flag(True, warn_only=False)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True
