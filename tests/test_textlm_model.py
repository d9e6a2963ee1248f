"""The text-lm tokenizer, model and decoding: exact round trips and reproducible generations."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.textlm.generation import DecodingError, DecodingParams, StopReason, generate
from pipeline.textlm.model import ModelConfigError, TextLMConfig, build_model, state_digest
from pipeline.textlm.tokenizer import EOT_ID, TOKENIZER, ByteTokenizer, TokenizerError
from tests.textlm_support import PROMPT, TINY, generation_digests, tiny_model

REPO = Path(__file__).resolve().parent.parent


def _random_text(rng: random.Random, length: int) -> str:
    # Any code point but the surrogates, which are not characters: every plane, controls, NUL.
    points = []
    while len(points) < length:
        point = rng.choice((rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x110000)))
        if not 0xD800 <= point <= 0xDFFF:
            points.append(point)
    return "".join(map(chr, points))


def test_tokenizer_round_trips_any_utf8_exactly() -> None:
    rng = random.Random(30)
    samples = [
        "",
        "plain ASCII\n",
        "caf\u00e9 \u2013 \u201cquoted\u201d na\u00efve \u00df 10\u00b0",
        "日本語のテキスト",
        "emoji \U0001f469\u200d\U0001f4bb and flags \U0001f1f3\U0001f1f4",
        "\x00\x01 controls \x7f",
        "<|endoftext|> is only text here",
        *(_random_text(rng, rng.randrange(1, 200)) for _ in range(200)),
    ]
    for text in samples:
        ids = TOKENIZER.encode(text)
        assert ids == list(text.encode("utf-8")) and EOT_ID not in ids
        assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.encode_document("hi") == [EOT_ID, ord("h"), ord("i")]
    assert TOKENIZER.vocab_size == 257 == TINY.vocab_size


def test_tokenizer_refuses_what_is_not_text_naming_the_position() -> None:
    with pytest.raises(TokenizerError, match="at character 2"):
        TOKENIZER.encode("ab\udce9")
    with pytest.raises(TokenizerError, match=r"byte 0xe9 at position 3"):
        TOKENIZER.decode(list(b"caf\xe9"))
    with pytest.raises(TokenizerError, match="id 256 at position 1 is the special EOT"):
        TOKENIZER.decode([65, EOT_ID])
    assert TOKENIZER.decode_lossy(list(b"caf\xe9")) == "caf\ufffd"
    # The digest is of the description: equal tokenizers, equal digests; a change, a new one.
    assert ByteTokenizer().digest == TOKENIZER.digest
    assert ByteTokenizer(version=2).digest != TOKENIZER.digest


def test_model_config_errors_name_the_field() -> None:
    with pytest.raises(ModelConfigError, match=r"model\.n_embd .* multiple of model\.n_head"):
        TextLMConfig(n_embd=30, n_head=4)
    with pytest.raises(ModelConfigError, match=r"unknown text-lm model field.*channels"):
        build_model({"channels": 8})
    with pytest.raises(ModelConfigError, match=r"model\.block_size must be a positive integer"):
        build_model({"block_size": 0})
    with pytest.raises(DecodingError, match="needs a seed"):
        DecodingParams(temperature=0.7)
    with pytest.raises(DecodingError, match="top_p"):
        DecodingParams(temperature=0.7, seed=1, top_p=0.0)


_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys
    import torch
    from safetensors.torch import load_file
    from pipeline.textlm.model import TextLM, TextLMConfig, state_digest
    from tests.textlm_support import generation_digests

    model = TextLM(TextLMConfig(**json.loads(sys.argv[2])))
    model.load_state_dict(load_file(sys.argv[1]))
    torch.set_num_threads(2)  # the evaluation pins its own thread count
    print(json.dumps({"digest": state_digest(model), **generation_digests(model, (7, 8))}))
    """
)


def test_greedy_and_sampled_generations_repeat_exactly_across_processes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_model(seed=3)
    here = generation_digests(model, (7, 8))
    assert here == generation_digests(model, (7, 8))  # again, in this process
    assert here["sampled-7"] != here["sampled-8"]  # the seed decides the sample
    assert here["sampled-7"] != here["greedy"]

    weights = tmp_path / "model.safetensors"
    save_file(model.state_dict(), weights)
    done = subprocess.run(
        [sys.executable, "-c", _IN_A_FRESH_PROCESS, str(weights), json.dumps(TINY.to_dict())],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there.pop("digest") == state_digest(model)
    assert there == here


def test_generation_stops_at_a_stop_sequence_and_leaves_it_out() -> None:
    model = tiny_model(seed=3)
    prompt = TOKENIZER.encode(PROMPT)
    free = generate(model, prompt, DecodingParams(max_new_tokens=24))
    assert free.stop_reason is StopReason.MAX_NEW_TOKENS and len(free.output_ids) == 24
    # Stop at the first ASCII byte after the first: the same run, cut just before it.
    position = next(i for i, b in enumerate(free.output_bytes) if i and b < 0x80)
    stop = chr(free.output_bytes[position])
    stopped = generate(model, prompt, DecodingParams(max_new_tokens=24, stop_sequences=(stop,)))
    assert stopped.stop_reason is StopReason.STOP_SEQUENCE
    cut = free.output_bytes.index(stop.encode())
    assert stopped.output_bytes == free.output_bytes[:cut] and cut <= position
