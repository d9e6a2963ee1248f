"""Secrets out of anything printed or stored: URLs lose their password, text its URLs' passwords."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# scheme://user:password@host — the password is everything between the first ':' after '//'
# and the last '@' before the host.
_URL_PASSWORD = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<secret>[^\s@/]+)(?P<at>@)"
)
_QUERY_SECRET = re.compile(r"(?i)(?P<key>[?&](?:password|passwd|pwd|token|secret|api_key)=)[^&\s]+")


def url(value: str) -> str:
    """``value`` with any password (and password-like query parameter) masked."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return text(value)
    if parts.password is None:
        return _QUERY_SECRET.sub(lambda m: m["key"] + MASK, value)
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    masked = urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{netloc[-1]}"))
    return _QUERY_SECRET.sub(lambda m: m["key"] + MASK, masked)


def text(value: str) -> str:
    """Every URL password inside free text (an error message, a log line) masked."""
    masked = _URL_PASSWORD.sub(lambda m: m["head"] + MASK + m["at"], value)
    return _QUERY_SECRET.sub(lambda m: m["key"] + MASK, masked)
