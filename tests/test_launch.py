"""Who launched a Dagster run, read from the tags Dagster and Tracks' launchers leave."""

from __future__ import annotations

import pytest

from assets.launch import launched_by


@pytest.mark.parametrize(
    ("tags", "via"),
    [
        ({"dagster/sensor_name": "resume_after_preemption"}, "sensor:resume_after_preemption"),
        ({"dagster/schedule_name": "nightly_retrain"}, "schedule:nightly_retrain"),
        ({"dagster/backfill": "abcd"}, "backfill:abcd"),
        ({"tracks/launched_by": "cli:tracks demo"}, "cli:tracks demo"),
        (
            {"tracks/launched_by": "canary", "dagster/sensor_name": "x"},
            "canary",
        ),
        ({}, "ui"),
    ],
)
def test_launched_by_reads_the_evidence(tags: dict[str, str], via: str) -> None:
    assert launched_by(tags)["via"] == via


def test_the_user_and_the_continued_attempt_are_kept() -> None:
    found = launched_by(
        {"dagster/sensor_name": "resume_after_preemption", "tracks/continues_attempt": "2",
         "tracks/rule": "preempted", "user": "ana"}
    )  # fmt: skip
    assert found == {
        "via": "sensor:resume_after_preemption", "user": "ana", "continues_attempt": "2",
        "rule": "preempted",
    }  # fmt: skip
