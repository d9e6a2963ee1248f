"""The text-lm evaluators, judge, contamination check and reproduction from the record."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeline.evaluation.base import NOT_APPLICABLE
from pipeline.textlm.columns import SPLIT_EVAL, SPLIT_TRAIN
from pipeline.textlm.contamination import THRESHOLD
from pipeline.textlm.corpus import Document
from pipeline.textlm.eval_set import TextEvalSet
from pipeline.textlm.evaluators import (
    Contamination,
    GenerationJudged,
    HeldoutBitsPerByte,
    text_evaluators,
)
from pipeline.textlm.judge import JUDGE_VERSION, RUBRIC_VERSION, CharNgramJudge
from pipeline.textlm.landing import documents_from_frame, read_text_frame, write_text_landing
from pipeline.textlm.prompts import judge_documents
from pipeline.textlm.reproduce import IDENTICAL, generation_record, reproduce_generation
from tests.textlm_support import landed_frame, small_eval_set, tiny_model


@pytest.fixture(scope="module")
def eval_set(tmp_path_factory: pytest.TempPathFactory) -> TextEvalSet:
    return small_eval_set(tmp_path_factory.mktemp("textlm-eval"))


@pytest.fixture(scope="module")
def generation(eval_set: TextEvalSet) -> tuple[GenerationJudged, Any, dict[str, Any]]:
    evaluator = GenerationJudged(judge=eval_set.judge, max_new_tokens=12, samples_per_prompt=1)
    model = tiny_model(seed=5)
    result = evaluator.evaluate(model, eval_set)
    # As it would come back from the ledger or MLflow: through JSON.
    record = json.loads(json.dumps(generation_record(result)))
    return evaluator, model, record


def test_judge_digest_is_stable_and_moves_with_any_count(eval_set: TextEvalSet) -> None:
    texts = list(judge_documents(eval_set.eval_documents, eval_set.prompt_set))
    again = CharNgramJudge.fit(texts)
    assert again.digest == eval_set.judge.digest  # refitted, same table, same digest
    assert again.model_name.startswith(JUDGE_VERSION + ":sha256:") and len(again.model_name) < 128
    assert RUBRIC_VERSION.startswith("rubric:sha256:")
    changed = CharNgramJudge.fit([texts[0] + "!", *texts[1:]])
    assert changed.digest != again.digest
    # It judges: reference prose reads far better than the same characters shuffled.
    reference = eval_set.prompt_set.items[0].reference
    shuffled = "".join(sorted(reference))
    assert again.score(reference) + 1.0 < again.score(shuffled)
    assert again.score("") == math.log2(again.vocabulary_size)


def test_bits_per_byte_of_an_untrained_model_is_near_uniform(eval_set: TextEvalSet) -> None:
    evaluator = HeldoutBitsPerByte()
    result = evaluator.evaluate(tiny_model(), eval_set)
    assert abs(result.metrics["bits_per_byte"] - math.log2(257)) < 0.1
    assert result.metrics["bytes"] == sum(len(t.encode()) for t in eval_set.eval_documents.texts)
    assert evaluator.version.startswith("src:sha256:")
    assert result.provenance["task_set_version"] == eval_set.task_set_version
    assert result.provenance["not_applicable"]["judge_model"]  # says why, not just "n/a"


def test_generation_keeps_every_sample_with_full_provenance(generation, eval_set) -> None:
    evaluator, _, record = generation
    provenance = record["provenance"]
    assert len(record["samples"]) == 2 * len(eval_set.prompt_set.items)  # greedy + 1 sampled
    assert provenance["prompt_set"]["digest"] == eval_set.prompt_set.digest
    assert provenance["template"]["digest"] == evaluator.template.digest
    assert provenance["judge"]["digest"] == eval_set.judge.digest
    assert provenance["judge_model"] == eval_set.judge.model_name == evaluator.judge_model
    assert provenance["decoding_params"]["sampled"]["top_k"] == 40
    assert provenance["tokenizer"]["digest"].startswith("sha256:")
    assert provenance["not_applicable"] == {}
    leaves = json.dumps(provenance)
    assert NOT_APPLICABLE not in leaves and "null" not in json.dumps(provenance["judge"])
    seeds = [s["seed"] for s in record["samples"] if s["mode"] == "sampled"]
    assert seeds == [evaluator.seed + len(eval_set.prompt_set.items) + i for i in range(3)]
    assert set(text_evaluators(eval_set)) == {
        "heldout_bits_per_byte",
        "generation_judged",
        "contamination",
    }


def test_reproduction_of_the_untouched_record_is_identical(generation, eval_set) -> None:
    evaluator, model, record = generation
    reproduction = reproduce_generation(record, model=model, eval_set=eval_set, evaluator=evaluator)
    assert reproduction.identical, reproduction.summary()
    assert reproduction.summary().startswith(IDENTICAL)
    assert (reproduction.greedy_samples, reproduction.sampled_samples) == (3, 3)


def _set(record: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        record = record[key]
    record[keys[-1]] = value(record[keys[-1]])


@pytest.mark.parametrize(
    ("tampered", "change", "reported"),
    [
        ("provenance.prompt_set.digest", lambda v: "sha256:" + "0" * 64, "prompt_set.digest"),
        ("provenance.template.text", lambda v: "Q: {prompt}", "template.text"),
        (
            "provenance.decoding_params.sampled.temperature",
            lambda v: 0.5,
            "decoding_params.sampled.temperature",
        ),
        ("provenance.judge.digest", lambda v: v[:-4] + "beef", "judge.digest"),
        ("provenance.decoding_params.seed", lambda v: v + 1, "decoding_params.seed"),
    ],
    ids=["prompt_set", "template", "decoding_parameter", "judge", "seed"],
)
def test_reproduction_names_each_tampered_input(
    generation, eval_set, tampered: str, change, reported: str
) -> None:
    evaluator, model, record = generation
    record = copy.deepcopy(record)
    _set(record, tampered, change)
    reproduction = reproduce_generation(record, model=model, eval_set=eval_set, evaluator=evaluator)
    assert not reproduction.identical
    assert reproduction.mismatched_fields[0] == reported, reproduction.summary()
    assert reported in reproduction.summary()
    sampled_outputs_differ = any(
        m.field.endswith(".output_sha256") for m in reproduction.output_mismatches
    )
    # A changed decoding parameter or seed also changes what the recorded decoding produces.
    assert sampled_outputs_differ == (reported.startswith("decoding_params"))


def test_a_record_lacking_a_field_is_incomplete(generation, eval_set) -> None:
    evaluator, model, record = generation
    record = copy.deepcopy(record)
    del record["provenance"]["judge"]
    del record["samples"][0]["output_sha256"]
    reproduction = reproduce_generation(record, model=model, eval_set=eval_set, evaluator=evaluator)
    assert reproduction.missing == ("judge.digest", "samples[].output_sha256")
    assert "incomplete record, missing judge.digest" in reproduction.summary()


def test_an_eval_set_copied_from_training_is_contaminated(tmp_path: Path) -> None:
    training = landed_frame(tmp_path / "train")
    clean = Contamination().evaluate(None, TextEvalSet.from_frame(training, snapshot_id="t"))
    assert clean.metrics["overlap_fraction"] == 0.0 and clean.metrics["contaminated"] == 0.0

    # An evaluation set landed on its own, cut from training documents, re-wrapped and
    # upper-cased: a near copy no exact-text rule would catch.
    copied = [
        Document(f"copied/{i:03d}", split, " ".join(d.text.upper().split()))
        for i, d in enumerate(
            [d for d in documents_from_frame(training) if d.split == SPLIT_TRAIN][:40]
        )
        for split in [SPLIT_EVAL if i % 2 else SPLIT_TRAIN]
    ]
    frame = read_text_frame(write_text_landing(tmp_path / "evalset", documents=copied))
    eval_set = TextEvalSet.from_frame(
        frame, snapshot_id="evalset", training_frame=training, training_snapshot_id="t"
    )
    result = Contamination().evaluate(None, eval_set)
    overlap = result.metrics["overlap_fraction"]
    assert overlap > 0.9 > THRESHOLD and result.metrics["contaminated"] == 1.0
    assert result.provenance["training_snapshot_id"] == "t"
    assert result.metrics["dirty_fraction"] > 0.9
    assert (
        f"({overlap:.3f}) occur in training snapshot t, above the threshold"
        in (result.provenance["summary"])
    )
