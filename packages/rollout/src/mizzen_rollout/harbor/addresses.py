"""Endpoint values we forward (provider address variables, the engine base URL), checked first.

    check_address(value, kind="url", field="DAYTONA_API_URL", fix="...")  # -> the value, or raises

Invariants:
- Every check reads the NFKC-normalised split of `redaction.split_url`, so a look-alike
  (fullwidth `＠ ： ／`, ...) cannot hide a userinfo, query or fragment from it; a value that NFKC
  changes at all is refused as well (a client would read it differently from what we checked).
- A forwarded endpoint is `FORMS[kind]` and nothing else. A userinfo, `;params`, a query, a
  fragment or an `@` anywhere is refused, not stripped (a silently rewritten endpoint is another
  endpoint). All queries and fragments are refused, not only secret-looking ones: a key under an
  innocent name (`?k=...`) cannot be told apart, and the SDKs join paths onto these values, which
  a query or fragment would break anyway.
- Host: ASCII after NFKC (internationalised names in punycode, `xn--...`), host-name characters,
  or a bracketed IPv6 literal that parses; port: a number from 1 to 65535.
- Every error is one `ProviderCredentialError` naming the field, every rule the value breaks and
  the fix (the caller's, which says why the form is what it is), and showing only `redaction.redact_url(value)`; a `url` value without a scheme is
  shown as `***` (it may be a key pasted into the wrong variable). Nothing else is raised,
  whatever the input.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from typing import Literal

from mizzen_rollout.harbor.errors import ProviderCredentialError
from mizzen_rollout.harbor.redaction import (
    MASK,
    UrlParts,
    redact_url,
    split_url,
    url_credential_problems,
)

AddressKind = Literal["url", "host", "name"]

#: what each kind of endpoint value may look like
FORMS: dict[str, str] = {
    "url": "http(s)://host[:port][/path]",
    "host": "host[:port]",
    "name": "a plain name (letters, digits, '.', '_', '-')",
}
_URL_SCHEMES = ("http", "https")
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_MAX_LENGTH = 2048


def _host_problems(host: str) -> list[str]:
    if not host:
        return ["the host is empty"]
    if not host.isascii():
        return [
            "the host is not ASCII after Unicode NFKC normalisation; write an internationalised "
            "name in punycode (xn--...)"
        ]
    if host.startswith("["):
        if not host.endswith("]"):
            return ["the host is an IPv6 literal without its closing ']'"]
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return ["the bracketed host is not an IPv6 address"]
        return []
    if "[" in host or "]" in host:
        return ["the host has a '[' or ']' outside a bracketed IPv6 literal"]
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return [
            "the host has characters or labels a host name cannot have (letters, digits, '-', "
            "'_' and dots between labels of at most 63 characters)"
        ]
    return []


def _port_problems(port: str | None) -> list[str]:
    """A port of digits out of range (a port that is not a number at all is one of the
    `url_credential_problems`: it may be a password)."""
    if port is None or not (port.isascii() and port.isdigit()):
        return []
    if len(port) > 5 or not 1 <= int(port) <= 65535:
        return ["the port is not a number from 1 to 65535"]
    return []


def _component_problems(parts: UrlParts) -> tuple[list[str], list[str]]:
    """(credential problems, other refused components) of `parts`; a component already counted
    as a credential is not listed again."""
    credentials = url_credential_problems(parts)
    flagged = " ".join(credentials)
    others = [
        f"it has a {label} ({mark}{MASK})"
        for label, mark, component in (
            (";params", ";", parts.params),
            ("query", "?", parts.query),
            ("fragment", "#", parts.fragment),
        )
        if component is not None and f"a {label} item" not in flagged
    ]
    return credentials, others


def address_problems(value: str, kind: AddressKind) -> tuple[list[str], list[str]]:
    """(credential problems, other problems) of `value` as an endpoint of `kind`; both empty
    when it may be forwarded."""
    if len(value) > _MAX_LENGTH:
        return [], [f"it is longer than {_MAX_LENGTH} characters"]
    parts = split_url(value)
    credentials, problems = _component_problems(parts)
    if kind == "url":
        if parts.scheme is None:
            problems.append("it has no scheme (write http:// or https://)")
        elif parts.scheme not in _URL_SCHEMES:
            problems.append("its scheme is not http or https")
        problems += _host_problems(parts.host) + _port_problems(parts.port)
    elif kind == "host":
        if parts.scheme is not None or parts.authority_marker or parts.path:
            problems.append("it has a scheme, slashes or a path; write the host alone")
        problems += _host_problems(parts.host) + _port_problems(parts.port)
    elif not _NAME.fullmatch(unicodedata.normalize("NFKC", value).strip()):
        problems.append("it is not a plain name")
    stripped = value.strip()
    if any(unicodedata.category(char)[0] in "CZ" for char in stripped):
        problems.append("it holds whitespace or control characters")
    elif unicodedata.normalize("NFKC", stripped) != stripped:
        problems.append(
            "it holds Unicode look-alikes that NFKC folds to other characters (e.g. fullwidth "
            "'＠' to '@'), which clients read differently; write it in plain ASCII"
        )
    return credentials, problems


def check_address(value: object, *, kind: AddressKind, field: str, fix: str) -> str:
    """`value`, stripped, if it may be forwarded as an endpoint of `kind`; else raise
    ProviderCredentialError naming `field`, the rules broken and `fix` (never the secret)."""
    if not isinstance(value, str):
        raise ProviderCredentialError(
            f"{field} is a {type(value).__name__}, not a string; fix: {fix}"
        )
    credentials, problems = address_problems(value, kind)
    if not credentials and not problems:
        return value.strip()
    parts = split_url(value)
    shown = MASK if kind == "url" and parts.scheme is None else redact_url(value)
    verdict = (
        f"carries credentials ({'; '.join(credentials)})"
        if credentials
        else "is not a valid endpoint"
    )
    rest = "".join(f"; {problem}" for problem in problems)
    raise ProviderCredentialError(f"{field}={shown} {verdict}{rest}; fix: {fix}")
