"""Decoding: greedy and sampled continuations that are identical under the recorded inputs.

Greedy (temperature 0) takes the arg-max at each step (the lowest id on a tie) and ignores
top-k, top-p and the seed. Sampling draws with a ``torch.Generator`` seeded for that one
sample, so a sample depends only on the weights, the prompt, the parameters and its seed, never
on what was sampled before it or in another process. One sequence at a time, no cache: a batch
or a key-value cache would change the arithmetic, and with it a sampled byte now and then.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch

from pipeline.textlm.tokenizer import EOT_ID, TOKENIZER

if TYPE_CHECKING:
    from pipeline.textlm.model import TextLM


class DecodingError(ValueError):
    """Decoding parameters that cannot be used; names the parameter."""


class StopReason(StrEnum):
    MAX_NEW_TOKENS = "max_new_tokens"
    STOP_SEQUENCE = "stop_sequence"
    END_OF_TEXT = "end_of_text"


@dataclass(frozen=True)
class DecodingParams:
    """How to continue a prompt. ``seed`` is the seed of this one sample."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 64
    stop_sequences: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise DecodingError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise DecodingError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise DecodingError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise DecodingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_sequences):
            raise DecodingError(
                f"stop sequences must be non-empty strings: {self.stop_sequences!r}"
            )
        if self.sampled and self.seed is None:
            raise DecodingError("sampled decoding (temperature > 0) needs a seed")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "stop_sequences": list(self.stop_sequences),
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Generation:
    """One continuation: its bytes (the stop sequence and EOT left out) and why it stopped."""

    output_ids: tuple[int, ...]
    stop_reason: StopReason

    @property
    def output_bytes(self) -> bytes:
        return bytes(self.output_ids)

    @property
    def output_sha256(self) -> str:
        return hashlib.sha256(self.output_bytes).hexdigest()

    @property
    def text(self) -> str:
        """For people: the output with undecodable bytes shown as U+FFFD."""
        return TOKENIZER.decode_lossy(self.output_ids)


# The numerics of an evaluation: one CPU thread, so float reductions add in one order in every
# process and on every machine (the trainer and the restore check do the same); with more
# threads a sampled byte could differ between the evaluation and its reproduction.
EVAL_THREADS = 1


@contextmanager
def evaluation_threads() -> Iterator[None]:
    """Run the block on :data:`EVAL_THREADS` torch threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(EVAL_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of an evaluation run under ``seed``."""
    return seed + sample_index


@torch.inference_mode()
def generate(model: TextLM, prompt_ids: Sequence[int], params: DecodingParams) -> Generation:
    """Continue ``prompt_ids`` with ``model`` (put in eval mode) under ``params``.

    The context is the last ``block_size`` tokens, on :data:`EVAL_THREADS` thread(s). Stops
    after ``max_new_tokens``, at EOT, or when the output's bytes end with a stop sequence
    (which is cut off the output).
    """
    if not prompt_ids:
        raise DecodingError("the prompt is empty: there is nothing to continue")
    with evaluation_threads():
        return _generate(model, prompt_ids, params)


def _generate(model: TextLM, prompt_ids: Sequence[int], params: DecodingParams) -> Generation:
    model.eval()
    block = model.config.block_size
    generator = None
    if params.sampled:
        generator = torch.Generator().manual_seed(int(params.seed))  # type: ignore[arg-type]
    stops = [s.encode("utf-8") for s in params.stop_sequences]
    context = torch.tensor([list(prompt_ids)], dtype=torch.long)
    output: list[int] = []
    for _ in range(params.max_new_tokens):
        logits = model(context[:, -block:])[0, -1].float()
        token = _next_token(logits, params, generator)
        if token == EOT_ID:
            return Generation(tuple(output), StopReason.END_OF_TEXT)
        output.append(token)
        produced = bytes(output)
        for stop in stops:
            if produced.endswith(stop):
                return Generation(
                    tuple(output[: len(output) - len(stop)]), StopReason.STOP_SEQUENCE
                )
        context = torch.cat([context, torch.tensor([[token]], dtype=torch.long)], dim=1)
    return Generation(tuple(output), StopReason.MAX_NEW_TOKENS)


def _next_token(
    logits: torch.Tensor, params: DecodingParams, generator: torch.Generator | None
) -> int:
    if not params.sampled:
        return int(torch.argmax(logits))  # the first maximum: ties go to the lowest id
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True, stable=True)
        # Keep the most likely tokens until their mass reaches top_p (the first always kept).
        drop = (torch.cumsum(ordered, dim=0) - ordered) >= params.top_p
        probs = probs.clone()
        probs[order[drop]] = 0.0
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
