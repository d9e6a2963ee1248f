"""The text-lm promotion gate: every provenance field, no contaminated evaluation set, and the
family's own champion, compared document by document on held-out bits per byte.

Real text snapshots of the shipped corpus, tiny TextLMs trained in-process, evaluations through
run_evaluation (ledger, MLflow), promotions through promote; no mocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.data.snapshot import Snapshot, create_snapshot
from pipeline.evaluation import NOT_APPLICABLE, FamilyMismatchError, get_evaluator, run_evaluation
from pipeline.evaluation.evaluators import required_evaluators
from pipeline.ledger import EvaluationRecord, Ledger
from pipeline.promotion import promote
from pipeline.promotion.families import gate_for_family, registered_model_name
from pipeline.serving.champion import load_champion
from pipeline.states import PromotionDecision
from pipeline.textlm.columns import SPLIT_EVAL, SPLIT_TRAIN
from pipeline.textlm.corpus import Document
from pipeline.textlm.generation import DecodingParams, generate
from pipeline.textlm.landing import (
    documents_from_frame,
    read_text_snapshot_frame,
    write_text_landing,
)
from pipeline.textlm.model import build_model
from pipeline.textlm.tokenizer import TOKENIZER
from tests.evaluation_support import (
    TEXT_MODEL_CONFIG,
    TextWorld,
    World,
    manifest_sha256,
    open_ledger,
    record_committed,
    shared_world,
    text_config,
    text_world,
    write_checkpoint,
)
from tests.promotion_support import crown

TEXT_EVALUATORS = ("contamination", "generation_judged", "heldout_bits_per_byte")
DIGITS_MODEL = "digits-beside-text"


@dataclass(frozen=True)
class Setup:
    world: World
    text: TextWorld
    ledger: Ledger
    root: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    base = tmp_path_factory.getbasetemp()
    world, text = shared_world(base), text_world(base)
    root = tmp_path_factory.mktemp("text-gate")
    runs = ("run-text-weak", "run-text-strong", "run-text-dirty", "run-text-subset")
    ledger = open_ledger(root / "ledger.db", text.snapshot.snapshot_id, *runs, family="text-lm")
    return Setup(world, text, ledger, root)


def _checkpoint(setup: Setup, run_id: str, state) -> Path:
    checkpoint = write_checkpoint(
        setup.root / "checkpoints", state, run_id=run_id, config=text_config()
    )
    record_committed(setup.ledger, checkpoint, setup.text.snapshot.snapshot_id)
    return checkpoint


def _evaluate(setup: Setup, checkpoint: Path, run_id: str, snapshot: Snapshot):
    return {
        name: run_evaluation(
            checkpoint_dir=checkpoint,
            snapshot=snapshot,
            ledger=setup.ledger,
            settings=setup.world.settings,
            evaluator=name,
            run_id=run_id,
            attempt_no=1,
        )
        for name in TEXT_EVALUATORS
    }


def _promote(setup: Setup, checkpoint: Path, run_id: str, snapshot_id: str, **kw):
    return promote(
        ledger=setup.ledger,
        settings=setup.world.settings,
        run_id=run_id,
        attempt_no=1,
        checkpoint_dir=checkpoint,
        snapshot_id=snapshot_id,
        **kw,
    )


@pytest.fixture(scope="module")
def weak(setup: Setup) -> tuple[Path, dict[str, EvaluationRecord]]:
    checkpoint = _checkpoint(setup, "run-text-weak", setup.text.weaker_state)
    return checkpoint, _evaluate(setup, checkpoint, "run-text-weak", setup.text.snapshot)


@pytest.fixture(scope="module")
def strong(setup: Setup) -> tuple[Path, dict[str, EvaluationRecord]]:
    checkpoint = _checkpoint(setup, "run-text-strong", setup.text.trained_state)
    return checkpoint, _evaluate(setup, checkpoint, "run-text-strong", setup.text.snapshot)


def test_every_evaluator_records_its_provenance_and_what_does_not_apply(weak) -> None:
    _, records = weak
    assert required_evaluators("text-lm") == list(TEXT_EVALUATORS)
    heldout = records["heldout_bits_per_byte"]
    assert heldout.judge_model == NOT_APPLICABLE
    assert "no judge" in heldout.provenance["not_applicable"]["judge_model"]
    generation = records["generation_judged"]
    assert generation.judge_model.startswith("char-ngram-judge")
    assert generation.provenance["prompt_set"]["items"] == 16
    assert generation.provenance["template"]["text"] == "{prompt}"
    contamination = records["contamination"].provenance
    assert (contamination["overlap_fraction"], contamination["threshold"]) == (0.0, 0.05)
    digests = {r.provenance["model_digest"] for r in records.values()}
    assert len(digests) == 1  # the three evaluated the same weights


def test_a_record_missing_a_field_is_refused(weak) -> None:
    _, records = weak
    gate = gate_for_family("text-lm")
    sha = records["heldout_bits_per_byte"].checkpoint_manifest_sha256
    complete = gate.decide(sha, records.values(), [], list(TEXT_EVALUATORS))
    assert complete.passed, complete.reasons

    generation = records["generation_judged"]
    lacking = {k: v for k, v in generation.provenance.items() if k != "judge"}
    changed = {**records, "generation_judged": dataclasses.replace(generation, provenance=lacking)}
    decision = gate.decide(sha, changed.values(), [], list(TEXT_EVALUATORS))
    assert not decision.passed
    assert any(
        f"evaluation {generation.evaluation_id} (generation_judged) is incomplete" in r
        and "judge.digest" in r
        for r in decision.reasons
    ), decision.reasons

    # "Not applicable" only where the evaluator says so: a judge the generation did not name.
    unjudged = dataclasses.replace(generation, judge_model=NOT_APPLICABLE)
    decision = gate.decide(
        sha, {**records, "generation_judged": unjudged}.values(), [], list(TEXT_EVALUATORS)
    )
    assert any(f"judge_model as {NOT_APPLICABLE}" in r for r in decision.reasons)


def test_a_text_checkpoint_is_not_evaluated_on_digits(setup: Setup, weak) -> None:
    checkpoint, _ = weak
    before = setup.ledger.evaluations_for_checkpoint(manifest_sha256(checkpoint))
    with pytest.raises(FamilyMismatchError, match="is model family text-lm, but snapshot digits-"):
        run_evaluation(
            checkpoint_dir=checkpoint,
            snapshot=setup.world.snapshot,
            ledger=setup.ledger,
            settings=setup.world.settings,
            evaluator="heldout_bits_per_byte",
            run_id="run-text-weak",
            attempt_no=1,
        )
    with pytest.raises(FamilyMismatchError, match="evaluator holdout_accuracy is model family"):
        run_evaluation(
            checkpoint_dir=checkpoint,
            snapshot=setup.text.snapshot,
            ledger=setup.ledger,
            settings=setup.world.settings,
            evaluator=get_evaluator("holdout_accuracy"),
            run_id="run-text-weak",
            attempt_no=1,
        )
    assert setup.ledger.evaluations_for_checkpoint(manifest_sha256(checkpoint)) == before


def _dirty_snapshot(setup: Setup) -> Snapshot:
    """An evaluation set landed on its own from the training split's documents, re-wrapped and
    upper-cased (a near copy no exact-text rule catches)."""
    training = read_text_snapshot_frame(setup.text.snapshot)
    trained_on = [d for d in documents_from_frame(training) if d.split == SPLIT_TRAIN][:40]
    copied = [
        Document(f"copied/{i:03d}", split, " ".join(d.text.upper().split()))
        for i, d in enumerate(trained_on)
        for split in [SPLIT_EVAL if i % 2 else SPLIT_TRAIN]
    ]
    landing = write_text_landing(setup.root / "dirty-landing", documents=copied).parent
    return create_snapshot(landing, setup.world.settings.snapshot_root, family="text-lm")


def test_a_contaminated_evaluation_set_is_refused_with_the_overlap(setup: Setup) -> None:
    dirty = _dirty_snapshot(setup)
    checkpoint = _checkpoint(setup, "run-text-dirty", setup.text.trained_state)
    # The run trained on the corpus snapshot; the evaluation set is another snapshot.
    records = _evaluate(setup, checkpoint, "run-text-dirty", dirty)
    overlap = records["contamination"].provenance["overlap_fraction"]
    assert records["contamination"].provenance["training_snapshot_id"] == (
        setup.text.snapshot.snapshot_id
    )
    assert overlap > 0.9

    decision = _promote(
        setup, checkpoint, "run-text-dirty", dirty.snapshot_id, model_name="text-dirty"
    )
    assert decision.decision == PromotionDecision.REFUSED
    assert (
        f"the evaluation set is contaminated: overlap {overlap:.3f} with training snapshot "
        f"{setup.text.snapshot.snapshot_id} against the threshold 0.05"
    ) in decision.reason
    assert decision.gate["contamination"]["overlap_fraction"] == overlap


def test_text_lm_is_compared_with_its_own_champion(
    setup: Setup, weak, strong, tmp_path_factory: pytest.TempPathFactory
) -> None:
    snapshot_id = setup.text.snapshot.snapshot_id
    # A digits champion in the same registry.
    crown(setup.world, tmp_path_factory.mktemp("digits"), "run-digits-beside", DIGITS_MODEL)

    weak_checkpoint, weak_records = weak
    first = _promote(setup, weak_checkpoint, "run-text-weak", snapshot_id)
    assert (first.model_name, first.decision) == (registered_model_name("text-lm"), "promoted")
    assert first.model_name == "text-lm"

    strong_checkpoint, _ = strong
    second = _promote(setup, strong_checkpoint, "run-text-strong", snapshot_id)
    assert second.decision == PromotionDecision.PROMOTED, second.reason
    assert second.previous_champion_version == first.model_version
    headline = second.gate["headline_comparison"]
    assert headline["champion_evaluation_id"] == weak_records["heldout_bits_per_byte"].evaluation_id
    assert headline["metric"] == "heldout_bits_per_byte.bits_per_byte"
    assert headline["candidate"] < headline["champion"]  # lower is better
    assert headline["n"] == 62 and headline["method"].startswith("paired bootstrap")

    # The promotion's page in Dagster: the ceiling and the paired comparison, as rules.
    from assets.promotion import gate_rules_table

    rules = {row["rule"]: row for row in _rows(gate_rules_table(second))}
    ceiling = rules["heldout_bits_per_byte.bits_per_byte"]
    assert (ceiling["needs"], ceiling["passed"]) == ("<= 5.0", True)
    paired = rules["heldout_bits_per_byte.bits_per_byte against the champion, paired"]
    assert paired["n"] == 62 and paired["result"] == "passed"

    # The weaker model against the stronger champion: refused by the paired comparison.
    again = _promote(setup, weak_checkpoint, "run-text-weak", snapshot_id)
    assert again.decision == PromotionDecision.REFUSED
    assert "worse (higher) by more than the margin 0.02" in again.reason

    # A text model is never promoted to (nor compared with) the digits model.
    crossed = _promote(
        setup, strong_checkpoint, "run-text-strong", snapshot_id, model_name=DIGITS_MODEL
    )
    assert crossed.decision == PromotionDecision.REFUSED
    assert f"{DIGITS_MODEL} holds digits-cnn models" in crossed.reason
    assert crossed.gate["champion_version"] is None

    # Served: the champion, verified against its promotion, continues a prompt as generated.
    served = load_champion(setup.world.settings, setup.ledger, "text-lm")
    assert (served.version, served.family) == (second.model_version, "text-lm")
    prompt = "The if statement is used for "
    [continuation] = served.continue_text([prompt], max_new_tokens=16)
    model = build_model(dict(TEXT_MODEL_CONFIG))
    model.load_state_dict(setup.text.trained_state)
    expected = generate(model, TOKENIZER.encode(prompt), DecodingParams(max_new_tokens=16))
    assert continuation == expected.text


def _rows(table) -> list[dict]:
    return [dict(record.data) for record in table.records]


def test_a_champion_evaluated_elsewhere_is_evaluated_on_the_candidates_documents(
    setup: Setup, strong
) -> None:
    """The champion's held-out evaluation is on the full eval split, the candidate's on a
    snapshot with two eval documents fewer: promotion evaluates the champion on the
    candidate's snapshot, then pairs the same documents."""
    model = "text-lm-subset"
    strong_checkpoint, _ = strong
    first = _promote(
        setup, strong_checkpoint, "run-text-strong", setup.text.snapshot.snapshot_id,
        model_name=model,
    )  # fmt: skip
    assert first.decision == PromotionDecision.PROMOTED, first.reason

    frame = read_text_snapshot_frame(setup.text.snapshot)
    last_two = frame.index[frame["split"] == SPLIT_EVAL][-2:]
    documents = documents_from_frame(frame.drop(index=last_two))
    landing = write_text_landing(setup.root / "subset-landing", documents=documents).parent
    subset = create_snapshot(landing, setup.world.settings.snapshot_root, family="text-lm")
    moved = {k: v.clone() for k, v in setup.text.trained_state.items()}
    moved["ln_f.bias"][0] += 1e-6  # other bytes, the same model to a millionth
    checkpoint = _checkpoint(setup, "run-text-subset", moved)
    _evaluate(setup, checkpoint, "run-text-subset", subset)

    decision = _promote(setup, checkpoint, "run-text-subset", subset.snapshot_id, model_name=model)
    assert decision.decision == PromotionDecision.PROMOTED, decision.reason
    again = decision.gate["champion_reevaluation"]
    assert again["evaluated"] is True and again["snapshot_id"] == subset.snapshot_id
    headline = decision.gate["headline_comparison"]
    assert headline["champion_evaluation_id"] == again["evaluation_id"]
    assert headline["n"] == 60 and abs(headline["difference"]) < 1e-4
