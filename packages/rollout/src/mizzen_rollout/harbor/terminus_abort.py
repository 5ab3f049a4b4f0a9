"""terminus-2 that aborts, instead of retrying, when a model reply hits `max_tokens`.

Stock terminus-2 answers a truncated reply (finish_reason `length`) by appending it and asking the
model again, recursively and without bound: an engine that truncates every reply (a small
`max_new_tokens`, a degenerate policy) keeps the agent looping until its timeout, and the
trajectory is full of half-written actions. Under the `abort` response-too-long policy (see
`harnesses`) the harness table loads this class by import path instead.

Invariants:
- Behaviour is terminus-2's except for a truncated reply: it raises `ResponseLengthExceededError`
  (a `ContextLengthExceededError` subclass, so terminus-2 neither retries nor summarises it with
  summarisation off), the agent run ends, and the outcome maps it to `sequence_length_exceeded`.
- Importing this module imports no Harbor: the class is built on first attribute access.
"""

from __future__ import annotations

from typing import Any

ABORTING_TERMINUS_IMPORT_PATH = "mizzen_rollout.harbor.terminus_abort:AbortingTerminus2"
#: the exception type name Harbor records for an aborted truncated reply
RESPONSE_LENGTH_ERROR = "ResponseLengthExceededError"

_built: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    from harbor.agents.terminus_2 import Terminus2
    from harbor.llms.base import ContextLengthExceededError, OutputLengthExceededError

    class ResponseLengthExceededError(ContextLengthExceededError):
        """A model reply hit max_tokens and response_too_long=abort ended the trial."""

    def abort_on_truncation(llm: Any) -> None:
        base = type(llm)

        class AbortOnTruncation(base):  # type: ignore[misc, valid-type]
            async def call(self, *args: Any, **kwargs: Any) -> Any:
                try:
                    return await super().call(*args, **kwargs)
                except OutputLengthExceededError as exc:
                    raise ResponseLengthExceededError(
                        f"{exc} (response_too_long=abort: the trial ends here instead of "
                        "asking the model to shorten its reply)"
                    ) from exc

        AbortOnTruncation.__name__ = f"AbortOnTruncation{base.__name__}"
        llm.__class__ = AbortOnTruncation

    class AbortingTerminus2(Terminus2):
        """terminus-2 with truncated replies turned into an abort (see the module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            abort_on_truncation(self._llm)

    ResponseLengthExceededError.__module__ = __name__
    AbortingTerminus2.__module__ = __name__
    return {
        "AbortingTerminus2": AbortingTerminus2,
        "ResponseLengthExceededError": ResponseLengthExceededError,
    }


def __getattr__(name: str) -> Any:
    if name in ("AbortingTerminus2", "ResponseLengthExceededError"):
        if not _built:
            _built.update(_build())
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
