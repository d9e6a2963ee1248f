"""Run config is input from whoever launches a run: what it may not change, it cannot.

Each case was reproduced on the landed main before the fix: ``overrides: "snapshot_dir: …"``
trained a continued run on another folder while its receipt named the partition's snapshot;
``model_family: ../x`` and ``purpose: bogus`` failed with an exception that named neither the
asset nor the key; a ``model_name`` that serving refuses was promoted under; and
``python_executable`` chose the program started with the ledger's credentials
(tests/test_launch_failure.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from definitions import build_definitions
from pipeline.data.landing import write_digits_landing
from pipeline.data.snapshot import create_snapshot
from pipeline.ledger import AttemptStart, Ledger
from pipeline.settings import TracksSettings
from pipeline.states import TerminationReason
from tests.checkpoint_support import (
    RUN_ID,
    checkpoint_manager,
    ledger_run,
    training_data,
    training_state,
)

pytestmark = pytest.mark.slow
RUN = "digits-cnn-continued"


def _training_alone(settings: TracksSettings, snapshot_id: str, config: dict[str, Any]) -> str:
    """Materialize training_attempt alone with ``config``; the step failure's message."""
    defs = build_definitions(settings)
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("snapshots", [snapshot_id])
        result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance,
            partition_key=snapshot_id,
            asset_selection=[dg.AssetKey("training_attempt")],
            run_config={"ops": {"training_attempt": {"config": config}}},
            raise_on_error=False,
        )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    return failure.event_specific_data.error.message


def _continued_run(ledger: Ledger, snapshot: Any) -> None:
    """A run of this snapshot whose one attempt was preempted: the next one continues it."""
    config = {"model_family": "digits-cnn", "seed": 0, "max_steps": 5,
              "snapshot_dir": str(snapshot.path.resolve())}  # fmt: skip
    ledger.create_run(
        run_id=RUN, model_family="digits-cnn", owner="ana", purpose="baseline",
        config_sha256="a" * 64, snapshot_id=snapshot.snapshot_id, code_commit="0123abcd",
    )  # fmt: skip
    ledger.begin_attempt(
        RUN,
        AttemptStart(
            config_snapshot=config, config_sha256="a" * 64,
            data_manifest_sha256=snapshot.manifest_sha256, container_digest="env:sha256:test",
            placement={"host": "test"},
        ),
    )  # fmt: skip
    ledger.end_attempt(
        RUN, 1, termination_reason=TerminationReason.PREEMPTED, termination_detail="SIGTERM"
    )


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"train": {"model_family": "../x"}}, "invalid model family '../x'"),
        ({"purpose": "bogus"}, "purpose: 'bogus' is not one of baseline"),
        (
            {"run_id": RUN, "train": {"model_family": "another"}},
            f"train.model_family: run {RUN} keeps its model_family",
        ),
    ],
)
def test_run_config_that_would_tell_a_wrong_story_is_refused_naming_the_key(
    tracks_home: Path, config: dict[str, Any], said: str
) -> None:
    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    write_digits_landing(settings.landing_root)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    ledger = Ledger.open(settings.ledger_url)
    _continued_run(ledger, snapshot)
    message = _training_alone(settings, snapshot.snapshot_id, config)
    assert said in message
    assert "run config of training_attempt" in message
    assert [a.attempt_no for a in ledger.list_attempts()] == [1]  # no attempt was opened


@pytest.mark.parametrize("name", ["a/b", "digits classifier", "../champion", ""])
def test_promotion_refuses_a_model_name_serving_could_never_load(tmp_path: Path, name: str) -> None:
    from pipeline import ids
    from pipeline.promotion import promote

    with pytest.raises(ids.InvalidIdError, match="invalid model name"):
        promote(
            ledger=Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}"),
            settings=TracksSettings.from_env({"TRACKS_HOME": str(tmp_path)}),
            run_id=RUN, attempt_no=1, checkpoint_dir=tmp_path / "nowhere",
            snapshot_id="digits-0123456789abcdef", model_name=name,
        )  # fmt: skip
    assert not (tmp_path / "mlflow.db").exists()  # refused before MLflow was touched


@pytest.mark.parametrize("tamper", [None, "manifest", "outside"])
def test_committed_checkpoint_states_what_it_verified_and_what_the_ledger_committed(
    tmp_path: Path, tracks_home: Path, tamper: str | None
) -> None:
    """The folder must verify, lie under the checkpoint store, and carry the manifest the
    ledger committed: a folder rewritten since, or a ledger row pointing elsewhere, would
    otherwise be stated as the run's checkpoint."""
    import shutil

    import sqlalchemy as sa

    from assets.training import committed_checkpoint
    from pipeline.ledger import schema
    from resources import LedgerResource, StorageResource

    run = ledger_run(tmp_path)
    manager = checkpoint_manager(
        tmp_path, ledger=run.ledger, attempt=run.attempt_no, token=run.token
    )
    saved = manager.save(training_state(training_data())).path
    run.ledger.end_attempt(
        RUN_ID, run.attempt_no, termination_reason=TerminationReason.SUCCEEDED,
        termination_detail="finished",
    )  # fmt: skip
    t = schema.checkpoints
    if tamper == "manifest":
        with run.ledger.engine.begin() as conn:
            conn.execute(sa.update(t).values(manifest_sha256="0" * 64))
    elif tamper == "outside":
        elsewhere = tmp_path / "elsewhere" / saved.name
        shutil.copytree(saved, elsewhere)
        with run.ledger.engine.begin() as conn:
            conn.execute(sa.update(t).values(path=str(elsewhere)))
    partition = "digits-0123456789abcdef"
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("snapshots", [partition])
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "training_attempt", partition=partition, metadata={"run_id": RUN_ID}
            )
        )
        result = dg.materialize(
            [committed_checkpoint],
            partition_key=partition,
            instance=instance,
            resources={
                "ledger": LedgerResource(url=f"sqlite:///{tmp_path / 'ledger.db'}"),
                "storage": StorageResource(
                    landing_root=str(tmp_path),
                    snapshot_root=str(tmp_path),
                    checkpoint_root=str(tmp_path / "store"),
                    work_root=str(tmp_path),
                ),
            },
            raise_on_error=False,
        )
    if tamper is None:
        assert result.success
        [materialization] = result.asset_materializations_for_node("committed_checkpoint")
        assert (
            materialization.metadata["manifest_sha256"].value
            == manager.last_committed.manifest_sha256
        )
        return
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    said = failure.event_specific_data.error.message
    assert ("not the checkpoint the run committed" if tamper == "manifest" else "outside") in said


def test_a_refused_run_config_leaves_no_password_in_dagsters_event_log(tracks_home: Path) -> None:
    """Dagster stores a failure's description and its Python cause chain as they are: both
    reach the UI. A value quoting a URL with its password is refused without showing it."""
    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    write_digits_landing(settings.landing_root)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    policy = "preempted: {backoff: {initial_seconds: 'postgresql://u:HUNTER2@db/x'}}"
    defs = build_definitions(settings)
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("snapshots", [snapshot.snapshot_id])
        result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance,
            partition_key=snapshot.snapshot_id,
            asset_selection=[dg.AssetKey("training_attempt")],
            run_config={"ops": {"training_attempt": {"config": {"retry_policy": policy}}}},
            raise_on_error=False,
        )
        events = instance.all_logs(result.run_id)
    assert not result.success
    logged = " ".join(str(e.dagster_event) for e in events if e.dagster_event)
    assert "retry_policy.preempted.backoff.initial_seconds" in logged
    assert "postgresql://u:***@db/x" in logged and "HUNTER2" not in logged
