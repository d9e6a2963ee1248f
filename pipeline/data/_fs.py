"""Durability helpers shared by landing and snapshot writers (see :mod:`pipeline.durable`)."""

from pipeline.durable import fsync_dir, fsync_file

__all__ = ["fsync_dir", "fsync_file"]
