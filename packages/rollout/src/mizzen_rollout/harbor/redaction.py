"""What may be shown: the one module that recognises secrets and masks them.

Everything the Harbor integration prints, raises, logs, `repr()`s or serialises about a value that
may hold a secret goes through this module:
- `redact_url(value)`: THE redaction of a URL-like value (a provider address, the engine base URL,
  a URL inside a kwarg or inside a message). Every error about a URL shows only this form.
- `redact_text(text)`: free text we did not write (Harbor's exception messages): known secret
  values are masked, then every URL-like token is replaced by its `redact_url` form, the value of
  every `NAME=value` / `NAME: value` / `NAME value` (a `--flag`) / `"NAME": "value"` /
  `("NAME", "value")` with a password-like NAME (quoted or not, `export NAME="value"` too) and of
  every `Bearer <value>` is masked, then control and bidirectional-format characters are escaped,
  and last the process-wide mask set (`mizzen_rollout.masking.mask`) masks every registered
  secret: these shape rules are a first line, the mask set is what guarantees.
- `redact_value(value)` / `shown(value)`: a JSON-like structure (kwargs, settings fields) for
  `repr()`, log lines and error messages.
- `is_sensitive_name(name)`: the one rule for password-like names (environment variables, kwargs
  keys at any depth, query and parameter keys).
- `credential_shape(text)`: strings that carry a credential whatever key holds them
  (`Bearer <token>`, `API_KEY=<value>`, a URL with a userinfo, query, `;params` or fragment).
- `Secret`: a `str` whose `repr()` is masked, for key values that must exist in a worker.

Invariants:
- Text is NFKC-normalised (and tab, CR and LF removed, as URL parsers do) before it is parsed, so
  look-alikes (fullwidth `＠ ： ／ ？ ＃ ； ＼`, small `﹫ ﹕`) are the ASCII characters they fold to
  and cannot hide a userinfo, a query or a fragment from the parser.
- `redact_url` is total (it never raises, whatever the input) and its output holds: no userinfo,
  `;params`, query or fragment (each becomes `***`); no host that is not a plain host name or a
  bracketed IPv6 literal, no port that is not 1-5 digits and no scheme outside `SHOWN_SCHEMES`
  (each becomes `***`); when an `@` (also percent-encoded) follows the host, neither the host, the
  port nor any path segment up to that `@` (they are the rest of a userinfo cut short by a `/`,
  `?`, `#` or `;` in it), nor the host, port and path after a userinfo holding `@ ; = &` (a
  parameter that swallowed the `@` of a secret, `h;k=a@b/c`); only printable ASCII (the rest of the path is percent-encoded); at most
  `MAX_SHOWN` characters.
- Parsing takes the most lenient reading any client has, so that a userinfo some client would
  find is masked: the WHATWG URL rules (browsers, Node, curl's leniency) where they differ from
  RFC 3986 parsers such as `urllib` and httpx. For special schemes (http, https, ws, wss, ftp,
  file) any run of `/` and `\\` after `scheme:` introduces the authority (`https:/u:p@h` and
  `https:u:p@h` have a userinfo); the authority ends at the first `/`, `\\`, `?` or `#`; the
  userinfo ends at the authority's last `@`. A value with no scheme (`user:pw@host`,
  `//user:pw@host`, `host:port`) is read as an authority.
- A name is password-like when its NFKC case-folded form, default-ignorable characters
  (zero-width, joiners, bidi controls) removed, contains `pass`, `secret`, `token`,
  `key`, `credential`, `auth`, `cookie` or `signature`, or the word `sig`
  (`mizzen_rollout.masking.is_sensitive_name`, the one rule). That makes `max_tokens`
  password-like too: callers decide what such a name may hold (numbers and booleans, never text).
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from mizzen_rollout.masking import IGNORABLE_CHARACTERS, is_sensitive_name, mask

MASK = "***"
#: the longest redacted URL or shown value (longer ones are cut, with `...`)
MAX_SHOWN = 300
#: schemes shown as written; any other scheme is masked (a "scheme" may be a pasted key)
SHOWN_SCHEMES = frozenset(
    {"http", "https", "ws", "wss", "ftp", "file", "tcp", "unix", "ssh", "grpc", "grpcs"}
)
_SPECIAL_SCHEMES = frozenset({"http", "https", "ws", "wss", "ftp", "file"})

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_URL_REMOVED = dict.fromkeys(map(ord, "\t\n\r"))  # WHATWG drops these anywhere in a URL
_HOST_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?")
_IPV6_CHARS = re.compile(r"\[[0-9A-Fa-f:.]+\]")
_PORT_TEXT = re.compile(r"[0-9]{1,5}")
_PATH_SAFE = "!$&'()*+,=:~-._%"
#: URL-like tokens inside free text: special schemes with any slashes, other schemes with `//`,
#: scheme-relative `//...`, bare `user:password@host`, and a bare dotted host or IPv6 literal
#: (with port and path) followed by a query, `;params` or fragment
_URL_IN_TEXT = re.compile(
    r"(?:(?<![\w+.-])(?:https?|wss?|ftp|file):[/\\]*(?=[^\s<>`])"
    r"|(?<![\w+.-])[A-Za-z][A-Za-z0-9+.-]*:[/\\]{2}"
    r"|(?<![\w:/\\])[/\\]{2}(?=[^\s/\\]))[^\s<>`]*"
    r"|(?<![\w/@:.%~+!$&()*,=-])[\w.%~+!$&()*,=-]+:(?![/\\]{2})[^\s@<>`]*@[^\s<>`]+"
    r"|(?<![\w.@/:%-])(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)(?::[0-9]*)?"
    r"(?:/[^\s<>`?#;]*)?[?#;][^\s<>`]*"
)
_AUTH_HEADER_VALUE = re.compile(r"(bearer|basic|digest|token)\s+\S+", re.IGNORECASE)
#: inside free text: `Bearer <credential>` and `NAME=<value>` / `NAME: <value>`
_AUTH_IN_TEXT = re.compile(r"\b(bearer|basic|digest)(\s+)[^\s,;'\"]+", re.IGNORECASE)
#: a name (a `--flag` too; default-ignorable characters inside it are part of it), optionally
#: quoted, then `=` / `:` (or `,` between two quoted items: a pair), then a value, quoted or not
_NAME = rf"-{{0,2}}[A-Za-z_](?:[\w.-]|[{IGNORABLE_CHARACTERS}])*"
_QUOTED = r"\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'"
_ASSIGNMENT_IN_TEXT = re.compile(
    rf"(?<![\w-])(?P<q>[\"']?)(?P<name>{_NAME})(?P=q)"
    rf"(?P<sep>\s*[=:]\s*|(?<=[\"'])\s*,\s*(?=[\"']))(?P<value>{_QUOTED}|[^\s,;'\"]+)"
)
#: `--api-key VALUE` (a flag followed by its value, as in a command line)
_FLAG_IN_TEXT = re.compile(
    rf"(?<![\w-])(?P<q>[\"']?)(?P<name>--?[A-Za-z_](?:[\w.-]|[{IGNORABLE_CHARACTERS}])*)(?P=q)"
    rf"(?P<sep>\s+|\s*,\s*)(?P<value>{_QUOTED}|[^\s,;'\"-][^\s,;'\"]*)"
)
_ASSIGNMENT = re.compile(
    rf"(?:export\s+)?[\"']?({_NAME})[\"']?\s*[=:]\s*(\S.*)|(--?[A-Za-z_][\w.-]*)\s+(\S.*)",
    re.DOTALL,
)
_TEMPLATE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_BOOLEAN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "none"})
_MIN_SECRET_LENGTH = 4


def normalize(text: str) -> str:
    """NFKC, then tab/CR/LF removed and outer whitespace stripped: the form every check reads."""
    return unicodedata.normalize("NFKC", text).translate(_URL_REMOVED).strip()


def is_template(text: str) -> bool:
    """`${VAR}` exactly: a reference Harbor resolves in `AgentConfig.env` (and only there)."""
    return bool(_TEMPLATE.fullmatch(text))


class Secret(str):
    """A key value: a plain `str` everywhere (equality, `os.environ`, f-strings), but `repr()`
    shows `'***'`, so a dict of resolved keys printed or logged by mistake shows no key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(MASK)


# ----------------------------------------------------------------------------------- URLs


@dataclass(frozen=True, repr=False)
class UrlParts:
    """A URL-like value split the way clients split it (see the module docstring).

    `None` means the component is absent; `""` that it is present and empty (`https://h/?`).
    The `repr()` is the redacted URL: these parts hold the secrets `redact_url` masks.
    """

    scheme: str | None  # lower-cased
    authority_marker: str  # "//" when written with slashes (or a special scheme), else ""
    userinfo: str | None
    host: str
    port: str | None
    path: str  # backslashes read as slashes
    params: str | None  # `;...` in the authority or the path
    query: str | None
    fragment: str | None

    def __repr__(self) -> str:
        return f"UrlParts({_render(self)!r})"


def split_url(value: object) -> UrlParts:
    """Split `value` (NFKC-normalised first); never raises."""
    text = normalize(str(value))
    text, hashed, fragment = text.partition("#")
    text, asked, query = text.partition("?")
    scheme: str | None = None
    marker = ""
    rest = text
    match = _SCHEME.match(text)
    if match:
        name = match.group()[:-1].lower()
        after = text[match.end() :]
        if name in _SPECIAL_SCHEMES:
            scheme, rest, marker = name, after.lstrip("/\\"), "//"
        elif after.startswith("//"):
            scheme, rest, marker = name, after[2:], "//"
    if scheme is None:
        rest = text.lstrip("/\\")
        marker = "//" if rest != text else ""
    cut = min([i for i in (rest.find("/"), rest.find("\\")) if i != -1], default=len(rest))
    authority, path = rest[:cut], rest[cut:].replace("\\", "/")
    userinfo: str | None = None
    if "@" in authority:
        userinfo, _, authority = authority.rpartition("@")
    # `;params` run from the first `;` after the userinfo to the query: a `;` in the host part
    # takes the whole path with it (a parameter value may hold `/`)
    authority, semi, authority_params = authority.partition(";")
    if semi:
        params: str | None = authority_params + path
        path = ""
    else:
        path, path_semi, path_params = path.partition(";")
        params = path_params if path_semi else None
    port: str | None = None
    host = authority
    if authority.startswith("["):
        close = authority.find("]")
        tail = authority[close + 1 :] if close != -1 else ""
        if close != -1 and (not tail or tail.startswith(":")):
            host = authority[: close + 1]
            port = tail[1:] if tail else None
    else:
        host, colon, port_text = authority.partition(":")
        port = port_text if colon else None
    return UrlParts(
        scheme=scheme,
        authority_marker=marker,
        userinfo=userinfo,
        host=host,
        port=port,
        path=path,
        params=params,
        query=query if asked else None,
        fragment=fragment if hashed else None,
    )


def host_is_shown(host: str) -> bool:
    """A host name of plain characters or a bracketed IPv6-looking literal (else it is masked)."""
    return host == "" or (
        len(host) <= 255 and bool(_HOST_NAME.fullmatch(host) or _IPV6_CHARS.fullmatch(host))
    )


def _render_path(path: str, *, up_to_end: bool) -> str:
    """Path segments percent-encoded to printable ASCII; every segment up to the last one with an
    `@` (all of them when `up_to_end`) masked: they may be the rest of a cut-short userinfo."""
    segments = path.split("/")
    last_at = max((i for i, seg in enumerate(segments) if "@" in unquote(seg)), default=-1)
    if up_to_end:
        last_at = len(segments) - 1
    return "/".join(
        MASK if index <= last_at and segment else quote(segment, safe=_PATH_SAFE)
        for index, segment in enumerate(segments)
    )


def _at_after_host(parts: UrlParts) -> bool:
    """An `@` (also percent-encoded) in the path, `;params`, query or fragment: a userinfo cut
    short by a `/`, `\\`, `?`, `#` or `;` in it, so the "host" before it is part of it too."""
    rest = (parts.path, parts.params or "", parts.query or "", parts.fragment or "")
    return any("@" in unquote(component) for component in rest)


def _render(parts: UrlParts) -> str:
    out: list[str] = []
    if parts.scheme is not None:
        out.append(f"{parts.scheme if parts.scheme in SHOWN_SCHEMES else MASK}:")
    out.append(parts.authority_marker)
    if parts.userinfo is not None:
        out.append(f"{MASK}@")
    # A userinfo holding `@ ; = &` may be a parameter or query that swallowed the `@` of a secret
    # (`h;k=a@b/c`): then the "host", port and path after it may be the rest of that secret.
    ambiguous = any(char in (parts.userinfo or "") for char in "@;=&")
    cut_short = ambiguous or _at_after_host(parts)
    out.append(parts.host if host_is_shown(parts.host) and not cut_short else MASK)
    if parts.port is not None:
        port_shown = _PORT_TEXT.fullmatch(parts.port or "0") and not cut_short
        out.append(":" + (parts.port if port_shown else MASK))
    later = (parts.params or "", parts.query or "", parts.fragment or "")
    up_to_end = ambiguous or any("@" in unquote(component) for component in later)
    out.append(_render_path(parts.path, up_to_end=up_to_end))
    for mark, component in ((";", parts.params), ("?", parts.query), ("#", parts.fragment)):
        if component is not None:
            out.append(mark + (MASK if component else ""))
    return _bounded("".join(out))


def redact_url(value: object) -> str:
    """The shown form of a URL-like value (see the module docstring for what it guarantees)."""
    return mask(_render(split_url(value)))


# ----------------------------------------------------------------------- credential shapes


def url_credential_problems(parts: UrlParts) -> list[str]:
    """What in a URL carries a credential: a userinfo; a query, `;params` or fragment item whose
    name is password-like or that has no name (a bare `?<token>` or `#<token>`); an `@` after
    the host or a port that is not a number (a userinfo cut short by a `/`, `?` or `#` in it)."""
    problems = []
    if parts.userinfo is not None:
        problems.append("a userinfo, user:password@")
    for label, component in (
        ("query", parts.query),
        (";params", parts.params),
        ("fragment", parts.fragment),
    ):
        if not component:
            continue
        items = [item.partition("=") for item in re.split(r"[&;]", component) if item]
        if any(not equals or is_sensitive_name(unquote(key)) for key, equals, _ in items):
            problems.append(f"a {label} item that is unnamed or has a password-like name")
    if _at_after_host(parts):
        problems.append("an '@' after its host (a misplaced user:password@?)")
    if parts.port and not _PORT_TEXT.fullmatch(parts.port):
        problems.append("a port that is not a number (a user:password without its '@'?)")
    return problems


def _whole_shape(normal: str) -> tuple[str, str] | None:
    """(`header`, scheme) for `Bearer <token>`-style text, (`assignment`, name) for
    `NAME=value` / `Name: value` with a password-like name and a value that is not a number, a
    boolean or a `//` URL rest; else None."""
    if _AUTH_HEADER_VALUE.fullmatch(normal):
        return "header", normal.split()[0]
    assignment = _ASSIGNMENT.fullmatch(normal)
    if assignment:
        name = assignment.group(1) or assignment.group(3)
        value = (assignment.group(2) or assignment.group(4)).strip().strip("\"'")
        if is_sensitive_name(name) and _is_secret_value(value):
            return "assignment", name
    return None


def _is_secret_value(value: str) -> bool:
    """What may follow a password-like name and be a secret: not empty, a `//` URL rest, the
    mask, a number or a boolean (`max_tokens=10`, `auth: true`)."""
    return bool(value) and not (
        value.startswith("//")
        or value == MASK
        or value.isdigit()
        or value.lower() in _BOOLEAN_WORDS
    )


def credential_shape(text: str) -> str | None:
    """Why `text` carries a credential whatever key holds it, or None.

    The whole text is an `Authorization`-style value (`Bearer <token>`) or an assignment to a
    password-like name (`API_KEY=...`, `X-Api-Key: ...`); or a URL-like token anywhere in it has
    one of the `url_credential_problems`.
    """
    normal = normalize(text)
    whole = _whole_shape(normal)
    if whole is not None:
        if whole[0] == "header":
            return "an Authorization header value (<scheme> <credential>)"
        return "an assignment to a password-like name (NAME=value or Name: value)"
    for match in _URL_IN_TEXT.finditer(normal):
        problems = url_credential_problems(split_url(match.group()))
        if problems:
            return f"a URL with {' and '.join(problems)}"
    if _AUTH_IN_TEXT.search(normal) or any(
        _masked_pair(m) != m.group()
        for rule in (_ASSIGNMENT_IN_TEXT, _FLAG_IN_TEXT)
        for m in rule.finditer(normal)
    ):
        return "a credential inside the text (Bearer <token>, NAME=value, --name value)"
    if mask(text) != text:
        return "a registered secret (a key this process loaded)"
    return None


def _redact_string(text: str) -> str:
    normal = normalize(text)
    whole = _whole_shape(normal)
    if whole is not None:
        kind, word = whole
        return f"{_escape(word)} {MASK}" if kind == "header" else f"{_escape(word)}={MASK}"
    if _URL_IN_TEXT.search(normal):
        return mask(_escape(_URL_IN_TEXT.sub(lambda match: redact_url(match.group()), normal)))
    return mask(_escape(text))


def redact_value(value: Any, *, sensitive: bool = False) -> Any:
    """A copy of a JSON-like `value` that is safe to show.

    Every string and non-empty mapping under a password-like key (at any depth, lists included)
    is `***`; other strings
    go through the credential shapes above (URLs through `redact_url`) and are escaped; numbers,
    booleans and None are kept (they are limits and switches, such as `max_tokens`).
    """
    if isinstance(value, Mapping):
        if sensitive and value:
            return MASK  # its keys are text under a password-like name too
        shown_items: dict[Any, Any] = {}
        for key, item in value.items():
            key_text = str(key)
            shown_key = MASK if credential_shape(key_text) else _escape(key_text)
            shown_items[shown_key] = redact_value(
                item, sensitive=sensitive or is_sensitive_name(key_text)
            )
        return shown_items
    if isinstance(value, list | tuple | set | frozenset):
        return [redact_value(item, sensitive=sensitive) for item in value]
    if isinstance(value, bytes | bytearray):
        return MASK
    if isinstance(value, str):
        if sensitive and value:
            return MASK
        return _redact_string(value)
    return value


def shown(value: Any, limit: int = 120) -> str:
    """`repr()` of `redact_value(value)`, cut at `limit` characters: for values in messages."""
    return mask(_bounded(repr(redact_value(value)), limit))


# ----------------------------------------------------------------------------------- text


def secret_values(environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Secret values of the environment (credential-named variables) plus `extra`, longest first.

    Values that are clearly not secrets (booleans, numbers, fewer than 4 characters) are left out
    so that masking them does not garble messages.
    """
    env = os.environ if environ is None else environ
    values = {value for name, value in env.items() if is_sensitive_name(name)}
    values.update(extra)
    kept = {
        v
        for v in values
        if len(v) >= _MIN_SECRET_LENGTH and v.lower() not in _BOOLEAN_WORDS and not v.isdigit()
    }
    kept |= {unicodedata.normalize("NFKC", v) for v in kept}
    return sorted(kept, key=len, reverse=True)


def redact_text(
    text: str, environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()
) -> str:
    """Free text made safe to show (see the module docstring); newlines and tabs are kept."""
    secrets = secret_values(environ, extra)
    text = str(text)
    for value in secrets:
        text = text.replace(value, MASK)
    text = unicodedata.normalize("NFKC", text)
    for value in secrets:
        text = text.replace(value, MASK)
    text = _URL_IN_TEXT.sub(lambda match: redact_url(match.group()), text)
    text = _AUTH_IN_TEXT.sub(lambda match: f"{match.group(1)}{match.group(2)}{MASK}", text)
    text = _ASSIGNMENT_IN_TEXT.sub(_masked_pair, text)
    text = _FLAG_IN_TEXT.sub(_masked_pair, text)
    return mask(_escape(text, keep="\n\t"))


def _masked_pair(match: re.Match[str]) -> str:
    """A `name`/`value` match with the value masked when the name is password-like (quotes
    kept, so JSON stays JSON)."""
    value = match.group("value")
    quote_char = value[0] if value[:1] in ("'", '"') and len(value) > 1 else ""
    inner = value[1:-1] if quote_char else value.rstrip(")]}")  # `"max_tokens": 10}`
    if not is_sensitive_name(match.group("name")) or not _is_secret_value(inner):
        return match.group()
    start = match.start("value") - match.start()
    return f"{match.group()[:start]}{quote_char}{MASK}{quote_char}"


def _escape(text: str, keep: str = "") -> str:
    """Control characters (C0, C1, DEL) and format characters (bidi overrides, zero-width) as
    `\\x..`/`\\u....` escapes, so that shown text cannot rewrite a terminal or a log line."""
    out = []
    for char in text:
        if char in keep or not (
            unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") or char == "\x7f"
        ):
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def _bounded(text: str, limit: int = MAX_SHOWN) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
