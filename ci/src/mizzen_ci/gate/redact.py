"""The shown form of a metric-store URL: what every message, ``repr()`` and log line of the gate
uses instead of the URL itself.

Invariants:
- :func:`redact_url` is total (never raises) and its result holds no userinfo (user, password),
  query, ``;params`` or fragment: each becomes ``***``; a host that is not a plain host name,
  IPv4 or bracketed IPv6 address, a port that is not 1-5 digits, a database path outside
  ``[A-Za-z0-9_./-]`` and a scheme outside :data:`SHOWN_SCHEMES` become ``***`` too.  A value
  with no ``://`` (a SQLite path) is shown as a path, cut to :data:`MAX_SHOWN` characters.
- :func:`redact_text` masks, in free text (a driver's error message), every given secret and
  every ``scheme://…`` token (replaced by its :func:`redact_url` form); then
  :func:`mizzen_ci.output.plain` makes it one printable line.
- mizzen_ci depends on nothing, so this is its own copy of the rule
  ``mizzen_rollout.harbor.redaction`` applies to URLs: never show a userinfo, a query or a
  fragment.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

from ..output import plain

MASK = "***"
MAX_SHOWN = 200
SHOWN_SCHEMES = frozenset({"postgresql", "postgres", "sqlite", "file"})
_HOST = re.compile(
    r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*|\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:.]+\]"
)
_PORT = re.compile(r"\d{1,5}")
_PATH = re.compile(r"[A-Za-z0-9_./-]*")
_URL_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")


def _cut(text: str) -> str:
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "…"


def redact_url(url: object) -> str:
    """The shown form of a store URL (see the module docstring)."""
    try:
        text = str(url)
    except Exception:
        return MASK
    if "://" not in text:
        if "@" in text or "?" in text or "#" in text:  # a bare user:password@host
            return MASK
        return _cut(plain(text))
    try:
        parts = urlsplit(text.translate({9: None, 10: None, 13: None}))
        scheme = parts.scheme.lower()
        netloc = parts.netloc
        _, at, hostport = netloc.rpartition("@")
        if hostport.startswith("["):
            close = hostport.find("]")
            host = hostport[: close + 1] if close > 0 else hostport
            rest = hostport[close + 1 :] if close > 0 else ""
            port = rest[1:] if rest.startswith(":") else (rest and MASK)
        else:
            host, _, port = hostport.partition(":")
        shown = (scheme if scheme in SHOWN_SCHEMES else MASK) + "://"
        if at:
            shown += MASK + "@"
        shown += host if _HOST.fullmatch(host or "-") or not host else MASK
        if port:
            shown += ":" + (port if _PORT.fullmatch(port) else MASK)
        path = unquote(parts.path)
        shown += path if _PATH.fullmatch(path) else "/" + MASK
        if parts.query or ";" in parts.path:
            shown += "?" + MASK
        if parts.fragment:
            shown += "#" + MASK
        return _cut(shown)
    except Exception:
        return MASK


def redact_text(text: object, secrets: Iterable[str] = ()) -> str:
    """Free text with every secret and URL masked, as one printable line."""
    try:
        s = str(text)
    except Exception:
        return MASK
    for secret in sorted({x for x in secrets if x and len(x) >= 3}, key=len, reverse=True):
        s = s.replace(secret, MASK)
    s = _URL_TOKEN.sub(lambda m: redact_url(m.group()), s)
    return plain(s)


def url_secrets(url: str) -> list[str]:
    """The secret parts of a URL (its password, raw and decoded; its query), for
    :func:`redact_text` of messages that might repeat them."""
    try:
        parts = urlsplit(url)
    except Exception:
        return [url]
    out = []
    userinfo = parts.netloc.rpartition("@")[0]
    if userinfo:
        password = userinfo.partition(":")[2]
        out += [userinfo, password, unquote(password)]
    if parts.query:
        out += [parts.query, unquote(parts.query)]
    return [x for x in out if x]
