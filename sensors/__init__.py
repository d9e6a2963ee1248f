"""Sensors, schedules and jobs: how runs start without a person pressing a button."""

from sensors.canary import canary_job
from sensors.jobs import materialize_snapshot, train_evaluate_promote
from sensors.resume import resume_after_preemption
from sensors.schedules import nightly_retrain
from sensors.snapshots import new_snapshot

ALL_JOBS = [train_evaluate_promote, canary_job]
ALL_SENSORS = [resume_after_preemption, new_snapshot]
ALL_SCHEDULES = [nightly_retrain]

__all__ = ["ALL_JOBS", "ALL_SCHEDULES", "ALL_SENSORS", "materialize_snapshot"]
