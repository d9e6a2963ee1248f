"""Ids and names that become paths, ledger keys or registry names: validated once, here.

Every entry point (CLI, trainer, Dagster config, sensors, the ledger) calls these before an id
touches a path or a query, so ``../x``, an absolute path, ``""``, ``.``, ``./victim`` or a
300-character id is refused with one clear message instead of reaching outside its folder or
aliasing another run.
"""

from __future__ import annotations

import re

from pipeline.data.families import SNAPSHOT_PREFIXES

# Letters, digits, ``-``, ``_``, ``.`` inside; starts with a letter or digit, so no id is a
# hidden file, ``.`` or ``..``; 128 characters leave room under every filesystem's 255-byte
# name limit for the prefixes and suffixes Tracks adds.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# A snapshot id's prefix names its model family (pipeline.data.families): no other prefix is
# an id, so a "digit-…" typo is refused here, not looked up as a snapshot that never exists.
_SNAPSHOT = re.compile(rf"(?:{'|'.join(map(re.escape, SNAPSHOT_PREFIXES))})-[0-9a-f]{{16}}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.parquet")
MAX_ID_LENGTH = 128


class InvalidIdError(ValueError):
    """An id or name that cannot be used as a path component or key."""

    def __init__(self, kind: str, value: object, rule: str) -> None:
        self.kind = kind
        self.value = value
        shown = (
            repr(value)
            if not isinstance(value, str) or len(value) <= 60
            else repr(value[:60]) + "…"
        )
        super().__init__(f"invalid {kind} {shown}: {rule}")


def _check(kind: str, value: object, pattern: re.Pattern[str], rule: str) -> str:
    if not isinstance(value, str):
        raise InvalidIdError(kind, value, "must be a string")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(kind, value, f"longer than {MAX_ID_LENGTH} characters")
    # fullmatch: "$" would also match before a trailing newline ("run\n" is no id).
    if not pattern.fullmatch(value) or ".." in value:
        raise InvalidIdError(kind, value, rule)
    return value


_NAME_RULE = (
    "use letters, digits, '-', '_' or '.', starting with a letter or digit, no '..', "
    f"at most {MAX_ID_LENGTH} characters"
)


def run_id(value: object) -> str:
    """A training run's id: one folder under the checkpoint store, one ledger key."""
    return _check("run id", value, _NAME, _NAME_RULE)


def model_family(value: object) -> str:
    return _check("model family", value, _NAME, _NAME_RULE)


def model_name(value: object) -> str:
    """A registered model's name in MLflow (it also names folders in the artifact store)."""
    return _check("model name", value, _NAME, _NAME_RULE)


def evaluator_name(value: object) -> str:
    return _check("evaluator name", value, _NAME, _NAME_RULE)


def snapshot_id(value: object) -> str:
    """A data snapshot's id: its family's prefix, ``-``, 16 hex digits of its content digest."""
    return _check(
        "snapshot id",
        value,
        _SNAPSHOT,
        f"expected {' or '.join(repr(p + '-') for p in SNAPSHOT_PREFIXES)} and 16 lowercase hex "
        "digits (e.g. digits-0123456789abcdef)",
    )


def is_snapshot_id(value: object) -> bool:
    return isinstance(value, str) and _SNAPSHOT.fullmatch(value) is not None


def landing_file_name(value: object) -> str:
    """A file name inside a landing folder: one component, ending in ``.parquet``."""
    return _check(
        "landing file name",
        value,
        _FILE_NAME,
        "one file name (no folders) of letters, digits, '-', '_', '.', ending in .parquet",
    )


def attempt_no(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 9999:
        raise InvalidIdError("attempt number", value, "must be an integer from 1 to 9999")
    return value
