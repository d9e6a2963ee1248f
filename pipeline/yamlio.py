"""YAML read strictly: a duplicate key is an error naming the file and line, never a silent win."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YamlError(ValueError):
    """A YAML document that cannot be read as Tracks config."""


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def loads(text: str, *, source: str = "<string>") -> Any:
    """Parse ``text``; errors name ``source`` and the line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.constructor.ConstructorError as exc:
        if exc.problem and exc.problem.startswith("duplicate key"):
            line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
            raise YamlError(f"{source}: {exc.problem}, again on line {line}") from None
        raise YamlError(f"{source}: is not valid YAML ({exc})") from None
    except yaml.YAMLError as exc:
        raise YamlError(f"{source}: is not valid YAML ({exc})") from None


def load_file(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise YamlError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise YamlError(f"{path}: not UTF-8 text") from None
    return loads(text, source=str(path))
