"""Re-run a generation evaluation from its record and say whether it came out the same.

Two questions, both answered by name. Are the inputs the ones recorded? Each recorded input
(evaluator version, weights, prompt set, template, tokenizer, every decoding parameter, seed,
judge, rubric) is rebuilt from its source (the snapshot's eval split, the evaluator's code,
the checkpoint) and compared with the record. Are the outputs? Every sample is generated again
under the decoding parameters and seed the record states, and compared with the recorded one:
greedy outputs byte for byte, sampled outputs byte for byte under their recorded seeds, and
each judge score exactly. A field the record lacks is named as missing: the record is
incomplete, and an incomplete record never reproduces as "identical".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline.textlm.evaluators import SAMPLED, GenerationJudged, TextEvaluatorResult
from pipeline.textlm.generation import DecodingError
from pipeline.textlm.judge import RUBRIC_VERSION
from pipeline.textlm.model import state_digest
from pipeline.textlm.tokenizer import TOKENIZER

if TYPE_CHECKING:
    from pipeline.textlm.eval_set import TextEvalSet
    from pipeline.textlm.model import TextLM

IDENTICAL = "identical"
# Every recorded field reproduction needs, as a dotted path into the provenance.
REQUIRED_FIELDS: tuple[str, ...] = (
    "evaluator_version",
    "model_digest",
    "prompt_set.digest",
    "template.text",
    "template.digest",
    "tokenizer.digest",
    "decoding_params",
    "decoding_params.seed",
    "judge.digest",
    "rubric_version",
)
SAMPLE_FIELDS: tuple[str, ...] = (
    "sample_index",
    "item_id",
    "mode",
    "seed",
    "prompt",
    "output_sha256",
    "score",
)
_SHOWN = 5


@dataclass(frozen=True)
class Mismatch:
    """One recorded value that is not what reproduction found (``field`` names it)."""

    field: str
    recorded: Any
    found: Any

    def describe(self) -> str:
        return f"{self.field}: recorded {_short(self.recorded)}, found {_short(self.found)}"


@dataclass(frozen=True)
class Reproduction:
    """What re-running a generation evaluation found."""

    missing: tuple[str, ...]
    input_mismatches: tuple[Mismatch, ...]
    output_mismatches: tuple[Mismatch, ...]
    samples_compared: int
    greedy_samples: int
    sampled_samples: int

    @property
    def identical(self) -> bool:
        return not (self.missing or self.input_mismatches or self.output_mismatches)

    @property
    def mismatched_fields(self) -> tuple[str, ...]:
        """Every recorded field that did not reproduce (inputs first), and every missing one."""
        names = [*self.missing, *(m.field for m in self.input_mismatches)]
        names += [m.field for m in self.output_mismatches]
        return tuple(dict.fromkeys(names))

    def summary(self) -> str:
        if self.identical:
            return (
                f"{IDENTICAL}: {self.greedy_samples} greedy outputs byte-identical, "
                f"{self.sampled_samples} sampled outputs identical under their recorded seeds, "
                "every score equal; every recorded input matches"
            )
        parts = []
        if self.missing:
            parts.append("incomplete record, missing " + ", ".join(self.missing))
        if self.input_mismatches:
            shown = "; ".join(m.describe() for m in self.input_mismatches[:_SHOWN])
            parts.append(f"{len(self.input_mismatches)} input(s) differ: {shown}")
        if self.output_mismatches:
            shown = "; ".join(m.describe() for m in self.output_mismatches[:_SHOWN])
            parts.append(
                f"{len(self.output_mismatches)} of {self.samples_compared} samples differ: {shown}"
            )
        return "not reproduced: " + " | ".join(parts)


def generation_record(result: TextEvaluatorResult) -> dict[str, Any]:
    """What a generation evaluation records for reproduction: provenance and every sample."""
    return {"provenance": result.provenance, "samples": samples_from_frame(result.raw_outputs)}


def samples_from_frame(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The recorded samples of a generation evaluation's raw outputs (the columns reproduction
    compares, JSON-safe); a column the frame lacks is left out of every sample, so reproduction
    names it missing."""
    present = [key for key in SAMPLE_FIELDS if key in frame.columns]
    samples = frame[present].to_dict(orient="records")
    for sample in samples:
        # JSON-safe and exact: greedy samples have no seed (the table holds it as missing).
        if "seed" in sample:
            sample["seed"] = None if pd.isna(sample["seed"]) else int(sample["seed"])
        if "sample_index" in sample:
            sample["sample_index"] = int(sample["sample_index"])
        if "score" in sample:
            sample["score"] = float(sample["score"])
    return samples


def reproduce_generation(
    record: dict[str, Any],
    *,
    model: TextLM,
    eval_set: TextEvalSet,
    evaluator: GenerationJudged | None = None,
) -> Reproduction:
    """Rebuild the inputs of ``record``, compare them, re-generate every sample, compare."""
    if evaluator is None:
        evaluator = GenerationJudged(judge=eval_set.judge)
    provenance = record.get("provenance") or {}
    samples = record.get("samples")
    missing = [name for name in REQUIRED_FIELDS if _get(provenance, name) is _ABSENT]
    if not isinstance(samples, list) or not samples:
        missing.append("samples")
        samples = []
    missing += sorted(
        {f"samples[].{key}" for sample in samples for key in SAMPLE_FIELDS if key not in sample}
    )

    found = {
        "evaluator_version": evaluator.version,
        "model_digest": state_digest(model),
        "prompt_set.digest": eval_set.prompt_set.digest,
        "template.text": evaluator.template.text,
        "template.digest": evaluator.template.digest,
        "tokenizer.digest": TOKENIZER.digest,
        "judge.digest": eval_set.judge.digest,
        "rubric_version": RUBRIC_VERSION,
    }
    inputs = [
        Mismatch(name, _get(provenance, name), value)
        for name, value in found.items()
        if _get(provenance, name) not in (_ABSENT, value)
    ]
    recorded_decoding = _get(provenance, "decoding_params")
    if isinstance(recorded_decoding, dict):
        inputs += _compare_tree("decoding_params", recorded_decoding, evaluator.decoding_params)

    outputs: list[Mismatch] = []
    rerun: list[dict[str, Any]] = []
    if isinstance(recorded_decoding, dict) and not missing:
        try:
            rerun = evaluator.generate_samples(model, eval_set, recorded_decoding)
        except (DecodingError, KeyError, TypeError, ValueError) as exc:
            outputs.append(Mismatch("decoding_params", recorded_decoding, f"unusable: {exc}"))
    items = {item.item_id: item for item in eval_set.prompt_set.items}
    by_index = {row["sample_index"]: row for row in rerun}
    if rerun and len(rerun) != len(samples):
        outputs.append(Mismatch("samples", f"{len(samples)} samples", f"{len(rerun)} samples"))
    for sample in samples if rerun else []:
        outputs += _compare_sample(
            sample, by_index.get(sample.get("sample_index")), items, eval_set
        )

    modes = [sample.get("mode") for sample in samples]
    return Reproduction(
        missing=tuple(missing),
        input_mismatches=tuple(inputs),
        output_mismatches=tuple(outputs),
        samples_compared=len(samples) if rerun else 0,
        greedy_samples=sum(mode != SAMPLED for mode in modes),
        sampled_samples=sum(mode == SAMPLED for mode in modes),
    )


def _compare_sample(
    sample: dict[str, Any], again: dict[str, Any] | None, items: dict[str, Any], eval_set: Any
) -> list[Mismatch]:
    where = f"samples[{sample.get('sample_index')}]"
    if again is None:
        return [Mismatch(where, "a sample", "no such sample when re-run")]
    found: list[Mismatch] = []
    item = items.get(sample.get("item_id"))
    if item is None:
        found.append(Mismatch(f"{where}.item_id", sample.get("item_id"), "not in the prompt set"))
    elif sample.get("prompt") != item.prompt:
        found.append(Mismatch(f"{where}.prompt", sample.get("prompt"), item.prompt))
    for key in ("item_id", "mode", "seed", "output_sha256"):
        if sample.get(key) != again[key]:
            found.append(Mismatch(f"{where}.{key}", sample.get(key), again[key]))
    score = eval_set.judge.score(again["output"], context=again["prompt"])
    if sample.get("score") != score:
        found.append(Mismatch(f"{where}.score", sample.get("score"), score))
    return found


def _compare_tree(prefix: str, recorded: Any, found: Any) -> list[Mismatch]:
    if isinstance(recorded, dict) and isinstance(found, dict):
        mismatches: list[Mismatch] = []
        for key in sorted(set(recorded) | set(found), key=str):
            mismatches += _compare_tree(
                f"{prefix}.{key}", recorded.get(key, _ABSENT), found.get(key, _ABSENT)
            )
        return mismatches
    if isinstance(recorded, tuple | list) and isinstance(found, tuple | list):
        recorded, found = list(recorded), list(found)
    return [] if recorded == found else [Mismatch(prefix, recorded, found)]


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT: Any = _Absent()


def _get(tree: dict[str, Any], dotted: str) -> Any:
    value: Any = tree
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
