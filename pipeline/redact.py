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
# The same rule over one whole URL (not free text): there the password may also hold
# whitespace (a space, a tab, a newline), which in free text would end the URL.
_WHOLE_URL_PASSWORD = re.compile(
    r"\A(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<secret>.*?)(?P<at>@)"
    r"(?=[^\s@/?#]*(?:[/?#]|\s*\Z))",
    re.DOTALL,
)
# What comes before anything that could be userinfo in a URL that does not parse.
_SCHEME = re.compile(r"\A[A-Za-z][A-Za-z0-9+.\-]*:/*")
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
    # a password by the whole-URL and text rules.
    value = _WHOLE_URL_PASSWORD.sub(lambda m: m["head"] + MASK + m["at"], value, count=1)
    return text(value)


def database_url(value: str) -> str:
    """A database URL fit to print (the ledger's, MLflow's): no part of its password shows.

    Where SQLAlchemy parses it, SQLAlchemy's own rendering with the password hidden (so what the
    driver would be handed as the password is what goes), then :func:`url` over that, for a
    password SQLAlchemy cut at an '@' and for secret query parameters. Where it does not parse
    (``postgresql:/u:pw@h/db``, a port that is not a number), everything that could be userinfo
    goes: up to the last '@' after the scheme, or all after the scheme when there is no '@'
    but a ':'.
    """
    from sqlalchemy.engine import make_url

    try:
        rendered = make_url(value).render_as_string(hide_password=True)
    except Exception:  # ArgumentError, ValueError (the port), anything a stranger string raises
        return _without_userinfo(value)
    return url(rendered)


def _without_userinfo(value: str) -> str:
    head = _SCHEME.match(value)
    scheme = head.group() if head else ""
    rest = value[len(scheme) :]
    if "@" in rest:
        return scheme + MASK + text(rest[rest.rindex("@") :])
    if ":" in rest:
        return scheme + MASK
    return text(value)


def text(value: str) -> str:
    """Every URL password inside free text (an error message, a log line) masked."""
    masked = _URL_PASSWORD.sub(lambda m: m["head"] + MASK + m["at"], value)
    return _QUERY_SECRET.sub(lambda m: m["key"] + MASK, masked)


def one_line(value: str) -> str:
    """``value`` on one line (every run of whitespace one space), redacted: ready to be cut to a
    length. Redact before cutting, always: a URL cut before its '@' no longer looks like one."""
    return text(" ".join(value.split()))
