"""`tracks reproduce EVALUATION_ID`: a text-lm generation evaluation re-run from its record.

A tiny TextLM trained in-process, committed as a checkpoint, evaluated by the registered
generation evaluator through run_evaluation (ledger row, MLflow run, raw outputs); then the
command re-runs it from the ledger row and the raw outputs it vouches for. Each provenance
input is tampered with in turn in the stored record, and the command names it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.evaluation import run_evaluation
from pipeline.evaluation.artifacts import SAMPLES_TABLE
from pipeline.ledger import EvaluationRecord, Ledger
from pipeline.ledger import schema as ledger_schema
from tests.evaluation_support import (
    TextWorld,
    World,
    open_ledger,
    shared_world,
    text_config,
    text_world,
    write_checkpoint,
)

RUN_ID = "run-text-reproduce"


@dataclass(frozen=True)
class Evaluated:
    world: World
    ledger_url: str
    ledger: Ledger
    record: EvaluationRecord  # generation_judged
    heldout: EvaluationRecord  # heldout_bits_per_byte: nothing generated, nothing to re-run


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Evaluated:
    world = shared_world(tmp_path_factory.getbasetemp())
    text: TextWorld = text_world(tmp_path_factory.getbasetemp())
    base = tmp_path_factory.mktemp("reproduce")
    ledger_url = f"sqlite:///{base / 'ledger.db'}"
    ledger = open_ledger(base / "ledger.db", text.snapshot.snapshot_id, RUN_ID, family="text-lm")
    checkpoint = write_checkpoint(
        base / "checkpoints", text.trained_state, run_id=RUN_ID, config=text_config()
    )
    record = run_evaluation(
        checkpoint_dir=checkpoint,
        snapshot=text.snapshot,
        ledger=ledger,
        settings=world.settings,
        evaluator="generation_judged",
        run_id=RUN_ID,
        attempt_no=1,
    )
    heldout = run_evaluation(
        checkpoint_dir=checkpoint,
        snapshot=text.snapshot,
        ledger=ledger,
        settings=world.settings,
        evaluator="heldout_bits_per_byte",
        run_id=RUN_ID,
        attempt_no=1,
    )
    return Evaluated(world, ledger_url, ledger, record, heldout)


def _reproduce(evaluated: Evaluated, evaluation_id: str) -> Any:
    env = {
        "TRACKS_HOME": str(evaluated.world.settings.home),
        "TRACKS_LEDGER_URL": evaluated.ledger_url,
        "TRACKS_MLFLOW_URI": evaluated.world.settings.mlflow_tracking_uri,
        "TRACKS_MLFLOW_ARTIFACTS": str(evaluated.world.settings.mlflow_artifact_root),
        "TRACKS_SNAPSHOTS": str(evaluated.world.settings.snapshot_root),
    }
    return CliRunner().invoke(main, ["reproduce", evaluation_id], env=env)


@pytest.fixture
def stored(evaluated: Evaluated) -> Iterator[dict[str, Any]]:
    """The ledger row's provenance, to tamper with; put back as it was afterwards."""
    original = copy.deepcopy(evaluated.record.provenance)
    yield copy.deepcopy(original)
    _store(evaluated, original)


def _store(evaluated: Evaluated, provenance: dict[str, Any]) -> None:
    t = ledger_schema.evaluations
    with evaluated.ledger.engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.evaluation_id == evaluated.record.evaluation_id)
            .values(provenance=provenance)
        )


def test_the_untouched_record_reproduces_identically(evaluated: Evaluated) -> None:
    record = evaluated.record
    provenance = record.provenance
    # What the record holds: every input named, with the judge and the decoding it used.
    assert provenance["judge"]["digest"].startswith("sha256:")
    assert record.judge_model == provenance["judge"]["judge_model"]
    assert provenance["decoding_params"]["sampled"]["temperature"] > 0
    assert provenance["decoding_params"]["greedy"]["temperature"] == 0
    assert provenance["not_applicable"] == {}
    # Every sample is a row of the MLflow table on the evaluation's run.
    samples = json.loads(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=record.mlflow_run_id,
                artifact_path=SAMPLES_TABLE,
                tracking_uri=evaluated.world.settings.mlflow_tracking_uri,
            )
        ).read_text()
    )
    assert len(samples["data"]) == 48 and {"output", "seed", "score"} <= set(samples["columns"])
    result = _reproduce(evaluated, record.evaluation_id)
    assert result.exit_code == 0, result.output
    assert f"{record.evaluation_id}: identical: 16 greedy outputs byte-identical, 32 sampled" in (
        result.output
    )


def _set(tree: dict[str, Any], dotted: str, change: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        tree = tree[key]
    tree[keys[-1]] = change(tree[keys[-1]])


@pytest.mark.parametrize(
    ("tampered", "change"),
    [
        ("prompt_set.digest", lambda v: "sha256:" + "0" * 64),
        ("template.text", lambda v: "Q: {prompt}"),
        ("decoding_params.sampled.temperature", lambda v: 0.5),
        ("judge.digest", lambda v: v[:-4] + "beef"),
        ("decoding_params.seed", lambda v: v + 1),
    ],
    ids=["prompt_set", "template", "decoding_parameter", "judge", "seed"],
)
def test_a_tampered_input_is_named(
    evaluated: Evaluated, stored: dict[str, Any], tampered: str, change: Any
) -> None:
    _set(stored, tampered, change)
    _store(evaluated, stored)
    result = _reproduce(evaluated, evaluated.record.evaluation_id)
    assert result.exit_code == 1, result.output
    assert "not reproduced" in result.output
    assert f"input(s) differ: {tampered}: recorded" in result.output, result.output
    if tampered.startswith("decoding_params"):
        # Re-generated under the tampered record, the sampled outputs change too.
        assert ".output_sha256: recorded" in result.output


def test_a_record_lacking_a_field_is_incomplete(
    evaluated: Evaluated, stored: dict[str, Any]
) -> None:
    del stored["judge"]
    _store(evaluated, stored)
    result = _reproduce(evaluated, evaluated.record.evaluation_id)
    assert result.exit_code == 1
    assert "incomplete record, missing judge.digest" in result.output


def test_an_unknown_or_unreproducible_evaluation_is_one_clear_line(evaluated: Evaluated) -> None:
    result = _reproduce(evaluated, "eval-generation_judged-000000000000")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: evaluation 'eval-generation_judged-000000000000' is not in the ledger"
    ]
    assert "Traceback" not in result.output

    result = _reproduce(evaluated, evaluated.heldout.evaluation_id)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: evaluation {evaluated.heldout.evaluation_id}: is a heldout_bits_per_byte "
        "evaluation; reproduce re-runs generation_judged evaluations (their outputs are "
        "generated, so they are what can differ)"
    ]
