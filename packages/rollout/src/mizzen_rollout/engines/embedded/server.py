"""The embedded engine server (``mizzen-rollout serve``): SGLang's protocol subset over HTTP/1.1.

Endpoints: ``POST /generate``, ``POST /v1/chat/completions``, ``POST /abort_request``,
``POST /tokenize``, ``POST /update_weights_from_disk``, ``POST /load_lora_adapter``,
``POST /unload_lora_adapter``, ``GET /health``, ``GET /get_model_info`` —
shapes from :mod:`..protocol`, so the client code that talks to SGLang talks to this server
unchanged.

Invariants:
- Standard library HTTP (``ThreadingHTTPServer``, keep-alive); one thread per connection; the
  backend serialises generation itself.
- A batched ``/generate`` (lists of prompts, SGLang's batch form) is generated as one batch by
  the backend and answered with a list, in order; at most :data:`~..base.ENGINE_MAX_BATCH` prompts.
- The server listens only after the backend is loaded, so ``/health`` answering 200 means ready.
  With ``port=0`` the kernel picks the port; ``port_file`` receives it (written atomically).
- A request whose body breaks the protocol, or asks for something the backend does not implement,
  gets HTTP 400 with a message; a backend crash gets HTTP 500 with the message.  Neither stops
  the server.
- ``/abort_request`` marks the request id: a queued request ends before it starts, a running one
  after its current token; both answer 200 with an ``abort`` finish reason (as current SGLang).
- With ``parent_pid`` set, the server exits when that process is gone (no orphans when an engine
  worker is killed); ``mizzen-rollout serve`` starts watching before the backend loads.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .. import protocol
from ..base import ENGINE_MAX_BATCH
from .backend import Backend, GenerationItem, UnsupportedParameterError
from .tokenizer import TokenizerError

__all__ = ["EmbeddedServer", "serve"]


class _AbortRegistry:
    """Request id -> abort flag for requests that are queued or running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: dict[str, threading.Event] = {}

    def register(self, request_id: str) -> threading.Event:
        with self._lock:
            if request_id in self._flags:
                raise protocol.ProtocolRequestError(
                    f"request id {request_id!r} is already in flight; use unique rids"
                )
            flag = self._flags[request_id] = threading.Event()
            return flag

    def release(self, request_id: str) -> None:
        with self._lock:
            self._flags.pop(request_id, None)

    def abort(self, request_id: str, abort_all: bool) -> int:
        with self._lock:
            targets = list(self._flags.values()) if abort_all else [self._flags.get(request_id)]
        hit = 0
        for flag in targets:
            if flag is not None:
                flag.set()
                hit += 1
        return hit

    def __len__(self) -> int:
        return len(self._flags)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Small responses written as headers + body would otherwise wait on delayed ACKs (~40 ms).
    disable_nagle_algorithm = True
    server: EmbeddedServer

    # Quiet by default: one line per request would drown the test logs.
    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error_json(self, status: HTTPStatus, message: str) -> None:
        self._send_json(
            status, {"error": {"message": message, "type": status.phrase, "code": status.value}}
        )

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"null")
        except json.JSONDecodeError as exc:
            raise protocol.ProtocolRequestError(f"the body is not JSON ({exc})") from None

    def do_GET(self) -> None:
        if self.path == protocol.HEALTH_PATH:
            self._send_json(HTTPStatus.OK, {})
        elif self.path == protocol.MODEL_INFO_PATH:
            self._send_json(
                HTTPStatus.OK,
                {
                    "model_path": self.server.backend.description,
                    "is_generation": True,
                    "max_model_len": self.server.backend.max_model_len,
                },
            )
        else:
            self._send_error_json(HTTPStatus.NOT_FOUND, f"no route GET {self.path}")

    def do_POST(self) -> None:
        routes = {
            protocol.GENERATE_PATH: self.server.handle_generate,
            protocol.CHAT_PATH: self.server.handle_chat,
            protocol.ABORT_PATH: self.server.handle_abort,
            protocol.TOKENIZE_PATH: self.server.handle_tokenize,
            protocol.UPDATE_WEIGHTS_PATH: self.server.handle_update_weights,
            protocol.LOAD_LORA_PATH: self.server.handle_load_lora,
            protocol.UNLOAD_LORA_PATH: self.server.handle_unload_lora,
        }
        handler = routes.get(self.path)
        if handler is None:
            self._read_json_quietly()
            self._send_error_json(HTTPStatus.NOT_FOUND, f"no route POST {self.path}")
            return
        try:
            body = self._read_json()
            status, answer = handler(body)
        except (protocol.ProtocolRequestError, UnsupportedParameterError, TokenizerError) as exc:
            self._send_error_json(HTTPStatus.BAD_REQUEST, str(exc))
            return
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self._send_error_json(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
            return
        self._send_json(status, answer)

    def _read_json_quietly(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)


class EmbeddedServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer bound to ``host:port`` serving one backend."""

    daemon_threads = True
    request_queue_size = 2048

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0, verbose=False):
        self.backend = backend
        self.verbose = verbose
        self.inflight = _AbortRegistry()
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def client_url(self) -> str:
        """The URL a local client should use (a wildcard bind is reached on 127.0.0.1)."""
        host, port = self.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    # ------------------------------------------------------------------ handlers
    def _run(self, requests: list[tuple[Any, list[int]]], lora_names: list[str | None]):
        """Generate ``(request, prompt ids)`` pairs as one batch; every request id is in flight
        (abortable) from before the batch queues until it ends."""
        flags: list[threading.Event] = []
        try:
            for request, _ in requests:
                flags.append(self.inflight.register(request.request_id))
            items = [
                GenerationItem(
                    tuple(prompt_ids),
                    request.sampling,
                    request.request_id,
                    request.return_logprob,
                    flag.is_set,
                    lora_name,
                )
                for (request, prompt_ids), flag, lora_name in zip(
                    requests, flags, lora_names, strict=True
                )
            ]
            return self.backend.generate_batch(items)
        finally:
            for request, _ in requests[: len(flags)]:
                self.inflight.release(request.request_id)

    def handle_generate(self, body: Any) -> tuple[int, Any]:
        start = time.perf_counter()
        batched = protocol.is_generate_batch(body)
        requests = (
            protocol.parse_generate_batch_payload(body, max_size=ENGINE_MAX_BATCH)
            if batched
            else [protocol.parse_generate_payload(body)]
        )
        tokenizer = self.backend.tokenizer
        pairs = []
        for request in requests:
            if request.lora_path is not None and not isinstance(request.lora_path, str):
                raise protocol.ProtocolRequestError("'lora_path' must be one adapter name here")
            prompt_ids = (
                list(request.input_ids)
                if request.input_ids is not None
                else tokenizer.encode(request.text or "")
            )
            pairs.append((request, prompt_ids))
        generations = self._run(pairs, [r.lora_path for r in requests])
        answers = []
        for (request, prompt_ids), gen in zip(pairs, generations, strict=True):
            logprobs = gen.logprobs
            if request.return_logprob and logprobs is None:
                logprobs = ()
            answers.append(
                protocol.build_generate_response(
                    request_id=request.request_id,
                    text=gen.text,
                    output_ids=gen.output_ids,
                    finish=gen.finish,
                    prompt_tokens=len(prompt_ids),
                    output_logprobs=logprobs if request.return_logprob else None,
                    e2e_latency=time.perf_counter() - start,
                )
            )
        return HTTPStatus.OK, answers if batched else answers[0]

    def handle_chat(self, body: Any) -> tuple[int, Any]:
        request = protocol.parse_chat_payload(body)
        tokenizer = self.backend.tokenizer
        prompt_ids = tokenizer.apply_chat_template(request.messages)
        (gen,) = self._run([(request, prompt_ids)], [request.lora_name])
        logprobs = gen.logprobs
        if request.return_logprob and logprobs is None:
            logprobs = ()
        return HTTPStatus.OK, protocol.build_chat_response(
            request=request,
            text=gen.text,
            finish=gen.finish,
            prompt_token_ids=prompt_ids,
            output_ids=gen.output_ids,
            output_logprobs=logprobs if request.return_logprob else None,
            token_texts=[tokenizer.token_text(t) for t in gen.output_ids],
            return_prompt_token_ids=bool(body.get("return_prompt_token_ids")),
        )

    def handle_abort(self, body: Any) -> tuple[int, Any]:
        request_id, abort_all = protocol.parse_abort_payload(body)
        self.inflight.abort(request_id, abort_all)
        return HTTPStatus.OK, {}

    def handle_update_weights(self, body: Any) -> tuple[int, Any]:
        model_path = protocol.parse_update_weights_payload(body)
        reload = getattr(self.backend, "reload", None)
        if reload is None:
            raise UnsupportedParameterError(
                f"the {self.backend.description} backend has no weights to update"
            )
        try:
            message = reload(model_path)
        except Exception as exc:  # SGLang answers a failed load with 400 and success=false
            return HTTPStatus.BAD_REQUEST, protocol.build_update_weights_response(
                False, f"loading {model_path} failed: {type(exc).__name__}: {exc}"
            )
        return HTTPStatus.OK, protocol.build_update_weights_response(True, message)

    def handle_load_lora(self, body: Any) -> tuple[int, Any]:
        name, path, _pinned = protocol.parse_load_lora_payload(body)  # pinning: nothing to evict
        return self._lora_update(lambda backend: backend.load_lora(name, path))

    def handle_unload_lora(self, body: Any) -> tuple[int, Any]:
        name = protocol.parse_unload_lora_payload(body)
        return self._lora_update(lambda backend: backend.unload_lora(name))

    def _lora_update(self, update: Any) -> tuple[int, Any]:
        """SGLang's answer to a LoRA update: 200 with the loaded adapters, or 400 with
        ``success=false`` and the reason."""
        backend = self.backend
        if not hasattr(backend, "load_lora"):
            return HTTPStatus.BAD_REQUEST, protocol.build_lora_update_response(
                False, f"the {backend.description} backend serves no LoRA adapters", {}
            )
        try:
            loaded = update(backend)
        except (UnsupportedParameterError, OSError) as exc:
            return HTTPStatus.BAD_REQUEST, protocol.build_lora_update_response(
                False, str(exc), backend.loaded_loras()
            )
        return HTTPStatus.OK, protocol.build_lora_update_response(True, None, loaded)

    def handle_tokenize(self, body: Any) -> tuple[int, Any]:
        text, add_special = protocol.parse_tokenize_payload(body)
        tokens = self.backend.tokenizer.encode(text, add_special_tokens=add_special)
        return HTTPStatus.OK, protocol.build_tokenize_response(
            tokens, max_model_len=self.backend.max_model_len
        )


def _write_url_file(path: str, url: str) -> None:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(url, encoding="utf-8")
    os.replace(tmp, target)


def watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as ``parent_pid`` is no longer its parent (a daemon thread).
    Started before the backend loads, so a launcher killed during a slow model load leaves no
    orphan behind; idempotent."""
    global _WATCHING
    if _WATCHING:
        return
    _WATCHING = True
    threading.Thread(
        target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch"
    ).start()


_WATCHING = False


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent_pid:
            print(
                f"mizzen-rollout serve: parent process {parent_pid} is gone; shutting down",
                file=sys.stderr,
                flush=True,
            )
            os._exit(0)


def serve(
    backend: Backend,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    port_file: str | None = None,  # receives the URL once listening
    parent_pid: int | None = None,
    verbose: bool = False,
) -> None:
    """Serve ``backend`` until interrupted (blocks)."""
    server = EmbeddedServer(backend, host, port, verbose=verbose)
    if parent_pid is not None:
        watch_parent(parent_pid)
    if port_file:
        _write_url_file(port_file, server.client_url)
    print(f"mizzen-rollout serve: listening on {server.url} ({backend.description})", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
