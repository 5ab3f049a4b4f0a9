"""The embedded engine's ASGI application (Starlette routing, pydantic validation).

Endpoints (SGLang's protocol subset; answers built by :mod:`..protocol`, so the client that talks
to SGLang talks to this server unchanged): ``POST /generate`` (one prompt, or SGLang's batch
form), ``POST /v1/chat/completions``, ``POST /abort_request``, ``POST /tokenize``,
``POST /update_weights_from_disk``, ``POST /load_lora_adapter``, ``POST /unload_lora_adapter``,
``GET /health``, ``GET /health_generate``, ``GET /get_model_info``.

Invariants:
- A request is read within :class:`~.body.Limits` (413 over the size cap, 408 past the body
  deadline; both close the connection), decoded by :func:`~.body.decode_json` and validated by
  the models of :mod:`.schema`: every malformed request is a 4xx whose message names the field;
  a 5xx means the backend itself failed.  No request stops the server.
- Weights (``/update_weights_from_disk``) and adapters (``/load_lora_adapter``) are read only
  from under the server's load directories (:class:`LoadDirs`); a path elsewhere is refused with
  one answer whatever is (or is not) there.
- Generation runs in worker threads (the backend serialises batches itself); a request id is
  abortable (``/abort_request``) from before its batch queues until it ends: a queued request
  ends before it starts, a running one after its current token, both with 200 and an ``abort``
  finish reason (as current SGLang).
- A batched ``/generate`` is generated as one batch, at most :data:`~..base.ENGINE_MAX_BATCH`
  prompts, answered with a list in the order of the prompts.
- starlette and pydantic are imported by :func:`build_app` (the ``embedded`` extra): this
  module imports on a base install.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

from .. import protocol
from ..base import ENGINE_MAX_BATCH, ChatRequest, GenerateRequest
from .backend import Backend, GenerationItem, UnsupportedParameterError
from .body import Limits, decode_json, read_body
from .schema import RequestRefused, split_generate_batch, validate
from .tokenizer import TokenizerError

__all__ = ["LoadDirs", "build_app", "chat_request", "error_body", "generate_requests"]

#: Worker threads for requests at once (most wait on the backend's batch lock).
MAX_WORKER_THREADS = 1024


def error_body(status: int, message: str) -> dict[str, Any]:
    """The error answer: ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": HTTPStatus(status).phrase, "code": status}}


class LoadDirs:
    """The directories under which the server may read weights and adapters (symlinks resolved:
    a path is judged by where it really leads)."""

    def __init__(self, roots: Sequence[str]):
        self.roots = tuple(os.path.realpath(root) for root in roots)

    def confine(self, path: str, field: str) -> str:
        """``path`` resolved, if it lies under a load directory; else :class:`RequestRefused`
        (the same answer whether or not anything exists at ``path``)."""
        real = os.path.realpath(path) if "\x00" not in path else None
        if real is not None and any(
            real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self.roots
        ):
            return real
        allowed = ", ".join(self.roots) or "none: started without --model or --load-dir"
        raise RequestRefused(
            f"'{field}' {path!r} is not under a directory this server loads from ({allowed}); "
            "put it there, or restart the server with --load-dir covering it",
            status=403,
        )


class _AbortRegistry:
    """Request id -> abort flag for requests that are queued or running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: dict[str, threading.Event] = {}

    def register(self, request_id: str) -> threading.Event:
        with self._lock:
            if request_id in self._flags:
                raise RequestRefused(
                    f"request id {request_id!r} is already in flight; use unique rids"
                )
            flag = self._flags[request_id] = threading.Event()
            return flag

    def release(self, request_id: str) -> None:
        with self._lock:
            self._flags.pop(request_id, None)

    def abort(self, request_id: str, abort_all: bool) -> None:
        with self._lock:
            targets = list(self._flags.values()) if abort_all else [self._flags.get(request_id)]
        for flag in targets:
            if flag is not None:
                flag.set()


class EngineHandlers:
    """The endpoints' logic over one backend: a parsed JSON body in, ``(status, answer)`` out
    (runs in a worker thread; raises :class:`RequestRefused` for a bad request)."""

    def __init__(self, backend: Backend, load_dirs: LoadDirs):
        self.backend = backend
        self.load_dirs = load_dirs
        self.inflight = _AbortRegistry()

    def _run(self, requests: list[tuple[Any, list[int]]], lora_names: list[str | None]):
        """Generate ``(request, prompt ids)`` pairs as one batch; every request id is in flight
        (abortable) from before the batch queues until it ends."""
        flags: list[threading.Event] = []
        try:
            for request, _ in requests:
                flags.append(self.inflight.register(request.request_id))
            items = [
                GenerationItem(
                    tuple(ids), request.sampling, request.request_id, request.return_logprob,
                    flag.is_set, lora_name,
                )
                for (request, ids), flag, lora_name in zip(requests, flags, lora_names, strict=True)
            ]  # fmt: skip
            return self.backend.generate_batch(items)
        finally:
            for request, _ in requests[: len(flags)]:
                self.inflight.release(request.request_id)

    def generate(self, body: Any) -> tuple[int, Any]:
        start = time.perf_counter()
        requests, batched = generate_requests(body, max_size=ENGINE_MAX_BATCH)
        tokenizer = self.backend.tokenizer
        pairs = [
            (r, list(r.input_ids) if r.input_ids is not None else tokenizer.encode(r.text or ""))
            for r in requests
        ]
        generations = self._run(pairs, [r.lora_path for r in requests])
        answers = []
        for (request, prompt_ids), gen in zip(pairs, generations, strict=True):
            logprobs = (gen.logprobs or ()) if request.return_logprob else None
            answers.append(
                protocol.build_generate_response(
                    request_id=request.request_id, text=gen.text, output_ids=gen.output_ids,
                    finish=gen.finish, prompt_tokens=len(prompt_ids), output_logprobs=logprobs,
                    e2e_latency=time.perf_counter() - start,
                )
            )  # fmt: skip
        return HTTPStatus.OK, answers if batched else answers[0]

    def chat(self, body: Any) -> tuple[int, Any]:
        request, return_prompt_token_ids = chat_request(body)
        tokenizer = self.backend.tokenizer
        prompt_ids = tokenizer.apply_chat_template(request.messages)
        (gen,) = self._run([(request, prompt_ids)], [request.lora_name])
        logprobs = (gen.logprobs or ()) if request.return_logprob else None
        return HTTPStatus.OK, protocol.build_chat_response(
            request=request,
            text=gen.text,
            finish=gen.finish,
            prompt_token_ids=prompt_ids,
            output_ids=gen.output_ids,
            output_logprobs=logprobs,
            token_texts=[tokenizer.token_text(t) for t in gen.output_ids],
            return_prompt_token_ids=return_prompt_token_ids,
        )

    def abort(self, body: Any) -> tuple[int, Any]:
        parsed = validate("AbortReq", body, protocol.ABORT_PATH)
        self.inflight.abort(parsed.rid, parsed.abort_all)
        return HTTPStatus.OK, {}

    def tokenize(self, body: Any) -> tuple[int, Any]:
        parsed = validate("TokenizeReqInput", body, protocol.TOKENIZE_PATH)
        tokens = self.backend.tokenizer.encode(
            parsed.prompt, add_special_tokens=parsed.add_special_tokens
        )
        return HTTPStatus.OK, protocol.build_tokenize_response(
            tokens, max_model_len=self.backend.max_model_len
        )

    def update_weights(self, body: Any) -> tuple[int, Any]:
        parsed = validate("UpdateWeightFromDiskReqInput", body, protocol.UPDATE_WEIGHTS_PATH)
        reload = getattr(self.backend, "reload", None)
        if reload is None:
            raise RequestRefused(f"the {self.backend.description} backend has no weights to update")
        path = self.load_dirs.confine(parsed.model_path, "model_path")
        try:
            message = reload(path)
        except Exception as exc:  # SGLang answers a failed load with 400 and success=false
            return HTTPStatus.BAD_REQUEST, protocol.build_update_weights_response(
                False, f"loading {parsed.model_path} failed: {type(exc).__name__}: {exc}"
            )
        return HTTPStatus.OK, protocol.build_update_weights_response(True, message)

    def load_lora(self, body: Any) -> tuple[int, Any]:
        parsed = validate("LoadLoRAAdapterReqInput", body, protocol.LOAD_LORA_PATH)
        if not hasattr(self.backend, "load_lora"):
            return self._no_lora()
        path = self.load_dirs.confine(parsed.lora_path, "lora_path")
        return self._lora_update(lambda backend: backend.load_lora(parsed.lora_name, path))

    def unload_lora(self, body: Any) -> tuple[int, Any]:
        parsed = validate("UnloadLoRAAdapterReqInput", body, protocol.UNLOAD_LORA_PATH)
        if not hasattr(self.backend, "unload_lora"):
            return self._no_lora()
        return self._lora_update(lambda backend: backend.unload_lora(parsed.lora_name))

    def _no_lora(self) -> tuple[int, Any]:
        return HTTPStatus.BAD_REQUEST, protocol.build_lora_update_response(
            False, f"the {self.backend.description} backend serves no LoRA adapters", {}
        )

    def _lora_update(self, update: Callable[[Any], dict[str, str]]) -> tuple[int, Any]:
        """SGLang's answer to a LoRA update: 200 with the loaded adapters, or 400 with
        ``success=false`` and the reason."""
        try:
            loaded = update(self.backend)
        except (UnsupportedParameterError, OSError) as exc:
            return HTTPStatus.BAD_REQUEST, protocol.build_lora_update_response(
                False, str(exc), self.backend.loaded_loras()
            )
        return HTTPStatus.OK, protocol.build_lora_update_response(True, None, loaded)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.backend.description,
            "is_generation": True,
            "max_model_len": self.backend.max_model_len,
        }


def generate_requests(body: Any, *, max_size: int) -> tuple[list[GenerateRequest], bool]:
    """A ``/generate`` body as ``(its requests, whether it is a batch)``: one request, or a
    batch's in the order of its prompts (each validated)."""
    if not isinstance(body, dict):
        validate("GenerateReqInput", body, protocol.GENERATE_PATH)  # refuses it, naming the type
    singles = split_generate_batch(body, max_size=max_size)
    if singles is None:
        return [
            _generate_request(validate("GenerateReqInput", body, protocol.GENERATE_PATH))
        ], False
    return [
        _generate_request(validate("GenerateReqInput", one, f"/generate prompt [{index}]"))
        for index, one in enumerate(singles)
    ], True


def _generate_request(parsed: Any) -> GenerateRequest:
    sampling = parsed.sampling_params.to_sampling() if parsed.sampling_params else None
    return GenerateRequest(
        request_id=parsed.rid or os.urandom(16).hex(),
        text=parsed.text,
        input_ids=tuple(parsed.input_ids) if parsed.input_ids is not None else None,
        **({"sampling": sampling} if sampling is not None else {}),
        return_logprob=bool(parsed.return_logprob),
        lora_path=parsed.lora_path,
    )


def chat_request(body: Any) -> tuple[ChatRequest, bool]:
    """A chat body as ``(request, return_prompt_token_ids)``; the adapter named in ``model``
    (``base:adapter``) wins over an explicit ``lora_path``."""
    parsed = validate("ChatCompletionRequest", body, protocol.CHAT_PATH)
    model, adapter = protocol.split_model_field(parsed.model)
    request = ChatRequest(
        request_id=parsed.rid or f"chatcmpl-{os.urandom(16).hex()}",
        messages=tuple(m.model_dump(exclude_none=True) for m in parsed.messages),
        sampling=parsed.to_sampling(),
        return_logprob=bool(parsed.logprobs),
        return_token_ids=bool(parsed.return_token_ids),
        model=model,
        lora_name=adapter if adapter is not None else parsed.lora_path,
    )
    return request, bool(parsed.return_prompt_token_ids)


def _render(status: int, answer: Any, *, close: bool = False) -> Any:
    from starlette.responses import Response

    # ASCII JSON: no answer can fail to encode, whatever a message quotes.
    data = json.dumps(answer, ensure_ascii=True, allow_nan=False).encode("ascii")
    headers = {"connection": "close"} if close else None
    return Response(data, status_code=int(status), media_type="application/json", headers=headers)


def build_app(backend: Backend, *, load_dirs: LoadDirs, limits: Limits) -> Any:
    """The Starlette application serving ``backend`` (see the module docstring)."""
    import anyio
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.routing import Route

    handlers = EngineHandlers(backend, load_dirs)
    threads: list[Any] = []  # the limiter, made in the event loop on first use

    def handle(endpoint: Callable[[Any], tuple[int, Any]], raw: bytes) -> tuple[int, Any]:
        try:
            body = decode_json(raw, limits)
        except RequestRefused as exc:
            return exc.status, error_body(exc.status, str(exc))
        return handle_value(endpoint, body)

    def handle_value(endpoint: Callable[[Any], tuple[int, Any]], body: Any) -> tuple[int, Any]:
        try:
            return endpoint(body)
        except RequestRefused as exc:
            return exc.status, error_body(exc.status, str(exc))
        except (UnsupportedParameterError, TokenizerError) as exc:
            return HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:  # the backend failed: a 5xx, and the server goes on
            traceback.print_exc(file=sys.stderr)
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            return status, error_body(status, f"{type(exc).__name__}: {exc}")

    def post(endpoint: Callable[[Any], tuple[int, Any]]) -> Callable[[Request], Any]:
        async def route(request: Request) -> Any:
            try:
                raw = await read_body(
                    request.stream(), request.headers.get("content-length"), limits
                )
            except RequestRefused as exc:
                return _render(exc.status, error_body(exc.status, str(exc)), close=True)
            except ClientDisconnect:
                return _render(HTTPStatus.BAD_REQUEST, {}, close=True)  # nobody reads it
            if not threads:
                threads.append(anyio.CapacityLimiter(MAX_WORKER_THREADS))
            status, answer = await anyio.to_thread.run_sync(
                handle, endpoint, raw, limiter=threads[0]
            )
            return _render(status, answer)

        return route

    async def health(request: Request) -> Any:
        return _render(HTTPStatus.OK, {})

    async def health_generate(request: Request) -> Any:
        """Healthy when one token generates (SGLang's ``/health_generate``)."""
        probe = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
        probe["rid"] = f"health-generate-{os.urandom(8).hex()}"
        status, answer = await anyio.to_thread.run_sync(handle_value, handlers.generate, probe)
        return _render(status, {} if status == HTTPStatus.OK else answer)

    async def model_info(request: Request) -> Any:
        return _render(HTTPStatus.OK, handlers.model_info())

    async def http_error(request: Request, exc: Any) -> Any:
        """404 and 405: the connection closes (an unread body is never drained)."""
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _render(exc.status_code, error_body(exc.status_code, message), close=True)

    routes = [
        Route(protocol.HEALTH_PATH, health, methods=["GET"]),
        Route(protocol.HEALTH_GENERATE_PATH, health_generate, methods=["GET"]),
        Route(protocol.MODEL_INFO_PATH, model_info, methods=["GET"]),
        Route(protocol.GENERATE_PATH, post(handlers.generate), methods=["POST"]),
        Route(protocol.CHAT_PATH, post(handlers.chat), methods=["POST"]),
        Route(protocol.ABORT_PATH, post(handlers.abort), methods=["POST"]),
        Route(protocol.TOKENIZE_PATH, post(handlers.tokenize), methods=["POST"]),
        Route(protocol.UPDATE_WEIGHTS_PATH, post(handlers.update_weights), methods=["POST"]),
        Route(protocol.LOAD_LORA_PATH, post(handlers.load_lora), methods=["POST"]),
        Route(protocol.UNLOAD_LORA_PATH, post(handlers.unload_lora), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
