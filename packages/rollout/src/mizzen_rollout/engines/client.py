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
- ``timeout_s`` bounds one HTTP exchange as a whole (connecting, sending, the status and every
  byte of the body), whatever pace the server answers at: past it the exchange is cancelled and
  :class:`EngineTimeoutError` raised.  The deadline starts once the exchange has one of the
  ``max_connections`` (waiting for one is not counted: a queued request is not a slow engine).
- A body is read as a stream and never beyond ``max_response_bytes`` (after any
  ``Content-Encoding`` is undone; default :data:`MAX_RESPONSE_BYTES`): a larger answer raises
  :class:`EngineProtocolError` naming the limit.  An error answer's body is kept up to
  :data:`MAX_ERROR_BODY_BYTES` (``EngineRequestError.body``) and shown escaped in messages.
- Every failure is an :class:`EngineError`: a body that is not UTF-8 JSON (or does not decode, or
  nests too deep) is an :class:`EngineProtocolError` naming the endpoint; every transport error of
  httpx maps to a subclass (connection errors retried as above; a protocol httpx cannot speak
  :class:`EngineUnavailableError`, not retried).
- ``base_url`` is ``http(s)://host[:port][/path]`` (:func:`check_engine_url`, the one rule the
  CLI's ``--engine-url`` uses too); anything else is a ``ValueError`` in the constructor.
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
from urllib.parse import urlsplit

import httpx

from ..masking import shown_line
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

__all__ = [
    "MAX_ERROR_BODY_BYTES",
    "MAX_RESPONSE_BYTES",
    "RetryPolicy",
    "SGLangClient",
    "check_engine_url",
]

#: The default cap on one answer's body (decoded): 64 MiB holds a batch of ENGINE_MAX_BATCH
#: generations of thousands of tokens with log-probs many times over.
MAX_RESPONSE_BYTES = 64 * 2**20
#: How much of an error answer's body is kept (``EngineRequestError.body``).
MAX_ERROR_BODY_BYTES = 64 * 2**10
_SHOWN_BODY_CHARS = 500

# Transport failures that mean "the engine is not reachable / dropped the connection".
_CONNECTION_ERRORS = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
_ABORTED_MEMORY = 10_000
_URL_FIX = "fix: give a server URL such as http://127.0.0.1:30000 (http(s)://host[:port][/path])"


def check_engine_url(url: str) -> None:
    """Require ``http(s)://host[:port][/path]`` (a port in 1..65535); raise ``ValueError``
    saying what is wrong and the fix.  The one rule of an engine URL (the client, the CLI)."""
    problem = ""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port out of range or not a number
    except (ValueError, TypeError, AttributeError) as exc:
        problem, port = str(exc) or type(exc).__name__, None
    if not problem and parts.scheme not in ("http", "https"):
        problem = "the scheme is not http or https"
    elif not problem and not parts.hostname:
        problem = "it has no host"
    elif not problem and port == 0:
        problem = "port 0 is not a server's port"
    if problem:
        raise ValueError(f"{problem}; {_URL_FIX}")


class _BodyTooLarge(Exception):
    pass


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

    ``timeout_s`` bounds one HTTP exchange as a whole (a whole non-streamed generation, its
    body included); ``connect_timeout_s`` bounds connecting.  ``max_connections`` caps the pool.
    ``max_response_bytes`` caps one answer's decoded body (module docstring).
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
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ):
        try:
            check_engine_url(base_url)
        except ValueError as exc:
            raise ValueError(f"SGLangClient base_url {shown_line(repr(base_url))}: {exc}") from None
        if not timeout_s > 0:
            raise ValueError(f"SGLangClient timeout_s is {timeout_s}; use a number of seconds > 0")
        if max_connections < 1:
            raise ValueError(f"SGLangClient max_connections is {max_connections}; use >= 1")
        if max_response_bytes < 1:
            raise ValueError(
                f"SGLangClient max_response_bytes is {max_response_bytes}; use >= 1 (default "
                f"{MAX_RESPONSE_BYTES})"
            )
        self._max_response_bytes = max_response_bytes
        self._timeout_s = timeout_s
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
        # an exchange waits here for one of the pool's connections before its deadline starts
        self._connections = asyncio.Semaphore(max_connections)
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
        where = f"{self._base_url}{path}"
        while True:
            self.attempts += 1
            try:
                status, data = await self._exchange(path, payload)
            except _CONNECTION_ERRORS as exc:
                last_problem = f"{type(exc).__name__}: {shown_line(exc, _SHOWN_BODY_CHARS)}"
            except (httpx.TimeoutException, TimeoutError) as exc:
                if self._abort_on_timeout:
                    await asyncio.gather(*(self._abort_quietly(r) for r in request_ids))
                raise EngineTimeoutError(
                    f"{where}: no answer within {self._timeout_s} s ({type(exc).__name__}) for "
                    f"{what}; the request was aborted on the server. Raise timeout_s if "
                    "generations are this long.",
                    engine=self._base_url,
                    request_id=request_id,
                ) from None
            except _BodyTooLarge:
                raise EngineProtocolError(
                    f"{where}: the answer for {what} is larger than max_response_bytes="
                    f"{self._max_response_bytes} (after decoding); fix: raise max_response_bytes "
                    "if answers this large are expected, or check what answers at that URL",
                    engine=self._base_url,
                    request_id=request_id,
                ) from None
            except httpx.DecodingError as exc:
                raise EngineProtocolError(
                    f"{where}: the answer for {what} does not decode as its Content-Encoding "
                    f"says ({shown_line(exc, 200)}); an engine answers plain or well-formed "
                    "compressed bodies",
                    engine=self._base_url,
                    request_id=request_id,
                ) from None
            except httpx.HTTPError as exc:  # UnsupportedProtocol, LocalProtocolError, ProxyError...
                raise EngineUnavailableError(
                    f"{where}: could not exchange with the engine for {what} "
                    f"({type(exc).__name__}: {shown_line(exc, 200)}); fix: check the engine URL "
                    "(http(s)://host:port) and that an HTTP engine answers there",
                    engine=self._base_url,
                    request_id=request_id,
                ) from None
            else:
                if status < 300:
                    return self._decoded(where, status, data, request_id)
                if any(r in self._aborted for r in request_ids):
                    return None
                text = data.decode("utf-8", "replace")
                if status < 500:
                    raise EngineRequestError(
                        f"{where}: HTTP {status} for {what}: {shown_line(text, _SHOWN_BODY_CHARS)}",
                        status_code=status,
                        body=text,
                        engine=self._base_url,
                        request_id=request_id,
                    )
                last_problem = f"HTTP {status}: {shown_line(text, 200)}"
            failures += 1
            if failures >= self._retry.max_attempts:
                raise EngineUnavailableError(
                    f"{where}: gave up after {failures} attempt(s) for {what}; "
                    f"last: {last_problem}. Check that the engine is running.",
                    engine=self._base_url,
                    request_id=request_id,
                )
            await asyncio.sleep(self._retry.delay(failures))

    async def _exchange(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """One POST within the deadline ``timeout_s`` (sending, status and body): the status and
        the body, read as a stream up to ``max_response_bytes`` (an error body: cut at
        :data:`MAX_ERROR_BODY_BYTES`).  Raises ``TimeoutError`` past the deadline and
        :class:`_BodyTooLarge` past the cap.  Waiting for a free connection of the pool comes
        before the deadline (a queued request is not a slow engine)."""
        async with (
            self._connections,
            asyncio.timeout(self._timeout_s),
            self._http.stream("POST", path, json=payload) as response,
        ):
            ok = response.status_code < 300
            limit = self._max_response_bytes if ok else MAX_ERROR_BODY_BYTES
            declared = response.headers.get("content-length", "")
            plain = response.headers.get("content-encoding", "identity") == "identity"
            if ok and plain and declared.isdigit() and int(declared) > limit:
                raise _BodyTooLarge  # refused before reading it
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    if ok:
                        raise _BodyTooLarge
                    break
            return response.status_code, b"".join(chunks)[:limit]

    def _decoded(self, where: str, status: int, data: bytes, request_id: str | None) -> Any:
        """The JSON document ``data`` (UTF-8), or :class:`EngineProtocolError` saying why not."""
        try:
            return json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, a 5000-digit number
            if isinstance(exc, UnicodeDecodeError):
                problem = f"is not UTF-8 (byte {exc.start})"
            elif isinstance(exc, RecursionError):
                problem = "nests too deep to decode"
            else:
                problem = f"is not JSON ({shown_line(exc, 120)})"
            raise EngineProtocolError(
                f"{where}: answered {status} with a body that {problem}; an engine answers a "
                f"UTF-8 JSON document. Body starts: "
                f"{shown_line(repr(data[:200]), 300)}",
                engine=self._base_url,
                request_id=request_id,
            ) from None

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
                f"{self._base_url} refused to load {model_path}: "
                f"{shown_line(message, _SHOWN_BODY_CHARS)}",
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
            reason: object = exc.body
            with contextlib.suppress(ValueError, AttributeError, RecursionError):
                reason = json.loads(exc.body).get("error_message") or reason
            if exc.status_code == 404:
                reason = f"no {path} endpoint (start SGLang with --enable-lora)"
            raise EngineRequestError(
                f"{self._base_url} refused to {what}: {shown_line(reason, _SHOWN_BODY_CHARS)}",
                status_code=exc.status_code,
                body=exc.body,
                engine=self._base_url,
            ) from None
        success, message, loaded = protocol.parse_lora_update_response(body, engine=self._base_url)
        if not success:
            raise EngineRequestError(
                f"{self._base_url} refused to {what}: {shown_line(message, _SHOWN_BODY_CHARS)}",
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
        """Whether ``GET /health`` answers 200 within ``timeout_s`` (the body is not read)."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._http.stream("GET", protocol.HEALTH_PATH) as response:
                    return response.status_code == 200
        except (httpx.HTTPError, TimeoutError):
            return False
