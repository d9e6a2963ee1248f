"""Nested ``state_dict`` values ⇄ (JSON-able structure, flat tensor dict): no pickle anywhere.

Tensors go to safetensors under a dotted key; everything else becomes JSON. Tuples and dicts
with integer keys (an optimizer's ``state``) are tagged so they come back as they went in.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_INT_KEYS = "__int_keys__"
_BYTES = "__bytes__"
_FLOAT = "__float__"
_TAGS = (_TENSOR, _TUPLE, _INT_KEYS, _BYTES, _FLOAT)


class StateEncodingError(TypeError):
    """A state_dict value that is neither a tensor nor plain JSON data."""


def encode_state(value: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``value`` into a JSON-able structure and the tensors it references by key."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(value, prefix, tensors), tensors


def decode_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_state`."""
    if isinstance(value, list):
        return [decode_state(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == _TENSOR:
            if inner not in tensors:
                raise KeyError(f"tensor {inner!r} is referenced by the state but not stored")
            return tensors[inner]
        if tag == _TUPLE:
            return tuple(decode_state(v, tensors) for v in inner)
        if tag == _INT_KEYS:
            return {int(k): decode_state(v, tensors) for k, v in inner.items()}
        if tag == _BYTES:
            return base64.b64decode(inner)
        if tag == _FLOAT:
            return float(inner)
    return {k: decode_state(v, tensors) for k, v in value.items()}


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {_TENSOR: key}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        # JSON has no inf/nan; repr round-trips every finite float exactly.
        return value if math.isfinite(value) else {_FLOAT: repr(value)}
    if isinstance(value, bytes):
        return {_BYTES: base64.b64encode(value).decode()}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if value and all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {
                _INT_KEYS: {str(k): _encode(v, f"{key}.{k}", tensors) for k, v in value.items()}
            }
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or k in _TAGS:
                raise StateEncodingError(f"{key}: key {k!r} cannot be stored as JSON")
            out[k] = _encode(v, f"{key}.{k}", tensors)
        return out
    raise StateEncodingError(
        f"{key}: a {type(value).__name__} is neither a tensor nor JSON data; "
        "checkpoints never pickle, so give it a state_dict of tensors and plain values"
    )
