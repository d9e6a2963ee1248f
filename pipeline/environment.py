"""Where an attempt ran and with what software: the placement and container digest of a receipt."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline import envvars
from pipeline.digests import sha256_json


@functools.cache
def container_digest() -> str:
    """The image digest when running in a container, else a digest of the installed distributions.

    Kubernetes deployments pass the image digest in ``TRACKS_IMAGE_DIGEST``; the trainer pods
    Tracks renders carry ``TRACKS_IMAGE``, which identifies the software only when it is pinned
    by digest (a tag names different images over time). Outside a container the locked
    environment is what identifies the software.
    """
    image = envvars.TRACKS_IMAGE_DIGEST.get()
    if image:
        return image
    reference = envvars.TRACKS_IMAGE.get() or ""
    if "@sha256:" in reference:
        return reference.rsplit("@", 1)[1]
    dists = sorted(
        {
            (d.metadata["Name"].lower(), d.version)
            for d in metadata.distributions()
            if d.metadata["Name"]
        }
    )
    return "env:sha256:" + sha256_json(dists)[:64]


def code_commit(repo: str | Path | None = None) -> str | None:
    """The git commit of the code, from ``TRACKS_CODE_COMMIT`` or the working tree."""
    if commit := envvars.TRACKS_CODE_COMMIT.get():
        return commit
    cwd = Path(repo) if repo else Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    if out.returncode != 0 or not commit:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=5,
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def placement(world_size: int = 1) -> dict[str, Any]:
    """Host, pod and node (Kubernetes downward API when present), accelerators and versions.

    The drill hooks set in this process's environment are recorded too (``fault_hooks``).
    """
    import torch

    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        # TRACKS_*: what the trainer manifests Tracks renders set (pipeline/kube/render.py);
        # the plain names: what a hand-written pod spec usually sets through the downward API.
        "pod": envvars.TRACKS_POD_NAME.get() or _first_env("POD_NAME", "HOSTNAME_POD"),
        "node": envvars.TRACKS_NODE_NAME.get() or _first_env("NODE_NAME"),
        "namespace": envvars.TRACKS_POD_NAMESPACE.get() or _first_env("POD_NAMESPACE"),
        "accelerator_type": torch.cuda.get_device_name(0) if cuda else "cpu",
        "accelerator_count": torch.cuda.device_count() if cuda else 0,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "world_size": world_size,
        "cpu_count": os.cpu_count(),
        "fault_hooks": fault_hooks(),
    }


def fault_hooks(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The drill hooks (``TRACKS_FAULT_*``) set in this process's environment, by name.

    Recorded with the attempt's placement: a receipt of a drilled attempt says so, since the
    hooks pause, slow or break the trainer on purpose.
    """
    return envvars.drill_hooks_set(env)


def _first_env(*names: str) -> str | None:
    return next((value for name in names if (value := os.environ.get(name))), None)
