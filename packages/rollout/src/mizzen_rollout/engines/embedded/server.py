"""The embedded engine server (``mizzen-rollout serve``): the ASGI app of :mod:`.app` on uvicorn.

Invariants:
- HTTP/1.1 is uvicorn's with h11: ``Content-Length`` and chunked framing, keep-alive and
  pipelining are parsed by a maintained library (a malformed head is a 400 and a closed
  connection; a chunked body is one body, never a second request).  On top of it every request
  head must arrive within ``Limits.read_timeout_s`` (a connection that stalls mid-head is closed),
  idle keep-alive connections close after ``Limits.keep_alive_s``, and the body is bounded by
  :mod:`.body` (size and deadline).
- The server listens only after the backend is loaded, so ``/health`` answering 200 means ready.
  The port is bound first (:func:`bind_socket`), so a busy or impossible port is reported before
  the slow model load.  With ``port=0`` the kernel picks it; ``port_file`` receives the URL
  (written atomically) once the socket is bound.
- Weights and adapters load only from under the load directories (:func:`default_load_dirs`:
  the directory holding ``--model``, unless ``--load-dir`` names others).
- With ``parent_pid`` set, the server exits when that process is gone (no orphans when an engine
  worker is killed); ``mizzen-rollout serve`` starts watching before the backend loads.
- uvicorn (and, through :mod:`.app`, starlette and pydantic) is imported inside :func:`serve`:
  this module imports on a base install.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .backend import Backend
from .body import Limits

__all__ = ["ServeError", "bind_socket", "default_load_dirs", "serve", "watch_parent"]


class ServeError(ValueError):
    """The server cannot start as asked (the message says what to change)."""


def default_load_dirs(model_path: str | None, load_dirs: Sequence[str] = ()) -> list[str]:
    """Where weights and adapters may be loaded from: ``load_dirs`` if given, else the directory
    that holds ``model_path`` (checkpoints and adapters written beside the served model), else
    none (every load is refused, naming ``--load-dir``)."""
    if load_dirs:
        return [str(Path(d).resolve()) for d in load_dirs]
    if model_path is not None:
        return [str(Path(model_path).resolve().parent)]
    return []


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), or :class:`ServeError`."""
    if not 0 <= port <= 65535:
        raise ServeError(f"--port {port} is not a TCP port; use 0..65535 (0: the kernel picks one)")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ServeError(
            f"--host {host!r} does not resolve ({exc}); use an address such as 127.0.0.1"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); the port is busy or not "
            "yours: pick another --port, or --port 0 to let the kernel choose"
        ) from None
    return sock


def _client_url(sock: socket.socket) -> str:
    """The URL a local client should use (a wildcard bind is reached on 127.0.0.1)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


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


def _protocol_class(limits: Limits) -> type:
    """uvicorn's h11 protocol with a deadline on every request head (see the module docstring)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadlineH11Protocol(H11Protocol):
        _head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(limits.read_timeout_s, self._head_expired)

        def _disarm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadlineH11Protocol


def serve(
    backend: Backend,
    *,
    sock: socket.socket,
    port_file: str | None = None,  # receives the URL once bound
    parent_pid: int | None = None,
    verbose: bool = False,
    load_dirs: Sequence[str] = (),
    limits: Limits | None = None,
) -> None:
    """Serve ``backend`` on the bound socket ``sock`` until interrupted (blocks)."""
    import uvicorn

    from .app import LoadDirs, build_app

    limits = limits or Limits()
    app = build_app(backend, load_dirs=LoadDirs(load_dirs), limits=limits)
    config = uvicorn.Config(
        app,
        http=_protocol_class(limits),
        ws="none",
        lifespan="off",
        timeout_keep_alive=int(max(1, limits.keep_alive_s)),
        timeout_graceful_shutdown=2,
        backlog=2048,
        log_level="info" if verbose else "warning",
        access_log=verbose,
        server_header=False,
    )
    if parent_pid is not None:
        watch_parent(parent_pid)
    url = _client_url(sock)
    if port_file:
        _write_url_file(port_file, url)
    print(f"mizzen-rollout serve: listening on {url} ({backend.description})", flush=True)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
