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
        ({"tracks/launched_by": "canary"}, "canary"),
        ({}, "ui"),
    ],
)
def test_launched_by_reads_the_evidence(tags: dict[str, str], via: str) -> None:
    assert launched_by(tags)["via"] == via
    assert "claimed" not in launched_by(tags)


@pytest.mark.parametrize(
    ("tags", "via"),
    [
        # A run launched by hand, tagged as if the resume sensor had launched it.
        ({"tracks/launched_by": "sensor:resume_after_preemption"}, "ui"),
        ({"tracks/launched_by": "schedule:nightly_retrain"}, "ui"),
        # Dagster's daemon left its evidence: that wins over the tag.
        ({"tracks/launched_by": "cli:tracks demo", "dagster/sensor_name": "x"}, "sensor:x"),
        # A person re-executed a sensor's run: it inherits the sensor's tags.
        (
            {
                "tracks/launched_by": "sensor:new_snapshot",
                "dagster/sensor_name": "new_snapshot",
                "dagster/parent_run_id": "abcd",
            },
            "reexecution:abcd",
        ),
    ],
)
def test_a_tag_anyone_can_set_is_kept_as_a_claim_not_believed(
    tags: dict[str, str], via: str
) -> None:
    found = launched_by(tags)
    assert found["via"] == via
    assert found["claimed"] == tags["tracks/launched_by"]


def test_tag_values_are_cut_to_200_characters() -> None:
    found = launched_by({"tracks/launched_by": "x" * 10_000, "user": "u" * 10_000})
    assert len(found["via"]) == len(found["user"]) == 201


def test_the_user_and_the_continued_attempt_are_kept() -> None:
    found = launched_by(
        {"dagster/sensor_name": "resume_after_preemption", "tracks/continues_attempt": "2",
         "tracks/rule": "preempted", "user": "ana"}
    )  # fmt: skip
    assert found == {
        "via": "sensor:resume_after_preemption", "user": "ana", "continues_attempt": "2",
        "rule": "preempted",
    }  # fmt: skip
