"""The trainer on Kubernetes: a neutral :class:`TrainerSpec`, its manifests, and how pods end.

Framework-free (no Dagster): the Pipes client in ``resources/kube_pipes.py`` is the thin layer
that creates these objects and follows rank 0. See ``docs/kubernetes.md``.
"""

from __future__ import annotations

from pipeline.kube.render import (
    render,
    render_indexed_job,
    render_jobset,
    render_trainjob,
    to_yaml,
    write_manifests,
)
from pipeline.kube.spec import (
    Backend,
    InvalidTrainerSpecError,
    NodeResources,
    TrainerSpec,
    trainer_name,
)

__all__ = [
    "Backend",
    "InvalidTrainerSpecError",
    "NodeResources",
    "TrainerSpec",
    "render",
    "render_indexed_job",
    "render_jobset",
    "render_trainjob",
    "to_yaml",
    "trainer_name",
    "write_manifests",
]
