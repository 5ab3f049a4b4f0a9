"""The shown form of a metric-store URL: what every message, ``repr()`` and log line of the gate
uses instead of the URL itself.

Invariants:
- :func:`redact_url` is total (never raises) and its result holds no userinfo (user, password),
  query, ``;params`` or fragment: each becomes ``***``; a host that is not a plain host name,
  IPv4 or bracketed IPv6 address, a port that is not 1-5 digits, a database path outside
  ``[A-Za-z0-9_./-]`` and a scheme outside :data:`SHOWN_SCHEMES` become ``***`` too.  A value
  with no ``://`` (a SQLite path) is shown as a path, cut to :data:`MAX_SHOWN` characters.
- A libpq key/value string (``host=… port=… dbname=… user=… password=…``,
  :func:`mizzen_ci.masking.is_conninfo`) is shown as ``host=H port=P dbname=D`` (each value only
  when it has the shape above) with every other keyword's value ``***``; one that does not parse
  is ``***`` whole.
- :func:`redact_text` masks, in free text (a driver's error message), every given secret and
  every ``scheme://…`` token (replaced by its :func:`redact_url` form); then
  :func:`mizzen_ci.output.plain` makes it one printable line, masking every value of the
  process-wide mask set (:mod:`mizzen_ci.masking`).  These shape rules are the first line; the
  mask set, where every store URL is registered when it is chosen, is the guarantee.
- mizzen_ci depends on nothing, so this is its own copy of the rule
  ``mizzen_rollout.harbor.redaction`` applies to URLs: never show a userinfo, a query or a
  fragment.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

from ..masking import connection_secrets, conninfo_pairs, is_conninfo
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
        if is_conninfo(text):
            return redact_conninfo(text)
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


_SHOWN_KEYWORDS = {"host": _HOST, "hostaddr": _HOST, "port": _PORT, "dbname": _PATH}


def redact_conninfo(text: str) -> str:
    """The shown form of a libpq key/value string (see the module docstring)."""
    pairs = conninfo_pairs(text)
    if not pairs:
        return MASK
    shown = []
    for key, value in pairs:
        rule = _SHOWN_KEYWORDS.get(key)
        ok = rule is not None and bool(value) and bool(rule.fullmatch(value))
        shown.append(f"{key}={value if ok else MASK}")  # a keyword is [A-Za-z_][A-Za-z0-9_]*
    return _cut(" ".join(shown))


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
    """The secret parts of a store URL or libpq string (a URL's userinfo, password raw and
    decoded, and query; a key/value string's secret values), for :func:`redact_text` of messages
    that might repeat them."""
    if "://" not in url:
        return connection_secrets(url)
    try:
        parts = urlsplit(url)
    except Exception:
        return [url]
    out = connection_secrets(url)
    userinfo = parts.netloc.rpartition("@")[0]
    if userinfo:
        out += [userinfo]
    if parts.query:
        out += [parts.query, unquote(parts.query)]
    return [x for x in out if x]
