"""Snapshots are dynamic partitions: one per content-addressed data snapshot."""

import dagster as dg

snapshot_partitions = dg.DynamicPartitionsDefinition(name="snapshots")
