"""The process-wide mask set of mizzen-ci: every secret value the process loads is registered once,
and every sink masks the registered values, as GitHub's ``::add-mask::`` does for a workflow.

Shape rules (:mod:`mizzen_ci.gate.redact`: a URL's userinfo, query and fragment are never shown)
are the first line; this set is the guarantee: a value registered here is replaced by
:data:`MASK` wherever it appears, whatever shape carries it (a driver's error text, a path, a
table cell, a traceback).

What is registered (each value once, with its obvious encodings, :func:`forms`: raw, percent-
encoded (``quote``/``quote_plus``) and decoded, JSON- and ``repr``-escaped, libpq-quoted, and each
encoding a sink registers with :func:`add_encoding`, such as the terminal form of
:func:`mizzen_ci.output.plain`; a value with line breaks is registered line by line too):

- :func:`register_connection`: a database URL's password (raw and decoded) and the values of its
  secret query parameters (:data:`SECRET_KEYS`); a libpq key/value string's secret values,
  unquoted or single-quoted (``password='a b\\'c'``), and, when it does not parse, whatever follows
  each ``password=``;
- :func:`register_environment`: the value of every variable whose name says it is a secret
  (:data:`SECRET_NAME`, a name matched by words between underscores: ``*_TOKEN``,
  ``*_PASSWORD``, ``PGPASSWORD``, ``*_API_KEY``, ``*_DSN``, ``DATABASE_URL``, ``*_PAT``
  (``GITHUB_PAT``), a ``*_KEY`` whose word says it is a secret key or names a provider
  (:data:`SECRET_KEY_WORDS`: ``*_ACCESS_KEY``, ``SIGNING_KEY``, ``OPENAI_KEY``; most ``*_KEY``
  names a thing and is shown: ``MIZZEN_RUN_KEY``, ``MIZZEN_HARBOR_REWARD_KEY``, ``CACHE_KEY``),
  ``*WEBHOOK*`` (the secret is in the URL's path), ``*CONNECTION_STRING*``
  (``AZURE_STORAGE_CONNECTION_STRING``, ``*_CONN_STR``), ``*_CREDS``, ``*_BEARER``, and as the
  last word ``*_PASS``, ``*_PWD``, ``*_AUTH``, …), and the connection secrets of every value
  that is a URL or DSN.
  Names that only look alike are not secrets: ``PATH``/``*_PATH``, ``PWD``/``OLDPWD`` (the
  current folder), ``MIZZEN_PASS_RATE``, ``PASS_AT_K``, ``PAT_LIMIT`` (``PASS``/``PAT`` not the
  last word), ``MODEL_KEY``, ``SHARD_KEY``, ``TOKENIZERS_PARALLELISM``, ``BYPASS_*``, ``SSH_AUTH_SOCK`` (a socket path:
  usable only on its host, and masking it would hide paths in every log), ``RAY_AUTH_MODE``;
- :func:`register_arguments`: the connection secrets of every command-line argument (``--store
  postgresql://…``), before the parser can echo one in a usage error.

Sinks: :mod:`mizzen_ci.output` (every escaping function masks before it escapes), the standard
streams of ``mizzen-ci`` (:func:`masked_streams`, line-buffered, installed by
:func:`mizzen_ci.cli.main`), the metric store's errors and ``repr()``, and the files the CI writes
for people or artefacts (:func:`write_text`, :func:`mizzen_ci.history.append_jsonl`).

Invariants:
- Stdlib only; :func:`mask` of a text with no registered value returns it unchanged (so does
  every sink); :func:`mask` is total (never raises for any object with a ``str``).
- Values shorter than :data:`MIN_CHARS` are not registered (masking ``ab`` would garble every
  line and protect nothing).  The longest registered form is masked first, so a secret inside
  another never leaves a piece of the longer one.
- Registration only adds; :func:`scope` (for tests) restores the set on exit.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from urllib.parse import parse_qsl, quote, quote_plus, unquote, unquote_plus, urlsplit

MASK = "***"
MIN_CHARS = 3
SECRET_KEYS = frozenset({"password", "sslpassword", "pass", "passwd", "token", "secret"})
# ``<WORD>_KEY`` is a secret only for these words (what kind of key it is, or a provider whose
# key it is): most ``*_KEY`` names a thing (``MIZZEN_RUN_KEY``, ``MIZZEN_HARBOR_REWARD_KEY``,
# ``CACHE_KEY``, ``SHARD_KEY``), whose value CI output and records must show.
SECRET_KEY_WORDS = (
    "API", "ACCESS", "PRIVATE", "SECRET", "SIGNING", "ENCRYPTION", "MASTER", "LICENSE",
    "OPENAI", "ANTHROPIC", "STRIPE", "GEMINI", "GOOGLE", "GROQ", "MISTRAL", "COHERE", "TOGETHER",
    "FIREWORKS", "DEEPSEEK", "XAI", "REPLICATE", "PERPLEXITY",
)  # fmt: skip
SECRET_NAME = re.compile(
    r"PASSWORD|PASSWD|PASSPHRASE|WEBHOOK|CONN(?:ECTION)?_?STR(?:ING)?|"
    r"(?:^|_)(?:TOKEN|SECRET|SECRETS|CREDENTIALS?|CREDS?|APIKEY|DSN|DATABASE_URL|COOKIE|BEARER|"
    r"HOOK_URL)(?:_|$)|"
    r"_(?:PAT|PASS|PWD)$|(?:^|_)AUTH(?:ORIZATION)?$|"
    rf"(?:^|_)(?:{'|'.join(SECRET_KEY_WORDS)})_?KEY(?:_|$)",
    re.IGNORECASE,
)
_CONNINFO = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LENIENT_SECRET = re.compile(r"(?i)\b(?:ssl)?pass(?:word|wd)?\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)")

_lock = threading.Lock()
_secrets: set[str] = set()
_encoders: list[Callable[[str], str]] = []
_pattern: re.Pattern[str] | None = None


def _libpq_quoted(s: str) -> str:
    return s.replace("\\", "\\\\").replace("'", "\\'")


_BUILTIN_ENCODERS: tuple[Callable[[str], str], ...] = (
    lambda s: s,
    lambda s: quote(s, safe=""),
    quote,
    quote_plus,
    unquote,
    unquote_plus,
    lambda s: json.dumps(s)[1:-1],
    lambda s: json.dumps(s, ensure_ascii=False)[1:-1],
    lambda s: repr(s)[1:-1],
    _libpq_quoted,
)


def forms(secret: str) -> set[str]:
    """Every form of ``secret`` that is masked (see the module docstring)."""
    out = set()
    pieces = {secret, *secret.splitlines()}
    for piece in pieces:
        for encode in (*_BUILTIN_ENCODERS, *_encoders):
            try:
                form = encode(piece)
            except Exception:  # an encoder never stops a registration
                continue
            if len(form) >= MIN_CHARS:
                out.add(form)
    return out


def _rebuild() -> None:
    global _pattern
    every = set().union(*(forms(s) for s in _secrets)) if _secrets else set()
    ordered = sorted(every, key=lambda f: (-len(f), f))
    _pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None


def register(*secrets: str | None) -> None:
    """Add secret values to the mask set (``None``, empty and too short values are ignored)."""
    new = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_CHARS} - _secrets
    if not new:
        return
    with _lock:
        _secrets.update(new)
        _rebuild()


def add_encoding(encode: Callable[[str], str]) -> None:
    """Mask every registered value in this encoding too (a sink's escaping function)."""
    with _lock:
        if encode not in _encoders:
            _encoders.append(encode)
            _rebuild()


def mask(text: object) -> str:
    """``text`` with every registered value replaced by :data:`MASK`."""
    try:
        s = text if isinstance(text, str) else str(text)
    except Exception:
        return MASK
    pattern = _pattern
    return s if pattern is None else pattern.sub(MASK, s)


def is_conninfo(text: str) -> bool:
    """Whether ``text`` has the shape of a libpq key/value string (``host=… password=…``)."""
    return "://" not in text and bool(_CONNINFO.match(text))


def conninfo_pairs(text: str) -> list[tuple[str, str]] | None:
    """The ``(keyword, value)`` pairs of a libpq key/value string, values unquoted; ``None`` when
    it is not one (libpq's grammar: ``kw = value``, a value single-quoted with ``\\'`` and
    ``\\\\`` escapes or unquoted up to white space, ``\\`` escaping the next character)."""
    pairs, i, n = [], 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return pairs
        m = _KEYWORD.match(text, i)
        if m is None:
            return None
        key, i = m.group(), m.end()
        while i < n and text[i].isspace():
            i += 1
        if i == n or text[i] != "=":
            return None
        i += 1
        while i < n and text[i].isspace():
            i += 1
        value, i = _conninfo_value(text, i)
        if value is None:
            return None
        pairs.append((key.lower(), value))


def _conninfo_value(text: str, i: int) -> tuple[str | None, int]:
    out, n = [], len(text)
    quoted = i < n and text[i] == "'"
    i += quoted
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            out.append(text[i + 1])
            i += 2
            continue
        if (quoted and c == "'") or (not quoted and c.isspace()):
            return "".join(out), i + quoted
        out.append(c)
        i += 1
    return (None, i) if quoted else ("".join(out), i)


def connection_secrets(text: str) -> list[str]:
    """The secret values of a database URL or libpq key/value string (see the module
    docstring); ``[]`` for anything else."""
    if not isinstance(text, str):
        return []
    if "://" in text:
        return _url_secrets(text)
    if not is_conninfo(text):
        return []
    pairs = conninfo_pairs(text)
    if pairs is None:  # malformed: whatever follows each password= is taken for a secret
        found = [m.group(1) for m in _LENIENT_SECRET.finditer(text)]
        return [*found, *(f.strip("'") for f in found), *(t for f in found for t in f.split())]
    return [v for k, v in pairs if k in SECRET_KEYS]


def _url_secrets(text: str) -> list[str]:
    try:
        parts = urlsplit(text.strip())
        netloc, query = parts.netloc, parts.query
    except Exception:  # not a URL urlsplit accepts: the text after "://" up to "@" is userinfo
        netloc, query = text.partition("://")[2].partition("/")[0], ""
    userinfo = netloc.rpartition("@")[0]
    out = []
    if userinfo:
        password = userinfo.partition(":")[2]
        out += [password, unquote(password)]
    try:
        pairs = parse_qsl(query, keep_blank_values=True)
    except Exception:
        pairs = []
    out += [v for k, v in pairs if k.lower() in SECRET_KEYS]
    return out


def register_connection(text: object) -> None:
    """Register the secrets of a database URL or libpq key/value string."""
    if isinstance(text, str):
        register(*connection_secrets(text))


def register_environment(environ: Mapping[str, str]) -> None:
    """Register the secrets of an environment (see the module docstring)."""
    found = []
    for name, value in environ.items():
        if SECRET_NAME.search(name):
            found.append(value)
        found += connection_secrets(value)
    register(*found)


def register_arguments(argv: Iterable[str]) -> None:
    """Register the connection secrets of command-line arguments (``--opt=value`` too)."""
    for arg in argv:
        if isinstance(arg, str):
            register_connection(arg)
            if arg.startswith("--") and "=" in arg:
                register_connection(arg.partition("=")[2])


class MaskedStream:
    """A text stream that masks what it is given, a line at a time (a value split over two
    ``write`` calls of one line is still masked); ``\\r`` and :meth:`flush` end a piece too."""

    def __init__(self, stream):
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        cut = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
        if cut == 0 and len(self._pending) > 1 << 16:
            cut = len(self._pending)
        if cut:
            piece, self._pending = self._pending[:cut], self._pending[cut:]
            self._stream.write(mask(piece))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            piece, self._pending = self._pending, ""
            self._stream.write(mask(piece))
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def masked_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` masked for the duration (flushed and restored after)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = MaskedStream(saved[0]), MaskedStream(saved[1])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = saved


def write_text(path: Path | str, text: str, *, append: bool = False) -> None:
    """Write (or append) ``text``, masked, to a file the CI leaves for people or artefacts
    (summaries, reports, the step summary)."""
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        f.write(mask(text))


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Registrations inside the block are forgotten after it (for tests)."""
    with _lock:
        saved = set(_secrets)
    try:
        yield
    finally:
        with _lock:
            _secrets.clear()
            _secrets.update(saved)
            _rebuild()
