"""The one async engine interface, its request/result types and its errors.

Every engine (the SGLang HTTP client, the Ray engine worker, anything a Harbor agent talks to)
implements :class:`Engine`.  Requests and results are plain frozen dataclasses so they pickle
across Ray and compare in tests.

Invariants:
- Standard library only; no HTTP, no torch.  Wire shapes live in :mod:`.protocol`, not here.
- ``request_id`` is the caller's: an engine never invents one, and re-issuing a request to another
  engine keeps it (that is how the rollout manager guarantees exactly-once samples).
- ``GenerateResult.output_logprobs`` is ``None`` unless log-probs were requested; when present it
  has one entry per ``output_ids`` entry.
- Errors split by what the caller should do: :class:`EngineUnavailableError` (connection failure
  or 5xx after bounded retries: try another engine), :class:`EngineTimeoutError` (no answer in
  time; the request was aborted best-effort), :class:`EngineRequestError` (4xx: the request is
  wrong, never retried), :class:`EngineProtocolError` (the answer does not have the documented
  shape: the message names the field).
- :data:`ENGINE_MAX_BATCH` is the one engine batch limit of mizzen: the embedded server refuses a
  larger batched ``/generate`` and the trainers' configs refuse a larger ``batch_size``.
- The ranges of a sampling request are written once, here (:data:`MAX_TOKEN_ID`,
  :data:`SEED_MIN`/:data:`SEED_MAX`, :class:`SamplingParams`' checks); the embedded server's
  schema derives its ranges from them, so nothing a client builds is refused by the server for
  a range the client did not check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "ENGINE_MAX_BATCH",
    "MAX_TOKEN_ID",
    "SEED_MAX",
    "SEED_MIN",
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
    "SamplingParams",
]

#: The most prompts one engine call (one batched ``/generate``) carries: a batch is padded to its
#: longest prompt and held in memory at once.
ENGINE_MAX_BATCH = 256
#: The largest token id (and ``max_new_tokens``) a request may carry: SGLang's int32.
MAX_TOKEN_ID = 2**31 - 1
#: A request's sampling seed: 64-bit, what ``torch.Generator.manual_seed`` takes.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

FinishKind = Literal["stop", "length", "abort"]


class EngineError(Exception):
    """Base of every engine failure; ``engine`` names the engine (its URL for HTTP engines)."""

    def __init__(self, message: str, *, engine: str = "", request_id: str | None = None):
        super().__init__(message)
        self.engine = engine
        self.request_id = request_id


class EngineUnavailableError(EngineError):
    """Could not reach the engine, or it kept answering 5xx, after the bounded retries."""


class EngineTimeoutError(EngineError):
    """The engine did not answer within the timeout (the request was aborted best-effort)."""


class EngineRequestError(EngineError):
    """The engine rejected the request (HTTP 4xx); retrying the same request cannot help."""

    def __init__(self, message: str, *, status_code: int, body: str = "", **kwargs: Any):
        super().__init__(message, **kwargs)
        self.status_code = status_code
        self.body = body


class EngineProtocolError(EngineError):
    """The engine answered with a shape that does not match the documented protocol."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters (the subset of SGLang's ``sampling_params`` mizzen sets).

    ``top_k = -1`` disables top-k; ``temperature = 0`` is greedy.  ``seed`` maps to SGLang's
    ``sampling_seed``.  ``extra`` is passed through verbatim for fields not modelled here.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.max_new_tokens <= MAX_TOKEN_ID:
            raise ValueError(
                f"SamplingParams.max_new_tokens is {self.max_new_tokens}; use 0..{MAX_TOKEN_ID}"
            )
        if not (0 <= self.temperature < math.inf):  # also refuses NaN
            raise ValueError(
                f"SamplingParams.temperature is {self.temperature}; use a finite value >= 0"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p is {self.top_p}; use a value in (0, 1]")
        if self.top_k == 0 or not -1 <= self.top_k <= MAX_TOKEN_ID:
            raise ValueError(f"SamplingParams.top_k is {self.top_k}; use -1 (off) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p is {self.min_p}; use a value in [0, 1]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"SamplingParams.seed is {self.seed}; use a 64-bit integer (or None)")
        bad_ids = [t for t in self.stop_token_ids if not 0 <= t <= MAX_TOKEN_ID]
        if bad_ids:
            raise ValueError(
                f"SamplingParams.stop_token_ids holds {bad_ids[0]}; use ids in 0..{MAX_TOKEN_ID}"
            )
        # Accept lists from callers; store tuples (immutable, like the rest of the request).
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass(frozen=True)
class FinishReason:
    """Why generation ended: ``stop`` (EOS / stop string / stop token), ``length`` (hit
    ``max_new_tokens``) or ``abort`` (aborted; ``message`` says why).  ``matched`` is the stop
    token id, token-id sequence (SGLang's multi-token stops) or string that ended a ``stop``."""

    kind: FinishKind
    matched: int | str | tuple[int, ...] | None = None
    message: str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One native ``/generate`` request: exactly one of ``text`` / ``input_ids``.

    ``lora_path`` is SGLang's field of that name: the *name* of a loaded LoRA adapter (see
    ``load_lora_adapter``); None generates with the base model."""

    request_id: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("GenerateRequest.request_id is empty; every request needs an id")
        if (self.text is None) == (self.input_ids is None):
            raise ValueError(
                f"GenerateRequest({self.request_id}): give exactly one of text / input_ids"
            )
        if self.input_ids is not None:
            object.__setattr__(self, "input_ids", tuple(self.input_ids))


@dataclass(frozen=True)
class GenerateResult:
    """What an engine returned for a :class:`GenerateRequest`.

    ``prompt_tokens`` / ``completion_tokens`` are counts (SGLang's ``meta_info``);
    ``latency_s`` is the client-measured wall time; ``engine`` names who served it.
    """

    request_id: str
    text: str
    output_ids: tuple[int, ...]
    finish: FinishReason
    prompt_tokens: int
    completion_tokens: int
    output_logprobs: tuple[float, ...] | None = None
    latency_s: float = 0.0
    engine: str = ""


@dataclass(frozen=True)
class ChatRequest:
    """One OpenAI-compatible ``/v1/chat/completions`` request.

    ``lora_name`` routes it to a loaded LoRA adapter (sent as SGLang's
    ``model = "<model>:<lora_name>"``); ``model`` is the served model's name."""

    request_id: str
    messages: tuple[Mapping[str, Any], ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    return_token_ids: bool = True
    model: str = "default"
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("ChatRequest.request_id is empty; every request needs an id")
        object.__setattr__(self, "messages", tuple(self.messages))
        if not self.messages:
            raise ValueError(f"ChatRequest({self.request_id}): messages is empty")


@dataclass(frozen=True)
class ChatResult:
    """A chat completion; token ids are ``None`` when the server does not return them."""

    request_id: str
    text: str
    finish: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    output_ids: tuple[int, ...] | None = None
    output_logprobs: tuple[float, ...] | None = None
    latency_s: float = 0.0
    engine: str = ""


@runtime_checkable
class Engine(Protocol):
    """The async engine interface every backend implements."""

    @property
    def name(self) -> str:
        """A human-readable identity (the base URL for HTTP engines)."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate for one request; an aborted request returns ``finish.kind == "abort"``."""
        ...

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate ``requests`` in one call (a batch the engine generates together); one result
        per request, in order.  The call fails or succeeds as a whole."""
        ...

    async def chat(self, request: ChatRequest) -> ChatResult:
        """One chat completion."""
        ...

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as the engine's tokenizer sees it."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort an in-flight request (a no-op for unknown ids)."""
        ...

    async def health(self) -> bool:
        """True when the engine answers its health check."""
        ...

    async def aclose(self) -> None:
        """Release connections; the engine object is unusable afterwards."""
        ...
