"""A trainer that resumes at ``max_steps`` trains nothing, and every record says so alike.

Its ``attempt_finished`` event (stdout, or a Pipes log line: the same event), its last words,
and the ledger's attempt (self-owned: begun by the trainer; orchestrated: closed by the
orchestrator from those last words) all carry one sentence: the final checkpoint was already
committed, nothing left to train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.ledger import Ledger
from pipeline.trainer import exit_codes
from pipeline.trainer.attempt import last_words_path
from tests.trainer_support import REPO, Trainer, parse_events, write_config

STEPS = 6


def _nothing_left(final: Path) -> str:
    return (
        f"The final checkpoint (step {STEPS}) was already committed at {final}; "
        "nothing left to train."
    )


def test_a_self_owned_trainer_with_nothing_left_to_train_records_its_attempt(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "config", snapshot_dir, max_steps=STEPS, checkpoint_every_steps=3
    )
    store, url = (tmp_path / "store").resolve(), f"sqlite:///{tmp_path / 'ledger.db'}"
    assert Trainer(config, store, "done", "--ledger-url", url).wait().returncode == 0
    again = Trainer(config, store, "done", "--ledger-url", url).wait()
    assert again.returncode == exit_codes.SUCCEEDED, again.stderr
    final = store / "done" / f"step-{STEPS:010d}-a01"
    said = _nothing_left(final)
    finished = again.events[-1]
    assert finished["event"] == "attempt_finished"
    assert (finished["attempt_no"], finished["reason"], finished["detail"]) == (
        2,
        "succeeded",
        said,
    )
    assert finished["step"] == STEPS and again.committed() == [] and again.losses() == {}
    attempt = Ledger.open(url).get_attempt("done", 2)
    assert (attempt.termination_reason, attempt.exit_code) == ("succeeded", 0)
    assert attempt.termination_detail == said
    assert attempt.resumed_from_checkpoint == str(final) and attempt.last_step == STEPS
    words = json.loads(last_words_path(store, "done", 2).read_text())
    assert (words["reason"], words["detail"], words["step"]) == ("succeeded", said, STEPS)


def test_an_orchestrated_attempt_with_nothing_left_to_train_says_so_on_its_receipt(
    tracks_home: Path,
) -> None:
    """The run succeeded; a person launches it again (admitted: it ends at once). The receipt
    the orchestrator closes says what the trainer said, not that it committed a checkpoint."""
    from pipeline.attempts import finish_attempt, prepare_attempt
    from pipeline.data.landing import write_digits_landing
    from pipeline.data.snapshot import create_snapshot
    from pipeline.settings import TracksSettings
    from pipeline.trainer.config import TrainConfig

    settings = TracksSettings.from_env()
    settings.ensure_dirs()
    ledger = Ledger.open(settings.ledger_url)
    write_digits_landing(settings.landing_root)
    snapshot = create_snapshot(settings.landing_root, settings.snapshot_root)
    config = TrainConfig.from_dict(
        {
            "seed": 0, "max_steps": STEPS, "checkpoint_every_steps": 3, "batch_size": 32,
            "learning_rate": 0.01, "optimizer": "adam", "model": {"channels": 4, "hidden": 16},
            "snapshot_dir": str(snapshot.path),
        },
        source="test",
    )  # fmt: skip
    store = settings.checkpoint_root.resolve()
    run_id = None
    events: list[dict] = []
    for _ in range(2):
        prepared = prepare_attempt(
            ledger, snapshot=snapshot, train_config=config, work_root=settings.work_root,
            run_id=run_id,
        )  # fmt: skip
        run_id = prepared.run.run_id
        process = subprocess.run(
            [sys.executable, "-m", "pipeline.trainer", *prepared.trainer_args(store)],
            cwd=REPO, env={**os.environ, **prepared.trainer_env(ledger.url)},
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert process.returncode == exit_codes.SUCCEEDED, process.stderr[-3000:]
        events = parse_events(process.stdout)
        finished = finish_attempt(
            ledger, prepared, store=store, returncode=process.returncode, signal_name=None
        )
    assert run_id is not None and prepared.attempt.attempt_no == 2
    said = _nothing_left(store / run_id / f"step-{STEPS:010d}-a01")
    assert events[-1]["event"] == "attempt_finished" and events[-1]["detail"] == said
    assert finished.termination.reason == "succeeded"
    assert finished.termination.detail == said
    assert ledger.get_attempt(run_id, 2).termination_detail == said
