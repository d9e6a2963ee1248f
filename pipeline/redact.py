"""Secrets out of anything printed or stored: URLs lose their password, text its URLs' passwords."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# scheme://user:password@host — the password runs from the first ':' after the user to the '@'
# that starts the host, which may be any '@' but the last one of the URL: an unencoded password
# may hold '/', '#', ':' or '@' itself. The host is what follows that '@' up to the first '/',
# '?', '#' or whitespace, and holds no '@'; the shortest password that leaves such a host wins,
# so an '@' further on (an e-mail address in the query) stays where it is.
_URL_PASSWORD = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<secret>\S*?)(?P<at>@)"
    r"(?=[^\s@/?#]*(?:[/?#\s]|$))"
)
# A query parameter whose name says it holds a secret, wherever that word sits in the name
# (sslpassword, access_token, client_secret, apikey).
_QUERY_SECRET = re.compile(
    r"(?i)(?P<key>[?&;][\w.\-]*(?:password|passwd|pwd|token|secret|api_?key)[\w.\-]*=)[^&;\s#]+"
)


def url(value: str) -> str:
    """``value`` with any password (and password-like query parameter) masked."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return text(value)
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        user = parts.username or ""
        value = urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{netloc[-1]}"))
    # urlsplit ends the netloc at the first '/' or '#': a password holding one is only seen as
    # a password by the text rules.
    return text(value)


def text(value: str) -> str:
    """Every URL password inside free text (an error message, a log line) masked."""
    masked = _URL_PASSWORD.sub(lambda m: m["head"] + MASK + m["at"], value)
    return _QUERY_SECRET.sub(lambda m: m["key"] + MASK, masked)


def one_line(value: str) -> str:
    """``value`` on one line (every run of whitespace one space), redacted: ready to be cut to a
    length. Redact before cutting, always: a URL cut before its '@' no longer looks like one."""
    return text(" ".join(value.split()))
