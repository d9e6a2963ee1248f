"""Sensors, schedules and jobs."""

from sensors.jobs import materialize_snapshot, train_evaluate_promote

__all__ = ["materialize_snapshot", "train_evaluate_promote"]
