"""The SGLang HTTP client: native ``/generate``, OpenAI ``/v1/chat/completions``, abort, health.

Works against a real SGLang server and against mizzen's embedded server alike (both speak
:mod:`.protocol`).

Invariants:
- One pooled ``httpx.AsyncClient`` per engine (keep-alive connections are reused).
- Retries are bounded (``RetryPolicy.max_attempts`` attempts in total) with exponential backoff,
  and happen only for connection errors and HTTP 5xx.  A 4xx is never retried
  (:class:`EngineRequestError`).  A read timeout is never retried either (the engine may still be
  generating): the client aborts that request id on the server, best-effort, and raises
  :class:`EngineTimeoutError`.
- Once :meth:`SGLangClient.abort` was called for a request id, any answer to that request (a 200
  with an ``abort`` finish reason, or an HTTP error, depending on the SGLang version) comes back as
  a result with ``finish.kind == "abort"``, not as an error.
- Request ids are the caller's and are sent as SGLang's ``rid``.
- :meth:`SGLangClient.generate_batch` sends its requests as one batched ``/generate``; it is one
  HTTP exchange (retried, timed out and aborted as a whole) with one result per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from . import protocol
from .base import (
    ChatRequest,
    ChatResult,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
)

__all__ = ["RetryPolicy", "SGLangClient"]

# Transport failures that mean "the engine is not reachable / dropped the connection".
_CONNECTION_ERRORS = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
_ABORTED_MEMORY = 10_000


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: ``max_attempts`` attempts in total, sleeping
    ``min(backoff_s * 2**k, backoff_max_s)`` (times a jitter in [0.5, 1]) after failure k."""

    max_attempts: int = 4
    backoff_s: float = 0.05
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts is {self.max_attempts}; use >= 1")

    def delay(self, failures: int) -> float:
        base = min(self.backoff_s * (2 ** (failures - 1)), self.backoff_max_s)
        return base * (0.5 + random.random() / 2)


class SGLangClient:
    """An :class:`~mizzen_rollout.engines.base.Engine` over SGLang's HTTP API.

    ``timeout_s`` bounds one HTTP exchange (a whole non-streamed generation);
    ``connect_timeout_s`` bounds connecting.  ``max_connections`` caps the pool.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 256,
        abort_on_timeout: bool = True,
    ):
        self._base_url = base_url.rstrip("/")
        self._retry = retry or RetryPolicy()
        self._abort_on_timeout = abort_on_timeout
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._http = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=self._timeout,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self.attempts = 0  # HTTP attempts made (retries included); for tests and metrics

    @property
    def name(self) -> str:
        return self._base_url

    @property
    def base_url(self) -> str:
        return self._base_url

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------------ transport
    async def _post(
        self, path: str, payload: dict[str, Any], request_ids: Sequence[str] = ()
    ) -> Any:
        """POST with bounded retries; returns the decoded JSON body.  ``request_ids``: the
        generation requests the body carries (one, or a batch's).

        Returns ``None`` when one of them was aborted by us and the server answered with an error.
        """
        failures = 0
        last_problem = ""
        request_id = request_ids[0] if request_ids else None
        if len(request_ids) > 1:
            what = f"the batch of {len(request_ids)} requests {request_ids[0]!r}..."
        else:
            what = f"request {request_id!r}" if request_id is not None else "this call"
        while True:
            self.attempts += 1
            try:
                response = await self._http.post(path, json=payload)
            except _CONNECTION_ERRORS as exc:
                last_problem = f"{type(exc).__name__}: {exc}"
            except httpx.TimeoutException as exc:
                if self._abort_on_timeout:
                    await asyncio.gather(*(self._abort_quietly(r) for r in request_ids))
                raise EngineTimeoutError(
                    f"{self._base_url}{path}: no answer within {self._timeout.read} s "
                    f"({type(exc).__name__}) for {what}; the request was "
                    "aborted on the server. Raise timeout_s if generations are this long.",
                    engine=self._base_url,
                    request_id=request_id,
                ) from None
            else:
                status = response.status_code
                if status < 300:
                    try:
                        return response.json()
                    except json.JSONDecodeError:
                        raise EngineProtocolError(
                            f"{self._base_url}{path}: answered {status} with a body that is not "
                            f"JSON: {response.text[:200]!r}",
                            engine=self._base_url,
                            request_id=request_id,
                        ) from None
                if any(r in self._aborted for r in request_ids):
                    return None
                if status < 500:
                    raise EngineRequestError(
                        f"{self._base_url}{path}: HTTP {status} for {what}: {response.text[:500]}",
                        status_code=status,
                        body=response.text,
                        engine=self._base_url,
                        request_id=request_id,
                    )
                last_problem = f"HTTP {status}: {response.text[:200]}"
            failures += 1
            if failures >= self._retry.max_attempts:
                raise EngineUnavailableError(
                    f"{self._base_url}{path}: gave up after {failures} attempt(s) for {what}; "
                    f"last: {last_problem}. Check that the engine is running.",
                    engine=self._base_url,
                    request_id=request_id,
                )
            await asyncio.sleep(self._retry.delay(failures))

    async def _abort_quietly(self, request_id: str) -> None:
        # Best-effort: the server may be the thing that is broken.
        with contextlib.suppress(Exception):
            await self.abort(request_id)

    # ------------------------------------------------------------------ Engine API
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        start = time.perf_counter()
        body = await self._post(
            protocol.GENERATE_PATH, protocol.build_generate_payload(request), (request.request_id,)
        )
        latency = time.perf_counter() - start
        self._aborted.pop(request.request_id, None)
        if body is None:
            return self._aborted_result(request, latency)
        # An abort that raced with the end of generation leaves the full result standing.
        return protocol.parse_generate_response(
            body, request_id=request.request_id, engine=self._base_url, latency_s=latency
        )

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate ``requests`` as one batched ``/generate`` (SGLang's list form); one result
        per request, in order.  One request is sent as a plain request."""
        if len(requests) == 1:
            return [await self.generate(requests[0])]
        ids = tuple(r.request_id for r in requests)
        start = time.perf_counter()
        body = await self._post(
            protocol.GENERATE_PATH, protocol.build_generate_batch_payload(requests), ids
        )
        latency = time.perf_counter() - start
        for request_id in ids:
            self._aborted.pop(request_id, None)
        if body is None:
            return [self._aborted_result(r, latency) for r in requests]
        return protocol.parse_generate_batch_response(
            body, requests=requests, engine=self._base_url, latency_s=latency
        )

    def _aborted_result(self, request: GenerateRequest, latency: float) -> GenerateResult:
        return GenerateResult(
            request_id=request.request_id,
            text="",
            output_ids=(),
            finish=FinishReason("abort", message="aborted (server answered with an error)"),
            prompt_tokens=len(request.input_ids or ()),
            completion_tokens=0,
            output_logprobs=() if request.return_logprob else None,
            latency_s=latency,
            engine=self._base_url,
        )

    async def chat(self, request: ChatRequest) -> ChatResult:
        start = time.perf_counter()
        body = await self._post(
            protocol.CHAT_PATH, protocol.build_chat_payload(request), (request.request_id,)
        )
        latency = time.perf_counter() - start
        self._aborted.pop(request.request_id, None)
        if body is None:
            return ChatResult(
                request_id=request.request_id,
                text="",
                finish=FinishReason("abort", message="aborted (server answered with an error)"),
                prompt_tokens=0,
                completion_tokens=0,
                latency_s=latency,
                engine=self._base_url,
            )
        return protocol.parse_chat_response(
            body, request_id=request.request_id, engine=self._base_url, latency_s=latency
        )

    async def tokenize(self, text: str) -> list[int]:
        try:
            body = await self._post(protocol.TOKENIZE_PATH, protocol.build_tokenize_payload(text))
        except EngineRequestError as exc:
            if exc.status_code == 404:
                raise EngineRequestError(
                    f"{self._base_url} has no {protocol.TOKENIZE_PATH} endpoint (an old SGLang?); "
                    "send text prompts without server tokenisation instead "
                    "(mizzen-rollout generate --no-server-tokenize)",
                    status_code=404,
                    engine=self._base_url,
                ) from None
            raise
        return protocol.parse_tokenize_response(body, engine=self._base_url)

    async def update_weights_from_disk(self, model_path: str) -> str:
        """Make the server load the weights of ``model_path`` (a directory it can read, of the
        architecture it serves); returns the server's message.  A refusal raises
        :class:`EngineRequestError` with the server's reason."""
        body = await self._post(
            protocol.UPDATE_WEIGHTS_PATH, protocol.build_update_weights_payload(model_path)
        )
        success, message = protocol.parse_update_weights_response(body, engine=self._base_url)
        if not success:
            raise EngineRequestError(
                f"{self._base_url} refused to load {model_path}: {message}",
                status_code=200,
                body=message,
                engine=self._base_url,
            )
        return message

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> dict:
        """Make the server load the PEFT adapter directory ``path`` (one it can read) under
        ``name`` (SGLang's ``/load_lora_adapter``); returns the loaded adapters ``{name: path}``.
        A refusal (the name is taken, the adapter does not fit the server) raises
        :class:`EngineRequestError` with the server's reason."""
        return await self._lora_update(
            protocol.LOAD_LORA_PATH,
            protocol.build_load_lora_payload(name, path, pinned=pinned),
            f"load adapter {name!r} from {path}",
        )

    async def unload_lora_adapter(self, name: str) -> dict:
        """Unload the adapter ``name`` (SGLang's ``/unload_lora_adapter``; the server finishes
        the requests using it first); returns the adapters still loaded."""
        return await self._lora_update(
            protocol.UNLOAD_LORA_PATH,
            protocol.build_unload_lora_payload(name),
            f"unload adapter {name!r}",
        )

    async def _lora_update(self, path: str, payload: dict[str, Any], what: str) -> dict:
        try:
            body = await self._post(path, payload)
        except EngineRequestError as exc:
            # SGLang answers a refused update with 400 and its LoRAUpdateOutput as the body
            reason = exc.body[:500]
            with contextlib.suppress(ValueError, AttributeError):
                reason = json.loads(exc.body).get("error_message") or reason
            if exc.status_code == 404:
                reason = f"no {path} endpoint (start SGLang with --enable-lora)"
            raise EngineRequestError(
                f"{self._base_url} refused to {what}: {reason}",
                status_code=exc.status_code,
                body=exc.body,
                engine=self._base_url,
            ) from None
        success, message, loaded = protocol.parse_lora_update_response(body, engine=self._base_url)
        if not success:
            raise EngineRequestError(
                f"{self._base_url} refused to {what}: {message}",
                status_code=200,
                body=message,
                engine=self._base_url,
            )
        return loaded

    async def abort(self, request_id: str) -> None:
        self._aborted[request_id] = None
        while len(self._aborted) > _ABORTED_MEMORY:
            self._aborted.popitem(last=False)
        await self._post(protocol.ABORT_PATH, protocol.build_abort_payload(request_id))

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            response = await self._http.get(protocol.HEALTH_PATH, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
