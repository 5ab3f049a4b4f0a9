"""The process-wide mask set: every secret value this process loads, masked in everything it shows.

Like GitHub Actions' ``add-mask``: a secret is registered once, where it is loaded, and every
output boundary (sink) replaces every registered value by ``***``.  Shape rules
(:mod:`mizzen_rollout.harbor.redaction`) stay as a first line; this set is what guarantees.

Registration (at the place a secret is loaded):
- :func:`register_secret` — a key read from a key file or a provider variable, an engine key, a
  value found under a password-like name in kwargs.
- :func:`register_url` — what a URL carries: the userinfo password (in both the RFC 3986 and the
  most lenient reading, up to the last ``@``), a user-only userinfo (it may be a token), and the
  values of query, ``;params`` and fragment items that are unnamed or have a password-like name.
- :func:`register_environment` — values of password-like variables (:func:`is_sensitive_name`),
  except variables that name something (``*_VAR``, ``*_FILE``, ``*_PATH``, ``*_DIR``,
  ``*_SOCK``), numbers and booleans; URL values through :func:`register_url`.
Each value is registered with its encodings: NFKC form; percent-encoded (``quote`` with no safe
characters, ``quote_plus``, upper- and lower-case hex); the body of its JSON string (ASCII and
not); the body of its Python ``repr``; control and format characters as ``\\x..``/``\\u....``
escapes (what the redaction's escaping shows); base64 (standard, URL-safe, with and without
padding) of the value and, for a URL userinfo, of ``user:password`` (an HTTP Basic header).

Minimum length: :data:`MIN_SECRET_LENGTH` (6) characters.  A shorter value is refused at
registration with :class:`SecretTooShortError`, which names where the value came from and never
the value: masking a one-to-five-character value would eat innocent text (``a``, ``true``,
``1234``), and a key that short is not a key.  (Optional candidates — a user-only userinfo, an
unnamed query item, an environment value — are skipped when shorter, never refused.)  Only the
value's own length counts; an encoding shorter than 4 characters (an NFKC fold) is not registered.
Also refused: a value with a line break (the stream sinks mask line by line; keys are one line).

Sinks — each masks with :func:`mask`, the one redaction function:
- :func:`mask` — every registered value (longest first, repeated until none is left) -> ``***``;
  text holding no registered value comes back unchanged.  :func:`shown_line` is ``mask`` plus
  escaping to one terminal line (the CLIs' error boundaries).
- :func:`mask_value` — a JSON-like structure with every string (mapping keys too) masked (the
  JSON/JSONL writers mask values first, then the encoded text).
- :class:`MaskedStream` — wraps ``sys.stdout``/``sys.stderr`` in the CLIs; whole lines (to ``\\n``
  or ``\\r``) are masked, the rest of a line on ``flush``.
- :class:`MaskingFilter` and a log-record factory — every log record's message, exception text
  and stack are masked when the record is made (so every handler, whenever added, gets masked
  text); the filter also sits on the root logger's handlers.
- :func:`masked_repr` — a class decorator: ``repr()`` of config objects goes through ``mask``.
- :func:`describe_env` — the env handed to workers, described by variable NAMES only;
  :func:`check_worker_env` refuses one whose values carry a registered secret.
- :func:`install_output_masks` — what a CLI entry point calls first (streams and logging).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import sys
import threading
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager, suppress
from typing import Any, TextIO
from urllib.parse import quote, quote_plus, unquote

__all__ = [
    "MASK",
    "MIN_SECRET_LENGTH",
    "MaskedStream",
    "MaskingFilter",
    "SecretError",
    "SecretTooShortError",
    "check_worker_env",
    "describe_env",
    "install_output_masks",
    "is_sensitive_name",
    "mask",
    "mask_value",
    "masked_repr",
    "register_candidate",
    "register_environment",
    "register_secret",
    "register_url",
    "shown_line",
]

MASK = "***"
#: the shortest value registered (see the module docstring)
MIN_SECRET_LENGTH = 6
_MIN_ENCODING_LENGTH = 4
_MAX_MASK_PASSES = 64

#: default-ignorable characters (zero-width, joiners, bidi controls, variation selectors, tags,
#: Hangul fillers): removed from a NAME before the password-like rule reads it
IGNORABLE_CHARACTERS = (
    "\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e"
    "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0000-\U000e0fff"
)
_IGNORABLE = re.compile(f"[{IGNORABLE_CHARACTERS}]")
_SENSITIVE_NAME = re.compile(
    r"pass|secret|token|key|credential|auth|cookie|signature|(?<![a-z])sig(?![a-z])"
)
_NAMING_SUFFIXES = ("_VAR", "_FILE", "_PATH", "_DIR", "_SOCK")
_BOOLEAN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null"})
_URL_REMOVED = dict.fromkeys(map(ord, "\t\n\r"))
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
#: characters a URL path keeps as they are (what `redaction.redact_url` writes)
_URL_PATH_SAFE = "!$&'()*+,=:~-._%@"


class SecretError(ValueError):
    """A secret cannot be handled safely (the message names its source, never its value)."""


class SecretTooShortError(SecretError):
    """A secret shorter than MIN_SECRET_LENGTH: masking it would eat innocent text."""


def is_sensitive_name(name: object) -> bool:
    """Whether `name` is password-like: its NFKC case-folded form, default-ignorable characters
    removed, contains pass, secret, token, key, credential, auth, cookie or signature, or the
    word sig."""
    folded = unicodedata.normalize("NFKC", _IGNORABLE.sub("", str(name))).casefold()
    return bool(_SENSITIVE_NAME.search(_IGNORABLE.sub("", folded)))


# ------------------------------------------------------------------------------- the set


class _MaskSet:
    """The registered values and the pattern that finds them.

    The pattern is compiled when it is next needed after a registration, not at each one: a
    process registers a secret's ~20 encodings in a row (a URL's several values at once), and
    compiling an alternation of every value at every registration grew quadratically (the
    redaction fuzz spent 97 of its 106 s compiling)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self._stale = False
        self.longest = 0

    def add(self, values: Iterable[str]) -> None:
        with self.lock:
            new = {v for v in values if len(v) >= _MIN_ENCODING_LENGTH} - self.values
            if not new:
                return
            self.values |= new
            self.longest = max(self.longest, *map(len, new))
            self._stale = True

    @property
    def pattern(self) -> re.Pattern[str] | None:
        """The alternation of every registered value, longest first (None: nothing yet)."""
        with self.lock:
            if self._stale:
                ordered = sorted(self.values, key=lambda v: (-len(v), v))
                self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
                self._stale = False
            return self._pattern

    def snapshot(self) -> frozenset[str]:
        with self.lock:
            return frozenset(self.values)

    def restore(self, values: frozenset[str]) -> None:
        with self.lock:
            self.values = set(values)
            self.longest = max(map(len, self.values), default=0)
            self._stale = True


_MASKS = _MaskSet()


@contextmanager
def isolated_masks() -> Any:
    """Run a block with the mask set as it is now, restored afterwards (for tests)."""
    before = _MASKS.snapshot()
    try:
        yield
    finally:
        _MASKS.restore(before)


def _escaped(value: str) -> str:
    """Control and format characters as escapes, as `redaction` shows them."""
    return "".join(
        char.encode("unicode_escape").decode("ascii")
        if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") or char == "\x7f"
        else char
        for char in value
    )


def _b64_forms(data: bytes) -> set[str]:
    forms = set()
    for encoded in (base64.b64encode(data), base64.urlsafe_b64encode(data)):
        text = encoded.decode("ascii")
        forms |= {text, text.rstrip("=")}
    return forms


def encodings(value: str, *, basic_user: str | None = None) -> set[str]:
    """`value` and the forms it takes in the outputs (see the module docstring)."""
    forms = {value, unicodedata.normalize("NFKC", value)}
    forms |= {_escaped(form) for form in forms}
    for text in list(forms):
        for safe in ("", "/", _URL_PATH_SAFE):
            for encoded in (quote(text, safe=safe), quote_plus(text, safe=safe)):
                forms |= {encoded, re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), encoded)}
        forms.add(json.dumps(text)[1:-1])
        forms.add(json.dumps(text, ensure_ascii=False)[1:-1])
        # Python's repr quotes with ' (escaping ') unless the whole text holds ' and no ":
        # both bodies, whatever the text around the value
        forms.add(repr(text + "'\"")[1:-4])
        if '"' not in text:
            forms.add(repr(text + "'")[1:-2])
    raw = value.encode("utf-8", "surrogatepass")
    forms |= _b64_forms(raw)
    if basic_user is not None:
        forms |= _b64_forms(basic_user.encode("utf-8", "surrogatepass") + b":" + raw)
    return forms


def register_secret(value: str, *, source: str, basic_user: str | None = None) -> None:
    """Add `value` (and its encodings) to the process-wide mask set.

    Raises SecretTooShortError for fewer than MIN_SECRET_LENGTH characters and SecretError for
    an empty value or one with a line break; both name `source` (e.g. "--engine-url (the
    password)") and never the value.
    """
    if not isinstance(value, str) or not value.strip():
        raise SecretError(f"{source}: the secret is empty; fix: give the key itself")
    if any(char in value for char in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"):
        raise SecretError(
            f"{source}: the secret holds a line break (not shown); fix: a key is one line"
        )
    if not value.strip("*"):
        return  # already masked (a configuration written through the mask, read back)
    if len(value) < MIN_SECRET_LENGTH:
        raise SecretTooShortError(
            f"{source}: the secret is {len(value)} characters long, too short to be masked "
            f"safely in output (masking it would hide innocent text); fix: use a key of at "
            f"least {MIN_SECRET_LENGTH} characters"
        )
    _MASKS.add(encodings(value, basic_user=basic_user))


def register_candidate(value: str, source: str) -> None:
    """Register a value that may be a secret (an unnamed query item, a value about to be refused
    as a credential) when it is long enough, not a number or boolean and one line; never raises."""
    if len(value) < MIN_SECRET_LENGTH or value.isdigit() or value.lower() in _BOOLEAN_WORDS:
        return
    with suppress(SecretError):  # a line break: not a key, and not one that was asked for
        register_secret(value, source=source)


def _url_candidates(text: str) -> Iterable[tuple[str, str | None, bool]]:
    """(value, basic-auth user, required) for each credential `text` (a URL) may carry."""
    match = _SCHEME.match(text)
    rest = (text[match.end() :] if match else text).lstrip("/\\")
    authority = re.split(r"[/\\?#]", rest, maxsplit=1)[0]
    readings = [(authority.rpartition("@")[0], True)] if "@" in authority else []
    if "@" in rest:  # the most lenient reading, up to the last `@`: registered when long enough
        readings.append((rest.rpartition("@")[0], False))
    for userinfo, standard in readings:
        user, colon, password = userinfo.partition(":")
        if colon and password:
            yield password, user, standard
        elif user:
            yield user, None, False
    _, _, fragment = rest.partition("#")
    query = rest.partition("#")[0].partition("?")[2]
    params = rest.partition("#")[0].partition("?")[0].partition(";")[2]
    for component in (query, params, fragment):
        for item in re.split(r"[&;]", component):
            name, equals, value = item.partition("=")
            if equals and value and is_sensitive_name(unquote(name)):
                yield value, None, True
            elif not equals and name:
                yield name, None, False


def register_url(url: str, *, source: str) -> None:
    """Register the credentials `url` carries (see the module docstring), each as written and
    percent-decoded; a password or a password-like item shorter than MIN_SECRET_LENGTH raises
    SecretTooShortError naming `source`."""
    raw = str(url).translate(_URL_REMOVED).strip()
    for text in {raw, unicodedata.normalize("NFKC", raw)}:
        for value, user, required in _url_candidates(text):
            for form in {value, unquote(value)}:
                if required:
                    register_secret(form, source=f"{source} (a credential in the URL)",
                                    basic_user=user)  # fmt: skip
                    if user is not None:
                        _MASKS.add(encodings(form, basic_user=unquote(user)))
                else:
                    register_candidate(form, f"{source} (a credential in the URL)")


def environment_secrets(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The password-like variables of `environ` (default `os.environ`) that hold a value, not
    the name of something (`*_VAR`, `*_FILE`, `*_PATH`, `*_DIR`, `*_SOCK`): name -> value."""
    env = os.environ if environ is None else environ
    return {
        name: value
        for name, value in env.items()
        if is_sensitive_name(name) and not name.upper().endswith(_NAMING_SUFFIXES)
    }


def register_environment(environ: Mapping[str, str] | None = None) -> None:
    """Register the values of password-like variables (see the module docstring)."""
    for name, value in environment_secrets(environ).items():
        if "://" in value:
            with suppress(SecretError):  # not ours to refuse: the whole value is registered below
                register_url(value, source=name)
        register_candidate(value.strip(), name)


# ----------------------------------------------------------------------------- the sinks


def mask(text: object) -> str:
    """`text` with every registered value replaced by `***` (until none is left)."""
    text = str(text)
    pattern = _MASKS.pattern
    if pattern is None:
        return text
    for _ in range(_MAX_MASK_PASSES):
        masked = pattern.sub(MASK, text)
        if masked == text:
            return masked
        text = masked
    return text


def shown_line(text: object, limit: int = 2000) -> str:
    """`text` masked, as one line for a terminal: line breaks, control and format characters as
    escapes, cut at `limit` characters (what the CLIs' error boundaries print)."""
    line = _escaped(mask(text))
    return mask(line if len(line) <= limit else line[: limit - 3] + "...")


def mask_value(value: Any) -> Any:
    """A copy of a JSON-like `value` with every string (mapping keys too) masked."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, Mapping):
        return {mask_value(k) if isinstance(k, str) else k: mask_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mask_value(item) for item in value]
    return value


def mask_json(value: Any, **dumps: Any) -> str:
    """`json.dumps` of `mask_value(value)`, the text masked once more: what JSON writers write."""
    return mask(json.dumps(mask_value(value), **dumps))


def masked_repr[T: type](cls: T) -> T:
    """Class decorator: `repr()` (and `str()` when it is the repr) go through `mask`."""
    inner: Callable[[Any], str] = cls.__repr__

    def __repr__(self: Any) -> str:
        return mask(inner(self))

    cls.__repr__ = __repr__  # type: ignore[method-assign]
    if cls.__str__ is object.__str__:
        cls.__str__ = __repr__  # type: ignore[method-assign]
    return cls


def describe_env(env: Mapping[str, str]) -> str:
    """How to show the env handed to workers: variable NAMES only, never a value."""
    names = sorted(mask(name) for name in env)
    return f"{len(names)} variable(s): {', '.join(names)}" if names else "no variables"


def check_worker_env(env: Mapping[str, str], *, where: str) -> None:
    """Raise SecretError naming the variables of `env` (handed to workers, logged in plain text)
    whose name or value carries a registered secret; never the value."""
    bad = sorted(
        mask(name) for name, value in env.items() if mask(name) != name or mask(value) != value
    )
    if bad:
        raise SecretError(
            f"{where}: the environment handed to workers would carry a secret in {bad}; fix: "
            "pass keys by variable name or key file path, never by value"
        )


class MaskedStream:
    """A text stream whose writes are masked: whole lines at once (a line ends at `\\n` or
    `\\r`), the rest of a line on `flush` (or when it grows past 64 KiB, keeping a tail as long
    as the longest registered value)."""

    _LIMIT = 64 * 1024

    def __init__(self, stream: TextIO) -> None:
        self.wrapped = stream
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            cut = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
            if not cut and len(self._pending) > self._LIMIT:
                cut = len(self._pending) - max(_MASKS.longest - 1, 0)
            if cut:
                ready, self._pending = self._pending[:cut], self._pending[cut:]
                self.wrapped.write(mask(ready))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self.wrapped.write(mask(self._pending))
                self._pending = ""
        self.wrapped.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


def _mask_record(record: logging.LogRecord) -> logging.LogRecord:
    if getattr(record, "_mizzen_masked", False):
        return record
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: show the parts, masked
        message = f"{record.msg!r} % {record.args!r}"
    record.msg, record.args = mask(message), None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = mask(record.exc_text)
    if record.stack_info:
        record.stack_info = mask(record.stack_info)
    record._mizzen_masked = True
    return record


class MaskingFilter(logging.Filter):
    """A logging filter that masks a record's message, exception text and stack (put it on
    handlers: a logger's own filters do not see records propagated from its children)."""

    def filter(self, record: logging.LogRecord) -> bool:
        _mask_record(record)
        return True


def install_output_masks() -> Callable[[], None]:
    """Mask every output of this process from now on: `sys.stdout`/`sys.stderr` wrapped in
    MaskedStream, log records masked when made (a record factory) and by a MaskingFilter on the
    root logger's handlers.  Returns the function that undoes it (the CLIs call it on exit)."""
    saved_out, saved_err = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, MaskedStream):
        sys.stdout = MaskedStream(sys.stdout)  # type: ignore[assignment]
    if not isinstance(sys.stderr, MaskedStream):
        sys.stderr = MaskedStream(sys.stderr)  # type: ignore[assignment]
    previous_factory = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return _mask_record(previous_factory(*args, **kwargs))

    logging.setLogRecordFactory(factory)
    log_filter = MaskingFilter()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(log_filter)

    def undo() -> None:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, MaskedStream):
                stream.flush()
        sys.stdout, sys.stderr = saved_out, saved_err
        logging.setLogRecordFactory(previous_factory)
        for handler in handlers:
            handler.removeFilter(log_filter)

    return undo
