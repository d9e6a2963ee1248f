"""How an asset step fails on an error Tracks understands: one redacted sentence, no raw chain.

Dagster stores a failure's Python cause chain (``raise dg.Failure(...) from exc``) in the run's
event log verbatim, where the UI shows it; a driver's or library's message there may quote a
URL with its password. So the chain goes into the failure's metadata as redacted text, and the
failure is raised ``from None``.
"""

from __future__ import annotations

import traceback
from typing import Any

import dagster as dg

from pipeline import redact

# The end of a long chain is what names the failing call; the metadata stays small.
_CHAIN_CHARS = 8000


def step_failure(
    description: str, cause: BaseException, *, metadata: dict[str, Any] | None = None
) -> dg.Failure:
    """A failure that stops the step (no retry), to be raised ``from None``."""
    chain = redact.text("".join(traceback.format_exception(cause)))
    return dg.Failure(
        description=redact.text(description),
        metadata={**(metadata or {}), "error": dg.MetadataValue.text(chain[-_CHAIN_CHARS:])},
        allow_retries=False,
    )
