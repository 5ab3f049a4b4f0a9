"""Errors of the Harbor integration.

Invariants:
- Every message names what was wrong (the variable, field or path), the rule it broke and the
  fix, and never contains a secret value: keys are referred to by variable name or file path,
  URL-like values appear only in their `redaction.redact_url` form, other echoed values through
  `redaction.shown`.
- No message carries a secret through its exception chain either: errors built from another
  exception (a decode error holds the bytes it read, a JSON error the whole document, a pydantic
  error its input) are raised outside the `except` block, so `__context__` and `__cause__` are
  None.
"""

from __future__ import annotations


class HarborConfigError(ValueError):
    """A configuration error: raised loudly, because training on silent zero rewards is worse."""


class ProviderCredentialError(HarborConfigError):
    """A credential problem, the one type for all of them: a sandbox provider's key missing,
    unreadable or malformed (key files included); an endpoint value (provider address variable,
    the engine `base_url`) that is malformed or carries credentials; a credential in
    `agent_kwargs` / `environment_kwargs`, where credentials never go."""
