"""The text-lm model: a small causal transformer over bytes (nanoGPT's shape, CPU-sized).

Pre-norm blocks of causal self-attention and an MLP, learned positions, no weight tying: the
checkpoint writer saves each tensor as its own safetensors entry, and a tied embedding would
be one storage under two names. Deterministic on CPU under Tracks' deterministic kernels
(``pipeline.determinism``): the same weights and inputs give the same logits, bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.textlm.tokenizer import VOCAB_SIZE

if TYPE_CHECKING:
    from pipeline.textlm.generation import Generation

MODEL_FAMILY = "text-lm"


class ModelConfigError(ValueError):
    """A ``model`` section the text-lm family cannot build; names the field."""


@dataclass(frozen=True)
class TextLMConfig:
    """The shape of a :class:`TextLM`; every field is recorded with the checkpoint."""

    vocab_size: int = VOCAB_SIZE
    block_size: int = 128  # the longest context, in bytes
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ModelConfigError(
                f"model.n_embd ({self.n_embd}) must be a multiple of model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ModelConfigError(f"model.dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def from_dict(cls, model_config: dict[str, Any]) -> TextLMConfig:
        """From the ``model`` section of a training config; unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(model_config) - known - {"family"})
        if unknown:
            raise ModelConfigError(
                f"unknown text-lm model field(s) {', '.join(unknown)}; known: {sorted(known)}"
            )
        values = {k: v for k, v in model_config.items() if k in known}
        if "dropout" in values:
            values["dropout"] = float(values["dropout"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TextLMConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        heads = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(batch, time, channels))


class Block(nn.Module):
    def __init__(self, config: TextLMConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TextLM(nn.Module):
    """Next-byte logits ``[B, T, vocab]`` for token ids ``[B, T]`` (T <= block_size)."""

    def __init__(self, config: TextLMConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"{time} tokens exceed the block size {self.config.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) over windows ``[B, T + 1]`` of token ids."""
        logits = self(windows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_sequences: Sequence[str] = (),
        seed: int | None = None,
    ) -> Generation:
        """Continue ``prompt_ids``: greedy at temperature 0, else sampled under ``seed``.

        See :func:`pipeline.textlm.generation.generate`, which this calls.
        """
        from pipeline.textlm.generation import DecodingParams, generate

        params = DecodingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_sequences=tuple(stop_sequences),
            seed=seed,
        )
        return generate(self, prompt_ids, params)


def _init_weights(module: nn.Module) -> None:
    # nanoGPT's initialisation; the trainer seeds torch before building the model.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def build_model(model_config: dict[str, Any]) -> TextLM:
    """Build the model from the ``model`` section of a training config."""
    return TextLM(TextLMConfig.from_dict(model_config))


def state_digest(model: nn.Module) -> str:
    """``sha256:<hex>`` over every tensor's name, dtype, shape and bytes, in name order.

    What an evaluation records as the weights it ran; equal digests, equal weights.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()
