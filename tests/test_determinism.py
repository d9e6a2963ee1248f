"""Deterministic kernels without importing Inductor (pipeline/determinism.py)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
import torch
{before}
from pipeline.determinism import use_deterministic_kernels
use_deterministic_kernels()
inductor = sys.modules.get("torch._inductor.config")
print(json.dumps({{
    "aten": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    # ATen's flag at work on a CPU: fresh memory is filled (NaN), not left as it was.
    "empty_is_nan": bool(torch.empty(64).isnan().all()),
    "inductor_imported": inductor is not None,
    "inductor_deterministic": getattr(inductor, "deterministic", None),
}}))
"""


def _probe(before: str = "") -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_eager_kernels_are_deterministic_and_inductor_is_not_imported() -> None:
    flags = _probe()
    assert flags["aten"] is True and flags["warn_only"] is False
    assert flags["empty_is_nan"] is True
    assert flags["inductor_imported"] is False


def test_a_process_that_imported_inductor_gets_its_flag_too() -> None:
    flags = _probe("import torch._inductor.config")
    assert flags["aten"] is True
    assert flags["inductor_imported"] is True and flags["inductor_deterministic"] is True
