"""Engines behind one async interface (:class:`~.base.Engine`).

- :mod:`.base`: the interface, request/result dataclasses and errors (stdlib only).
- :mod:`.protocol`: SGLang's HTTP protocol subset, the one place its shapes are written.
- :mod:`.client`: :class:`SGLangClient`, the httpx client for SGLang and the embedded server.
- :mod:`.launcher`: start ``sglang.launch_server`` or the embedded server and wait for health.
- :mod:`.embedded`: the embedded server (``mizzen-rollout serve``).

Invariant: importing this package imports httpx at most (no torch, ray, transformers, sglang).
"""

from .base import (
    ENGINE_MAX_BATCH,
    ChatRequest,
    ChatResult,
    Engine,
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from .client import RetryPolicy, SGLangClient

__all__ = [
    "ENGINE_MAX_BATCH",
    "ChatRequest",
    "ChatResult",
    "Engine",
    "EngineError",
    "EngineProtocolError",
    "EngineRequestError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "RetryPolicy",
    "SGLangClient",
    "SamplingParams",
]
