"""The HTTP server's connections: a deadline for each request head, a cap on open connections,
accept errors logged at most once an interval, all set up by :func:`http_server`.

uvicorn's h11 protocol is pinned (the class is passed, so an installed httptools never replaces
it) and :class:`BoundedH11Protocol` adds the limits to it:

- A connection that has not delivered a complete request head ``server.head_timeout_s`` after it
  opened, or after its previous response completed, is closed.  A request whose head has arrived
  is never cut by it (a slow body has ``server.body_timeout_s``, see :mod:`.app`).
- At most ``server.max_connections`` are open: one beyond is answered 503 and closed as soon as
  it is accepted, before anything of it is read.  The cap is kept below the process's descriptor
  limit (:func:`fit_descriptor_limit`), so accepting never runs out of descriptors because of
  connections alone.
- ``accept()`` failing for want of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM; asyncio reports
  it once per waiting connection) is one log line per :data:`ACCEPT_LOG_INTERVAL_S` with the
  count (:class:`AcceptErrorLog`); every other loop error goes to asyncio's own handler.

Relies on uvicorn's ``H11Protocol`` internals (``connection_made``, ``on_response_complete``,
``connection_lost``, a new ``cycle`` object per request head, ``connections``, ``transport``,
``loop``); tests/train/serve/test_serve_connections.py pins them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "ACCEPT_LOG_INTERVAL_S",
    "AcceptErrorLog",
    "BoundedH11Protocol",
    "bounded_protocol",
    "fit_descriptor_limit",
    "http_server",
]

log = logging.getLogger("mizzen_train.serve")
ACCEPT_LOG_INTERVAL_S = 10.0
#: descriptors kept for everything but client connections (model files, the engine, logs)
RESERVED_DESCRIPTORS = 256
RESOURCE_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_BUSY_TEXT = b"the server's connection limit is reached; retry later"
BUSY = b"HTTP/1.1 503 Service Unavailable\r\n%s\r\n\r\n%s" % (
    b"\r\n".join((b"content-type: text/plain", b"connection: close",
                  b"content-length: %d" % len(_BUSY_TEXT))),
    _BUSY_TEXT,
)  # fmt: skip


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap (class
    attributes, set by :func:`bounded_protocol`)."""

    head_timeout_s: float = 10.0
    max_connections: int = 1000
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(BUSY)
            transport.close()
            return
        self._await_head()

    def on_response_complete(self) -> None:
        self._await_head()  # first: a pipelined head handled below counts as delivered
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        """Close the connection unless a request head (a new ``cycle``) arrives in time."""
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_due, self.cycle)

    def _head_due(self, waited_since) -> None:
        if self.cycle is waited_since and not self.transport.is_closing():
            self.transport.close()


def bounded_protocol(head_timeout_s: float, max_connections: int) -> type[BoundedH11Protocol]:
    """A :class:`BoundedH11Protocol` class with these limits (uvicorn takes a class)."""
    limits = {"head_timeout_s": head_timeout_s, "max_connections": max_connections}
    return type("BoundedH11Protocol", (BoundedH11Protocol,), limits)


class AcceptErrorLog:
    """An asyncio exception handler: resource errors of ``accept()`` as one line an interval."""

    def __init__(self, interval_s: float = ACCEPT_LOG_INTERVAL_S, clock=time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.count, self.last = 0, -float("inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if not isinstance(exc, OSError) or exc.errno not in RESOURCE_ERRNOS:
            loop.default_exception_handler(context)
            return
        self.count += 1
        if self.clock() - self.last >= self.interval_s:
            log.error(
                "cannot accept connections: %s (%d times since the last such line). Fix: lower "
                "server.max_connections or raise the descriptor limit (ulimit -n)",
                exc.strerror, self.count,
            )  # fmt: skip
            self.count, self.last = 0, self.clock()


def fit_descriptor_limit(max_connections: int) -> None:
    """Raise the soft descriptor limit to hold ``max_connections`` and the reserve; ValueError
    (the rule) when the hard limit cannot."""
    need = max_connections + RESERVED_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(
                f"needs {need} descriptors ({RESERVED_DESCRIPTORS} besides connections), the "
                f"process may open {hard}"
            )
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        except (ValueError, OSError) as exc:
            raise ValueError(
                f"needs {need} descriptors, the process may not open them ({exc})"
            ) from None


def http_server(app, server) -> uvicorn.Server:
    """The uvicorn server of ``app`` under the limits of the ``[server]`` section ``server``;
    serve it from a loop that has :class:`AcceptErrorLog` as its exception handler."""
    return uvicorn.Server(uvicorn.Config(
        app, http=bounded_protocol(server.head_timeout_s, server.max_connections), ws="none",
        lifespan="off", log_level="warning", access_log=False, server_header=False,
        timeout_graceful_shutdown=2,
    ))  # fmt: skip
