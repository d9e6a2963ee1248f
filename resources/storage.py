"""Where landing files, snapshots, checkpoints and scratch files live."""

from __future__ import annotations

from pathlib import Path

import dagster as dg


class StorageResource(dg.ConfigurableResource):
    """Local folders under ``TRACKS_HOME`` by default."""

    landing_root: str
    snapshot_root: str
    checkpoint_root: str
    work_root: str

    def landing(self) -> Path:
        return Path(self.landing_root)

    def snapshots(self) -> Path:
        return Path(self.snapshot_root)

    def checkpoints(self) -> Path:
        return Path(self.checkpoint_root)

    def work_dir(self, *parts: str) -> Path:
        path = Path(self.work_root, *parts)
        path.mkdir(parents=True, exist_ok=True)
        return path
