"""Sensors, schedules and jobs: how runs start without a person pressing a button."""

from sensors.jobs import materialize_snapshot, train_evaluate_promote

ALL_JOBS = [train_evaluate_promote]
ALL_SENSORS: list = []
ALL_SCHEDULES: list = []

__all__ = ["ALL_JOBS", "ALL_SCHEDULES", "ALL_SENSORS", "materialize_snapshot"]
