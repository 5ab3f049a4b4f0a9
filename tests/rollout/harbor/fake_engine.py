"""A scripted OpenAI-compatible chat-completions server on 127.0.0.1 for the Harbor tests.

It stands in for the inference engine (which needs a GPU) and nothing else: agents talk to it over
real HTTP exactly as they would to the engine. Every request (headers and JSON body) is recorded.

Modes: `replies` (a list of assistant texts served in order, the last one repeated),
`stall_s` (hold each request that long before answering: a hung engine), `finish_reason`
(`length` = every reply was cut at max_tokens).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeEngine:
    replies: list[str] = field(default_factory=lambda: ["{}"])
    stall_s: float = 0.0
    finish_reason: str = "stop"
    model: str = "mizzen-test-model"
    requests: list[RecordedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._json(200, {"object": "list", "data": [{"id": engine.model}]})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with engine._lock:
                    engine.requests.append(
                        RecordedRequest(
                            self.path, {k.lower(): v for k, v in self.headers.items()}, body
                        )
                    )
                    index = len(engine.requests) - 1
                if engine.stall_s:
                    time.sleep(engine.stall_s)
                text = engine.replies[min(index, len(engine.replies) - 1)]
                self._json(
                    200,
                    {
                        "id": f"chatcmpl-{index}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body.get("model", engine.model),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": engine.finish_reason,
                            }
                        ],
                        "usage": {
                            "prompt_tokens": 100 + index,
                            "completion_tokens": 10,
                            "total_tokens": 110 + index,
                        },
                    },
                )

            def _json(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def terminus_reply(keystrokes: str, *, task_complete: bool) -> str:
    """A terminus-2 JSON action: run `keystrokes`, optionally declaring the task complete."""
    return json.dumps(
        {
            "analysis": "scripted test reply",
            "plan": "run the command",
            "commands": [{"keystrokes": keystrokes, "duration": 0.2}] if keystrokes else [],
            "task_complete": task_complete,
        }
    )
