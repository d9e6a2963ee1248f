"""The data side of each model family: its snapshot id prefix and its landing folder.

A snapshot records the family its data is for (the manifest's ``family`` key, and the id's
prefix: ``digits-…``, ``text-…``), so every later step (the checks, the trainer's family table in
:mod:`pipeline.trainer.families`, evaluation) knows what the rows mean from the snapshot alone.
This module imports nothing: :mod:`pipeline.ids` validates snapshot ids against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DIGITS = "digits-cnn"
TEXT = "text-lm"
# A manifest written before families existed has no "family" key: it holds digits.
DEFAULT_FAMILY = DIGITS


@dataclass(frozen=True)
class FamilyData:
    """Where a family's data lands and how its snapshots are named."""

    family: str
    snapshot_prefix: str  # the id is "<prefix>-<16 hex>"
    # The landing folder below the landing root; None: the landing root itself (the digits
    # landed there before any other family existed, and still do).
    landing_subdir: str | None


FAMILY_DATA: dict[str, FamilyData] = {
    DIGITS: FamilyData(DIGITS, "digits", None),
    TEXT: FamilyData(TEXT, "text", "text-lm"),
}
FAMILIES: tuple[str, ...] = tuple(FAMILY_DATA)
SNAPSHOT_PREFIXES: tuple[str, ...] = tuple(f.snapshot_prefix for f in FAMILY_DATA.values())
# Sub-folders of the landing root that belong to another family: the digits never read them.
FAMILY_LANDING_SUBDIRS: frozenset[str] = frozenset(
    f.landing_subdir for f in FAMILY_DATA.values() if f.landing_subdir is not None
)


class UnknownFamilyError(ValueError):
    """A model family no snapshot can hold (a typo in a config or on the command line)."""

    def __init__(self, family: object) -> None:
        super().__init__(f"unknown model family {family!r}: expected one of {', '.join(FAMILIES)}")
        self.family = family


def family_data(family: str) -> FamilyData:
    """The data facts of ``family``; raises :class:`UnknownFamilyError` naming it."""
    try:
        return FAMILY_DATA[family]
    except (KeyError, TypeError):
        raise UnknownFamilyError(family) from None


def family_of_prefix(prefix: str) -> str:
    """The family whose snapshot ids start with ``prefix-``."""
    for data in FAMILY_DATA.values():
        if data.snapshot_prefix == prefix:
            return data.family
    raise UnknownFamilyError(f"(snapshot prefix {prefix!r})")


def landing_dir_for(landing_root: Path, family: str) -> Path:
    """The folder a family's landing files are dropped in: the root itself for the digits,
    ``<landing_root>/text-lm`` for text."""
    subdir = family_data(family).landing_subdir
    return Path(landing_root) if subdir is None else Path(landing_root) / subdir
