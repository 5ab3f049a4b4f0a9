"""The three ways a slot operation refuses or fails, each with its own recovery.

- :class:`SlotConfigError` — a request broke a registration-time rule (a rank above the maximum, a
  batch that does not divide over the data-parallel ranks, ...).  Raised *before* any state
  changes or any collective starts, identically on every rank (every rank sees the same request),
  so the executor stays usable: fix the request and send it again.
- :class:`SlotCheckpointError` — a slot checkpoint could not be saved or loaded.  Saving agrees on
  success over all ranks before it commits, so every rank raises it together and the previous
  checkpoint stays the committed one; loading validates before it touches the slot.
- :class:`HFModelError` — a Hugging Face model directory cannot be imported or exported (see
  :mod:`mizzen_train.hf`).
- :class:`ExecutorFailedError` — an earlier operation died part-way (see
  :mod:`mizzen_train.executor`); the executor refuses all further work until it is rebuilt from a
  checkpoint.

Invariant: every message names the field (or file), the rule that was broken and the fix.
"""

from __future__ import annotations

from typing import Any


class SlotConfigError(ValueError):
    """A request violates a registration-time rule; nothing was changed."""

    def __init__(self, field: str, value: Any, rule: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        self.fix = fix
        super().__init__(f"{field}={value!r}: {rule}. Fix: {fix}")


class SlotCheckpointError(RuntimeError):
    """A slot checkpoint could not be saved or loaded; the committed checkpoint is unchanged."""


class ExecutorFailedError(RuntimeError):
    """The executor failed earlier and must be rebuilt from a checkpoint before further work."""


class HFModelError(ValueError):
    """A Hugging Face model directory cannot be imported or exported; the message names the file
    (and field), the rule and the fix.  Raised before any weight is copied into a model."""
