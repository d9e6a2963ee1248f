"""The text-lm evaluators: held-out bits per byte, judged generation, contamination.

Each follows the shape of ``pipeline.evaluation.base.Evaluator`` (name, version as a code
digest, required, decoding_params, judge_model, rubric_version) with ``evaluate(model,
eval_set)`` reading a :class:`TextEvalSet` instead of image tensors, and returns a
:class:`TextEvaluatorResult`: an ``EvaluatorResult`` that also carries its provenance, every
input that decided the figures. A field that truly does not apply to an evaluator is named in
its ``not_applicable`` with the reason; nothing else is "not applicable".
"""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd

from pipeline.evaluation.base import NOT_APPLICABLE, EvaluatorResult, code_digest
from pipeline.textlm import contamination as contamination_module
from pipeline.textlm import data as data_module
from pipeline.textlm import generation as generation_module
from pipeline.textlm import judge as judge_module
from pipeline.textlm import prompts as prompts_module
from pipeline.textlm import tokenizer as tokenizer_module
from pipeline.textlm.contamination import measure_contamination
from pipeline.textlm.generation import (
    EVAL_THREADS,
    DecodingError,
    DecodingParams,
    evaluation_threads,
    generate,
    sample_seed,
)
from pipeline.textlm.judge import RUBRIC_VERSION, CharNgramJudge
from pipeline.textlm.model import state_digest
from pipeline.textlm.prompts import DEFAULT_TEMPLATE, PromptTemplate
from pipeline.textlm.tokenizer import TOKENIZER

if TYPE_CHECKING:
    from pipeline.textlm.eval_set import TextEvalSet
    from pipeline.textlm.model import TextLM

GREEDY = "greedy"
SAMPLED = "sampled"


class TextEvaluationError(ValueError):
    """An evaluator given inputs it cannot use (a judge fitted elsewhere); names them."""


@dataclass(frozen=True, eq=False)
class TextEvaluatorResult(EvaluatorResult):
    """An ``EvaluatorResult`` with the provenance of its figures (JSON-safe)."""

    provenance: dict[str, Any] = field(default_factory=dict)


def textlm_code_digest(cls: type, modules: tuple[ModuleType, ...]) -> str:
    """``src:sha256:<16 hex>``: the class (``code_digest``) and the modules it computes with.

    A text evaluator's figures depend on code outside its class (decoding, the tokenizer, the
    judge, the prompt cutter), so a change there must change its version too.
    """
    digest = hashlib.sha256(code_digest(cls).encode())
    for module in modules:
        digest.update(module.__name__.encode())
        digest.update(inspect.getsource(module).encode())
    return "src:sha256:" + digest.hexdigest()[:16]


class TextEvaluator:
    """What every text-lm evaluator shares: its version and the common provenance."""

    name: ClassVar[str]
    required: ClassVar[bool] = True
    code_modules: ClassVar[tuple[ModuleType, ...]] = (tokenizer_module, data_module)
    not_applicable: ClassVar[dict[str, str]] = {}

    @property
    def version(self) -> str:
        return textlm_code_digest(type(self), self.code_modules)

    @property
    def judge_model(self) -> str:
        return NOT_APPLICABLE

    @property
    def rubric_version(self) -> str:
        return NOT_APPLICABLE

    @property
    def decoding_params(self) -> dict[str, Any]:
        raise NotImplementedError

    def evaluate(self, model: TextLM, eval_set: TextEvalSet) -> TextEvaluatorResult:
        raise NotImplementedError

    def base_provenance(self, model: TextLM | None, eval_set: TextEvalSet) -> dict[str, Any]:
        import torch

        return {
            "evaluator": self.name,
            "evaluator_version": self.version,
            "model_digest": state_digest(model) if model is not None else None,
            "model_config": model.config.to_dict() if model is not None else None,
            "tokenizer": {"name": TOKENIZER.name, "digest": TOKENIZER.digest},
            "snapshot_id": eval_set.snapshot_id,
            "task_set_version": eval_set.task_set_version,
            "decoding_params": self.decoding_params,
            "judge_model": self.judge_model,
            "rubric_version": self.rubric_version,
            "not_applicable": dict(self.not_applicable),
            # Floating-point results can depend on these; a reproduction states them too.
            "torch_version": torch.__version__,
            "torch_threads": EVAL_THREADS,
        }


class HeldoutBitsPerByte(TextEvaluator):
    """Bits per byte of the eval documents under the model (teacher-forced), per topic too.

    Each document is ``[EOT] + bytes``, cut into windows of ``block_size + 1`` tokens that
    overlap by one, so every byte is predicted exactly once, from the window it falls in.
    """

    name: ClassVar[str] = "heldout_bits_per_byte"
    batch_size: ClassVar[int] = 64
    not_applicable: ClassVar[dict[str, str]] = {
        "judge_model": "the figure is the model's own probability of the text; no judge",
        "rubric_version": "no rubric: nothing is scored but the text's likelihood",
    }

    @property
    def decoding_params(self) -> dict[str, Any]:
        return {
            "decision": "teacher-forced next-byte likelihood (no decoding)",
            "window": "block_size + 1 tokens, overlapping by one; context resets per window",
            "batch_size": self.batch_size,
        }

    def evaluate(self, model: TextLM, eval_set: TextEvalSet) -> TextEvaluatorResult:
        import torch
        from torch.nn import functional as F

        model.eval()
        block = model.config.block_size
        rows = []
        with torch.inference_mode(), evaluation_threads():
            for doc_id, text in zip(
                eval_set.eval_documents.doc_ids, eval_set.eval_documents.texts, strict=True
            ):
                ids = torch.tensor(TOKENIZER.encode_document(text), dtype=torch.long)
                windows = [ids[s : s + block + 1] for s in range(0, len(ids) - 1, block)]
                full = [w for w in windows if len(w) == block + 1]
                # Full windows in batches; the shorter last window of a document on its own.
                batches = [
                    torch.stack(full[i : i + self.batch_size])
                    for i in range(0, len(full), self.batch_size)
                ]
                batches += [w[None] for w in windows if len(w) != block + 1]
                nats = 0.0
                for batch in batches:
                    logits = model(batch[:, :-1])
                    nats += float(
                        F.cross_entropy(
                            logits.reshape(-1, logits.shape[-1]),
                            batch[:, 1:].reshape(-1),
                            reduction="sum",
                        )
                    )
                n_bytes = len(ids) - 1
                rows.append(
                    {
                        "sample_id": doc_id,  # what a paired comparison pairs on
                        "doc_id": doc_id,
                        "bytes": n_bytes,
                        "bits": nats / math.log(2),
                        "bits_per_byte": nats / math.log(2) / n_bytes,
                    }
                )
        outputs = pd.DataFrame(rows)
        total_bits, total_bytes = float(outputs["bits"].sum()), int(outputs["bytes"].sum())
        outputs["topic"] = outputs["doc_id"].map(lambda d: d.rpartition("/")[0] or d)
        slices = {
            f"topic={topic}": {
                "bits_per_byte": float(group["bits"].sum() / group["bytes"].sum()),
                "support": float(group["bytes"].sum()),
            }
            for topic, group in outputs.groupby("topic", sort=True)
        }
        return TextEvaluatorResult(
            metrics={
                "bits_per_byte": total_bits / total_bytes,
                "bytes": float(total_bytes),
                "documents": float(len(outputs)),
            },
            slice_metrics=slices,
            raw_outputs=outputs,
            # The documents the model found hardest, worst first: the ones worth reading.
            failures=outputs.sort_values(["bits_per_byte", "doc_id"], ascending=[False, True])
            .head(10)
            .reset_index(drop=True),
            provenance=self.base_provenance(model, eval_set),
        )


class GenerationJudged(TextEvaluator):
    """Greedy and sampled continuations of the prompt set, each kept and scored by the judge.

    Sample ``i`` of the evaluation (greedy samples first, one per item; then the sampled
    ones, ``samples_per_prompt`` per item) draws under seed ``seed + i``.
    """

    name: ClassVar[str] = "generation_judged"
    code_modules: ClassVar[tuple[ModuleType, ...]] = (
        tokenizer_module,
        data_module,
        generation_module,
        prompts_module,
        judge_module,
    )

    def __init__(
        self,
        judge: CharNgramJudge | None = None,
        *,
        template: PromptTemplate = DEFAULT_TEMPLATE,
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 40,
        top_p: float | None = 0.95,
        stop_sequences: tuple[str, ...] = ("\n\n",),
        samples_per_prompt: int = 2,
        seed: int = 20_261_127,
    ) -> None:
        self.judge = judge
        self.template = template
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.stop_sequences = tuple(stop_sequences)
        self.samples_per_prompt = samples_per_prompt
        self.seed = seed
        # Refuse bad parameters now, not mid-evaluation.
        if isinstance(samples_per_prompt, bool) or samples_per_prompt < 0:
            raise DecodingError(f"samples_per_prompt must be >= 0, got {samples_per_prompt!r}")
        self.greedy_params()
        self.sampled_params(seed)

    @property
    def judge_model(self) -> str:
        return self.judge.model_name if self.judge is not None else judge_module.JUDGE_VERSION

    @property
    def rubric_version(self) -> str:
        return RUBRIC_VERSION

    def greedy_params(self) -> DecodingParams:
        return DecodingParams(
            temperature=0.0,
            max_new_tokens=self.max_new_tokens,
            stop_sequences=self.stop_sequences,
        )

    def sampled_params(self, seed: int) -> DecodingParams:
        return DecodingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            stop_sequences=self.stop_sequences,
            seed=seed,
        )

    @property
    def decoding_params(self) -> dict[str, Any]:
        greedy = self.greedy_params().to_dict()
        sampled = self.sampled_params(self.seed).to_dict()
        for params in (greedy, sampled):
            del params["seed"]  # one seed for the evaluation, below; each sample's in its row
        return {
            GREEDY: greedy,
            SAMPLED: sampled,
            "samples_per_prompt": self.samples_per_prompt,
            "seed": self.seed,
            "sample_seed": "seed + sample index (greedy samples first)",
        }

    def evaluate(self, model: TextLM, eval_set: TextEvalSet) -> TextEvaluatorResult:
        judge = self.judge if self.judge is not None else eval_set.judge
        if judge.digest != eval_set.judge.digest:
            raise TextEvaluationError(
                f"{self.name}: the judge {judge.model_name} is not the one fitted on the eval "
                f"split of snapshot {eval_set.snapshot_id} ({eval_set.judge.model_name})"
            )
        rows = self.generate_samples(model, eval_set, self.decoding_params)
        for row in rows:
            row["score"] = judge.score(row["output"], context=row["prompt"])
            row["reference_score"] = judge.score(row["reference"], context=row["prompt"])
            # A likelihood judge prefers bland, looping text; this shows the loops beside it.
            row["distinct_4grams"] = distinct_ngram_ratio(row["output"])
        outputs = pd.DataFrame(rows)
        outputs["seed"] = outputs["seed"].astype("Int64")  # greedy samples have none
        metrics: dict[str, float] = {"samples": float(len(outputs))}
        slices: dict[str, dict[str, float]] = {}
        for mode, group in outputs.groupby("mode", sort=True):
            metrics[f"judge_bits_per_char_{mode}"] = float(group["score"].mean())
            metrics[f"prefix_match_chars_{mode}"] = float(group["prefix_match_chars"].mean())
            metrics[f"distinct_4grams_{mode}"] = float(group["distinct_4grams"].mean())
            metrics[f"stop_sequence_rate_{mode}"] = float(
                (group["stop_reason"] == "stop_sequence").mean()
            )
            slices[f"mode={mode}"] = {
                "judge_bits_per_char": float(group["score"].mean()),
                "support": float(len(group)),
            }
        references = outputs.loc[outputs["mode"] == GREEDY, "reference"]
        metrics["reference_judge_bits_per_char"] = float(
            outputs.loc[outputs["mode"] == GREEDY, "reference_score"].mean()
        )
        metrics["reference_distinct_4grams"] = float(references.map(distinct_ngram_ratio).mean())
        provenance = self.base_provenance(model, eval_set)
        provenance.update(
            {
                "prompt_set": eval_set.prompt_set.describe(),
                "template": self.template.describe(),
                "judge": judge.describe(),
                "rubric_version": RUBRIC_VERSION,
                "judge_model": judge.model_name,
            }
        )
        return TextEvaluatorResult(
            metrics=metrics,
            slice_metrics=slices,
            raw_outputs=outputs,
            failures=outputs.sort_values(["score", "sample_index"], ascending=[False, True])
            .head(10)
            .reset_index(drop=True),
            provenance=provenance,
        )

    def generate_samples(
        self, model: TextLM, eval_set: TextEvalSet, decoding: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Every sample under ``decoding`` (the shape of :attr:`decoding_params`), unscored.

        Reproduction calls this with the decoding parameters an evaluation recorded.
        """
        greedy = DecodingParams(**_params(decoding[GREEDY]))
        items = eval_set.prompt_set.items
        plan: list[tuple[Any, str, DecodingParams]] = [(item, GREEDY, greedy) for item in items]
        index = len(plan)
        for item in items:
            for _ in range(int(decoding["samples_per_prompt"])):
                seed = sample_seed(int(decoding["seed"]), index)
                sampled = DecodingParams(**_params(decoding[SAMPLED]), seed=seed)
                plan.append((item, SAMPLED, sampled))
                index += 1
        rows = []
        for sample_index, (item, mode, params) in enumerate(plan):
            prompt_ids = TOKENIZER.encode(self.template.render(item.prompt))
            generation = generate(model, prompt_ids, params)
            output = generation.text
            rows.append(
                {
                    "sample_index": sample_index,
                    "item_id": item.item_id,
                    "mode": mode,
                    "seed": params.seed,
                    "prompt": item.prompt,
                    "reference": item.reference,
                    "output": output,
                    "output_hex": generation.output_bytes.hex(),
                    "output_sha256": generation.output_sha256,
                    "new_tokens": len(generation.output_ids),
                    "stop_reason": str(generation.stop_reason),
                    "prefix_match_chars": _common_prefix(output, item.reference),
                }
            )
        return rows


def _params(recorded: dict[str, Any]) -> dict[str, Any]:
    values = {k: v for k, v in recorded.items() if k != "seed"}
    values["stop_sequences"] = tuple(values.get("stop_sequences") or ())
    return values


def distinct_ngram_ratio(text: str, n: int = 4) -> float:
    """Distinct character n-grams over all of them: 1.0 never repeats, near 0 loops (NaN when
    ``text`` is shorter than ``n``, and left out of the means)."""
    grams = [text[i : i + n] for i in range(len(text) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Contamination(TextEvaluator):
    """Word 13-gram overlap between the prompt set (prompts and references) and the training
    snapshot's text; the figure and the threshold the gate enforces."""

    name: ClassVar[str] = "contamination"
    code_modules: ClassVar[tuple[ModuleType, ...]] = (
        tokenizer_module,
        data_module,
        prompts_module,
        contamination_module,
    )
    not_applicable: ClassVar[dict[str, str]] = {
        "decoding_params": "nothing is generated: the check reads texts, not model outputs",
        "judge_model": "an overlap count, not a judgement",
        "rubric_version": "an overlap count, not a judgement",
        "slice_metrics": "one overlap figure over the whole prompt set; dirty items are listed",
    }

    def __init__(self, threshold: float = contamination_module.THRESHOLD) -> None:
        self.threshold = threshold

    @property
    def decoding_params(self) -> dict[str, Any]:
        return {
            "decision": NOT_APPLICABLE,
            "ngram_words": contamination_module.NGRAM_WORDS,
            "threshold": self.threshold,
        }

    def evaluate(self, model: TextLM | None, eval_set: TextEvalSet) -> TextEvaluatorResult:
        items = [(i.item_id, i.prompt + i.reference) for i in eval_set.prompt_set.items]
        report = measure_contamination(
            items,
            eval_set.training_texts,
            training_snapshot_id=eval_set.training_snapshot_id,
            threshold=self.threshold,
        )
        dirty = set(report.dirty_item_ids)
        outputs = pd.DataFrame(
            {
                "item_id": [item_id for item_id, _ in items],
                "dirty": [item_id in dirty for item_id, _ in items],
            }
        )
        provenance = self.base_provenance(model, eval_set)
        provenance.update(
            {
                "prompt_set": eval_set.prompt_set.describe(),
                **report.to_dict(),
                "summary": report.summary(),  # the sentence a refusing gate repeats
            }
        )
        return TextEvaluatorResult(
            metrics={
                "overlap_fraction": report.overlap_fraction,
                "dirty_fraction": report.dirty_fraction,
                "threshold": report.threshold,
                "contaminated": float(report.contaminated),
                "evaluation_ngrams": float(report.evaluation_ngrams),
                "overlapping_ngrams": float(report.overlapping_ngrams),
            },
            slice_metrics={},
            raw_outputs=outputs,
            failures=outputs[outputs["dirty"]].reset_index(drop=True),
            provenance=provenance,
        )


def text_evaluators(eval_set: TextEvalSet) -> dict[str, TextEvaluator]:
    """The family's evaluators, the generation one bound to the judge fitted for ``eval_set``."""
    evaluators: list[TextEvaluator] = [
        HeldoutBitsPerByte(),
        GenerationJudged(judge=eval_set.judge),
        Contamination(),
    ]
    return {evaluator.name: evaluator for evaluator in evaluators}
