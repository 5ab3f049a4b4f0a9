"""Scrubbing secret values out of text that leaves a worker (metadata, error messages).

Invariant: a value is treated as secret when the variable holding it has a credential-looking name
(the same rule as Harbor's: KEY, SECRET, TOKEN, PASSWORD, CREDENTIAL, AUTH) or when it was read
from a provider key file; such values are replaced by `***` wherever they occur.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

SENSITIVE_NAME = re.compile(r"KEY|SECRET|TOKEN(?!S)|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)
_MIN_SECRET_LENGTH = 4


def is_sensitive_name(name: str) -> bool:
    return bool(SENSITIVE_NAME.search(name))


def secret_values(environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Secret values of the environment (credential-named variables) plus `extra`."""
    env = os.environ if environ is None else environ
    values = {value for name, value in env.items() if is_sensitive_name(name)}
    values.update(extra)
    return sorted((v for v in values if len(v) >= _MIN_SECRET_LENGTH), key=len, reverse=True)


def redact(text: str, environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> str:
    """`text` with every secret value replaced by `***` (longest first)."""
    for value in secret_values(environ, extra):
        text = text.replace(value, "***")
    return text
