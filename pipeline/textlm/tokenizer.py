"""The byte-level tokenizer of the text-lm family: ids 0..255 are bytes, 256 ends a document.

No vocabulary to fit and none to drift: any UTF-8 text encodes, and decodes back exactly.
Its digest is the sha256 of its canonical JSON description, so an evaluation records which
tokenizer its prompts went through, and a changed tokenizer is a different digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.digests import sha256_json

BYTE_VOCAB = 256
EOT_ID = 256  # end of text: separates documents in training, and starts each one
EOT_TOKEN = "<|endoftext|>"
VOCAB_SIZE = BYTE_VOCAB + 1
TOKENIZER_VERSION = 1


class TokenizerError(ValueError):
    """Text that cannot be encoded, or ids that cannot be decoded; names the position."""


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids, plus one special token (:data:`EOT_ID`)."""

    name: str = "bytes-utf8"
    version: int = TOKENIZER_VERSION

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def eot_id(self) -> int:
        return EOT_ID

    def describe(self) -> dict[str, Any]:
        """What the tokenizer is, as the canonical description its digest is taken over."""
        return {
            "name": self.name,
            "version": self.version,
            "kind": "byte-level",
            "encoding": "utf-8",
            "byte_ids": f"0..{BYTE_VOCAB - 1} = the byte's value",
            "specials": {EOT_TOKEN: EOT_ID},
            "vocab_size": VOCAB_SIZE,
        }

    @property
    def digest(self) -> str:
        return "sha256:" + sha256_json(self.describe())

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes; never a special id, whatever the text says.

        Raises :class:`TokenizerError` for a lone surrogate (text that is not Unicode).
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(
                f"text is not valid Unicode: {exc.object[exc.start]!r} at character {exc.start}"
            ) from None
        return list(data)

    def encode_document(self, text: str) -> list[int]:
        """``[EOT] + encode(text)``: a document as training and scoring see it, begun by EOT."""
        return [EOT_ID, *self.encode(text)]

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of byte ids; a special or unknown id raises, naming its position."""
        for position, token in enumerate(ids):
            if not 0 <= int(token) < BYTE_VOCAB:
                what = "the special EOT" if token == EOT_ID else "not a token"
                raise TokenizerError(f"id {token} at position {position} is {what}, not a byte")
        return bytes(int(t) for t in ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of byte ids, decoded strictly; bytes that are not UTF-8 raise."""
        data = self.decode_bytes(ids)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizerError(
                f"ids are not UTF-8: byte 0x{data[exc.start]:02x} at position {exc.start}"
            ) from None

    def decode_lossy(self, ids: Sequence[int]) -> str:
        """For people: undecodable bytes become U+FFFD (compare the bytes, never this)."""
        return self.decode_bytes(ids).decode("utf-8", "replace")


TOKENIZER = ByteTokenizer()
