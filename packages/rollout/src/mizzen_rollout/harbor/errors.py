"""Errors of the Harbor integration.

Invariant: every message names what was wrong (the variable, field or path), the rule it broke and
the fix, and never contains a secret value (keys are referred to by variable name or file path).
"""

from __future__ import annotations


class HarborConfigError(ValueError):
    """A configuration error: raised loudly, because training on silent zero rewards is worse."""


class ProviderCredentialError(HarborConfigError):
    """A sandbox provider's credentials are missing, unreadable or unsafe to forward."""
