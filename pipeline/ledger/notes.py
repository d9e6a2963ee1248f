"""The logbook's rules: what a note, its author and its source may hold, checked before a write.

A note is a short human sentence on a run or an attempt (why the learning rate changed, why a
run was restarted). It is only ever added: the ledger offers no way to edit or delete one, and
the database refuses an UPDATE or DELETE on ``notes`` (migration 0006's triggers).
"""

from __future__ import annotations

import getpass
import os
import unicodedata

from pipeline import redact
from pipeline.ledger.errors import LedgerError

MAX_NOTE_CHARS = 2000
MAX_AUTHOR_CHARS = 128
MAX_SOURCE_CHARS = 128
# The source of a note Tracks writes itself (what a Dagster run that lost the race to end an
# attempt saw); a person's note comes from the CLI ("cli") or a launch, never from here.
NOTE_SOURCE_OF_TRACKS = "training_attempt"
# Characters that reorder what a terminal shows (the "trojan source" controls): a note printed
# by `tracks explain` must read as it was written.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


class InvalidNoteError(LedgerError, ValueError):
    """A note, author or source the logbook refuses; the message says which and why."""

    def __init__(self, what: str, problem: str) -> None:
        super().__init__(f"{what} refused: {problem}")
        self.what = what
        self.problem = problem


def _refuse_control(what: str, value: str, allowed: str = "") -> None:
    for position, char in enumerate(value, start=1):
        if char in allowed:
            continue
        if unicodedata.category(char) == "Cc" or char in _BIDI_CONTROLS:
            name = unicodedata.name(char, "control character")
            raise InvalidNoteError(
                what, f"character {position} is U+{ord(char):04X} ({name.lower()}), not text"
            )


def note_text(value: object, what: str = "note") -> str:
    """The text as it is stored: stripped, Windows line ends made ``\\n``, URL passwords masked.

    Refused when it is not a string, empty once stripped, longer than :data:`MAX_NOTE_CHARS`,
    or holds a control character other than a newline.
    """
    if not isinstance(value, str):
        raise InvalidNoteError(what, f"expected text, got {type(value).__name__}")
    text = value.replace("\r\n", "\n").strip()
    if not text:
        raise InvalidNoteError(what, "it is empty")
    if len(text) > MAX_NOTE_CHARS:
        raise InvalidNoteError(
            what, f"{len(text)} characters, at most {MAX_NOTE_CHARS} (a note is a sentence or two)"
        )
    _refuse_control(what, text, allowed="\n")
    # A note may quote a connection string: stored without its password, like every detail.
    return redact.text(text)


def one_line_name(value: object, what: str, limit: int) -> str:
    """An author or a source: one line of at most ``limit`` characters, stripped."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidNoteError(what, "it is empty")
    name = value.strip()
    if len(name) > limit:
        raise InvalidNoteError(what, f"{len(name)} characters, at most {limit}")
    _refuse_control(what, name)
    return redact.text(name)


def os_user() -> str:
    """Who runs this process: ``$USER``, else the password database, else ``uid-N``.

    The same rule as the trainer's owner of a self-owned run (pipeline/trainer/attempt.py).
    """
    try:
        return os.environ.get("USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (common in containers)
        return f"uid-{os.getuid()}"
