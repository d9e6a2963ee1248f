"""What promotion does per model family: its registered model, its gate, its required fields.

Each family has its own registered model in MLflow, so its own ``champion`` alias: a text-lm
candidate is compared with the text-lm champion, never with the digits one. The digits gate is
``QualityGate()`` as it always was; the text-lm gate asks for every provenance field of every
evaluator (``pipeline.textlm.evaluators``), refuses a contaminated evaluation set, and compares
held-out bits per byte with the champion's, document by document, with the paired bootstrap the
digits comparison uses.
"""

from __future__ import annotations

from pipeline.data.families import DIGITS, TEXT, UnknownFamilyError
from pipeline.mlflow_setup import DEFAULT_MODEL_NAME
from pipeline.promotion.comparison import HeadlineSettings
from pipeline.promotion.gate import QualityGate

# One registered model per family.
MODEL_NAMES: dict[str, str] = {DIGITS: DEFAULT_MODEL_NAME, TEXT: "text-lm"}

# What every text-lm evaluation records (pipeline.textlm.evaluators.TextEvaluator).
_TEXT_COMMON: tuple[str, ...] = (
    "evaluator_version",
    "model_digest",
    "model_config",
    "tokenizer.name",
    "tokenizer.digest",
    "snapshot_id",
    "task_set_version",
    "decoding_params",
    "judge_model",
    "rubric_version",
    "torch_version",
    "torch_threads",
)

# The bits per byte a text-lm model must reach: uniform over 257 tokens is 8.01, a byte unigram
# model of this corpus about 4.6; a model above 5 has learned next to nothing from context.
TEXT_MAX_BITS_PER_BYTE = 5.0


def registered_model_name(family: str) -> str:
    """The registered model a family's champions are versions of."""
    try:
        return MODEL_NAMES[family]
    except (KeyError, TypeError):
        raise UnknownFamilyError(family) from None


def text_required_provenance() -> dict[str, tuple[str, ...]]:
    """Per text-lm evaluator, every provenance field the gate requires (dotted paths).

    The generation evaluator's include every field reproduction needs
    (``pipeline.textlm.reproduce.REQUIRED_FIELDS``): a record ``tracks reproduce`` would call
    incomplete is refused here too.
    """
    from pipeline.textlm.reproduce import REQUIRED_FIELDS

    generation = (
        *REQUIRED_FIELDS,
        "prompt_set.version",
        "prompt_set.items",
        "template.name",
        "judge.version",
        "judge.judge_model",
        "decoding_params.greedy",
        "decoding_params.sampled",
        "decoding_params.samples_per_prompt",
    )
    contamination = (
        "prompt_set.digest",
        "method",
        "ngram_words",
        "threshold",
        "training_snapshot_id",
        "training_digest",
        "evaluation_ngrams",
        "overlap_fraction",
        "contaminated",
        "summary",
    )
    return {
        "heldout_bits_per_byte": _TEXT_COMMON,
        "generation_judged": tuple(dict.fromkeys((*_TEXT_COMMON, *generation))),
        "contamination": tuple(dict.fromkeys((*_TEXT_COMMON, *contamination))),
    }


def text_gate() -> QualityGate:
    """The text-lm gate (see the module doc)."""
    from pipeline.evaluation.evaluators import family_evaluators
    from pipeline.textlm.contamination import THRESHOLD

    evaluators = family_evaluators(TEXT)
    return QualityGate(
        min_metrics={},
        max_metrics={"heldout_bits_per_byte.bits_per_byte": TEXT_MAX_BITS_PER_BYTE},
        # Per topic: a topic may read at most a tenth of a bit per byte worse than under the
        # champion.
        max_slice_regression=0.1,
        slice_metric="bits_per_byte",
        slice_higher_is_better=False,
        headline=HeadlineSettings(
            evaluator="heldout_bits_per_byte",
            metric="bits_per_byte",
            margin=0.02,
            higher_is_better=False,
        ),
        required_provenance=text_required_provenance(),
        not_applicable={name: dict(e.not_applicable) for name, e in evaluators.items()},
        contamination_evaluator="contamination",
        max_contamination=THRESHOLD,
    )


def gate_for_family(family: str) -> QualityGate:
    """The default gate of ``family``."""
    if family == DIGITS:
        return QualityGate()
    if family == TEXT:
        return text_gate()
    raise UnknownFamilyError(family)
