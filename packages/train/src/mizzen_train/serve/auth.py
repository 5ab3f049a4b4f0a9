"""API keys: read from a file, matched in constant time, never shown.

The file holds one ``TENANT KEY`` pair per line (``#`` comments and blank lines are skipped);
``TENANT`` is a name (letters, digits, ``._-``), ``KEY`` starts with ``tml-`` (the SDK refuses
other keys) and is at least 20 characters long.  Clients send the key in ``X-API-Key`` (the SDK
reads ``TINKER_API_KEY``).

Invariants:
- A key never appears in a message, a log line, ``repr()`` or a response: errors name the file
  and line number only; the table keeps SHA-256 digests, not keys.
- The file is read bounded (:func:`~mizzen_train.run.config.read_regular_file`): a regular file
  of at most :data:`MAX_KEY_FILE_BYTES`, never waited on (a FIFO) nor read whole when larger.
- A malformed file is refused at start with ``file:line``, the rule and the fix; a key listed twice
  is refused (two tenants must never share one).
- A key sees only its tenant's models, checkpoints and samplers: every lookup goes through
  :meth:`KeyTable.tenant_of` and the tenant it returns.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from mizzen_train.input_files import read_regular_file

__all__ = ["KeyFileError", "KeyTable", "read_key_file"]

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KEY_PREFIX = "tml-"
MIN_KEY_LENGTH = 20
MAX_KEY_FILE_BYTES = 1024 * 1024


class KeyFileError(ValueError):
    """The API-key file breaks a rule; names file:line, the rule and the fix (never the key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, repr=False)
class KeyTable:
    """``sha256(key) -> tenant``; ``repr`` shows only the tenants."""

    by_digest: dict[bytes, str]

    def __repr__(self) -> str:
        return f"KeyTable(tenants={sorted(set(self.by_digest.values()))})"

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of ``key`` (None: unknown or missing). Compares every digest."""
        if not key or len(key) > 4096:
            return None
        digest = _digest(key)
        found = None
        for known, tenant in self.by_digest.items():
            if hmac.compare_digest(known, digest):
                found = tenant
        return found


def read_key_file(path: str | Path) -> KeyTable:
    """The key table of ``path``; raises KeyFileError naming ``path:line``."""
    path = Path(path)
    try:
        data = read_regular_file(path, MAX_KEY_FILE_BYTES)
    except OSError as exc:
        raise KeyFileError(
            f"{path}: cannot be read ({exc.strerror}). Fix: check the path"
        ) from None
    except ValueError as exc:  # not a regular file, or larger than the limit
        raise KeyFileError(
            f"{path}: {exc}. Fix: a regular file of 'TENANT KEY' lines, one key a line"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not UTF-8 text. Fix: write 'TENANT KEY' lines") from None
    table: dict[bytes, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        table.update(_parse_line(stripped, f"{path}:{number}", table))
    if not table:
        raise KeyFileError(f"{path}: holds no key. Fix: add a 'TENANT KEY' line")
    return KeyTable(table)


def _parse_line(line: str, where: str, table: dict[bytes, str]) -> dict[bytes, str]:
    parts = line.split()
    if len(parts) != 2:
        raise KeyFileError(f"{where}: [key-line] expected 'TENANT KEY'. Fix: two fields a line")
    tenant, key = parts
    if not TENANT_NAME.fullmatch(tenant):
        raise KeyFileError(
            f"{where}: [tenant-name] the tenant is not a name. Fix: letters, digits and ._- only"
        )
    if not key.startswith(KEY_PREFIX) or len(key) < MIN_KEY_LENGTH:
        raise KeyFileError(
            f"{where}: [key-format] a key starts with {KEY_PREFIX!r} and has at least "
            f"{MIN_KEY_LENGTH} characters. Fix: generate e.g. tml-$(openssl rand -hex 24)"
        )
    digest = _digest(key)
    if digest in table:
        raise KeyFileError(
            f"{where}: [key-unique] this key is listed before. Fix: one key a tenant"
        )
    return {digest: tenant}
