"""The HTTP server's connection limits (:mod:`mizzen_train.serve.connections`), on real sockets.

A connection that never delivers a whole request head is closed at ``server.head_timeout_s``
(after it opened, or after its last response); one beyond ``server.max_connections`` is answered
503 and closed at once; a keep-alive client and a slow body are not cut; ``accept()`` running
out of descriptors is one log line, not one traceback per waiting connection.  The same limits
are checked on the real server (``serve_kit``) and on a bare uvicorn app (fast; it pins the
uvicorn internals the protocol subclass relies on).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=150, labels=["train"])

HEAD_TIMEOUT_S = 2.0
CAP = 16
MARGIN_S = 10.0  # a busy two-core box: the deadline plus this, never less than the deadline
HEALTHZ = b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n"


SERVE_OVERRIDES = (f"server.head_timeout_s={HEAD_TIMEOUT_S}", f"server.max_connections={CAP}")


@pytest.fixture(scope="module")
def kit(serve_kit):
    return serve_kit


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def read_until_closed(sock: socket.socket, deadline: float) -> bytes | None:
    """What ``sock`` receives until the peer closes it (None: still open at ``deadline``)."""
    received = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        except TimeoutError:
            return None
        if not chunk:
            return received
        received += chunk


def read_response(sock: socket.socket) -> bytes:
    """One whole response of a keep-alive connection (headers and a content-length body)."""
    sock.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return head


def check_heads_are_due(host: str, port: int, head_timeout_s: float) -> None:
    """An idle connection, half a head, and half a head after a response: all three closed by
    the server within the deadline (plus the margin), none of them answered."""
    idle = socket.create_connection((host, port))
    half = socket.create_connection((host, port))
    half.sendall(HEALTHZ[:30])
    after = socket.create_connection((host, port))
    after.sendall(HEALTHZ)
    assert b" 200 " in read_response(after).split(b"\r\n")[0]
    after.sendall(HEALTHZ[:30])
    deadline = time.monotonic() + head_timeout_s + MARGIN_S
    for name, sock in (("idle", idle), ("half a head", half), ("after a response", after)):
        with sock:
            assert read_until_closed(sock, deadline) == b"", f"{name}: not closed in time"


def check_cap(host: str, port: int, cap: int, extra: int = 4) -> None:
    """``cap + extra`` idle connections: the last ``extra`` are answered 503 and closed, the
    first ``cap`` are not (they wait for their head, at most until the deadline); once they are
    closed, healthz answers."""
    held = [socket.create_connection((host, port)) for _ in range(cap + extra)]
    try:
        deadline = time.monotonic() + MARGIN_S
        for sock in held[cap:]:
            received = read_until_closed(sock, deadline)
            assert received is not None, "a connection beyond the cap is still open"
            assert received.startswith(b"HTTP/1.1 503 "), received[:80]
        for sock in held[:cap]:  # still open, or closed by the head deadline: never refused
            assert not read_until_closed(sock, time.monotonic()), "refused within the cap"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + MARGIN_S
    while True:
        status = httpx.get(f"http://{host}:{port}/api/v1/healthz", timeout=30).status_code
        if status == 200 or time.monotonic() > deadline:
            break
    assert status == 200


def check_keep_alive_and_slow_body(
    host: str, port: int, head_timeout_s: float, path: str, header: str = ""
) -> None:
    """One keep-alive connection making requests for twice the deadline stays one connection;
    a body trickled in over 1.5 deadlines (its head came whole) is answered, not cut."""
    ports = set()
    with httpx.Client(base_url=f"http://{host}:{port}", timeout=30) as client:
        until = time.monotonic() + 2 * head_timeout_s
        while time.monotonic() < until:
            response = client.get("/api/v1/healthz")
            assert response.status_code == 200
            ports.add(response.extensions["network_stream"].get_extra_info("client_addr")[1])
            time.sleep(head_timeout_s / 4)  # pacing the client, not an assertion
    assert len(ports) == 1, f"the keep-alive connection was cut: {len(ports)} connections"
    body = b'{"request_id": "none"}'
    with socket.create_connection((host, port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{header}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        for byte in body:
            time.sleep(1.5 * head_timeout_s / len(body))  # a slow client, not an assertion
            sock.sendall(bytes([byte]))
        assert read_response(sock).startswith(b"HTTP/1.1 ")


def test_a_connection_without_a_whole_request_head_is_closed_at_the_deadline(kit):
    check_heads_are_due(*address(kit.url), HEAD_TIMEOUT_S)


def test_connections_beyond_the_cap_are_closed_at_once_and_healthz_answers(kit):
    check_cap(*address(kit.url), CAP)
    assert "Too many open files" not in kit.log() and "Traceback" not in kit.log()


def test_a_keep_alive_client_and_a_slow_body_are_not_cut(kit):
    key = kit.headers("alice")["X-API-Key"]
    check_keep_alive_and_slow_body(
        *address(kit.url), HEAD_TIMEOUT_S, "/api/v1/retrieve_future", f"X-API-Key: {key}\r\n"
    )


# -- the same limits on a bare uvicorn app: pins the uvicorn internals they rely on -----------


async def plain_app(scope, receive, send) -> None:
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    body = json.dumps({"ok": True}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def bare_server():
    """``http_server`` serving :func:`plain_app` on 127.0.0.1 in a thread: (host, port)."""
    from types import SimpleNamespace

    from mizzen_train.serve.connections import http_server

    limits = SimpleNamespace(head_timeout_s=0.5, max_connections=4)
    server = http_server(plain_app, limits)
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_uvicorn_internals_the_protocol_relies_on():
    """The protocol subclass overrides these methods and reads these attributes; a new cycle
    object per request head is what tells it a head arrived; the config takes the class."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

    from mizzen_train.serve.connections import bounded_protocol

    for method in ("connection_made", "on_response_complete", "connection_lost", "handle_events"):
        assert method in vars(H11Protocol), method
    protocol_class = bounded_protocol(1.0, 2)
    config = uvicorn.Config(plain_app, http=protocol_class, ws="none", lifespan="off")
    config.load()
    assert config.http_protocol_class is protocol_class

    class Transport(asyncio.Transport):  # records what the protocol does with the connection
        def __init__(self):
            super().__init__()
            self.closed, self.written = False, b""

        def get_extra_info(self, name, default=None):
            return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name)

        def write(self, data):
            self.written += data

        def close(self):
            self.closed = True

        def is_closing(self):
            return self.closed

    async def drive():
        state = uvicorn.server.ServerState()
        protocol = protocol_class(config=config, server_state=state, app_state={})
        protocol.connection_made(Transport())
        assert protocol in state.connections and protocol.cycle is None
        protocol.data_received(HEALTHZ[:30])
        assert protocol.cycle is None  # half a head: no cycle yet
        protocol.data_received(HEALTHZ[30:])
        assert isinstance(protocol.cycle, RequestResponseCycle)
        first = protocol.cycle
        await asyncio.wait_for(asyncio.gather(*state.tasks), 10)
        assert first.response_complete and protocol.cycle is first
        protocol.data_received(HEALTHZ)
        assert protocol.cycle is not first
        await asyncio.wait_for(asyncio.gather(*state.tasks), 10)
        protocol.connection_lost(None)
        assert protocol not in state.connections

    asyncio.run(drive())


def test_bare_uvicorn_heads_are_due(bare_server):
    check_heads_are_due(*bare_server, 0.5)


def test_bare_uvicorn_cap(bare_server):
    check_cap(*bare_server, 4)


def test_bare_uvicorn_keep_alive_and_slow_body(bare_server):
    check_keep_alive_and_slow_body(*bare_server, 0.5, "/anything")


ACCEPT_SERVER = textwrap.dedent(
    """
    import asyncio, logging, resource, sys
    from mizzen_train.serve.connections import AcceptErrorLog

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    calls = 0

    async def main():
        log = AcceptErrorLog(interval_s=60.0)
        done = asyncio.Event()

        def handler(loop, context):
            global calls
            calls += 1
            log(loop, context)
            if calls >= 200:
                done.set()

        loop = asyncio.get_running_loop()
        loop.set_exception_handler(handler)
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0, backlog=100)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, hard))
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.wait_for(done.wait(), 60)
        print("calls", calls, flush=True)

    asyncio.run(main())
    """
)


def test_accept_running_out_of_descriptors_is_one_log_line_not_a_flood(tmp_path):
    """A server process allowed 32 descriptors, 80 connections waiting: asyncio reports the
    failed accept() hundreds of times; the log holds one line with the count."""
    script = tmp_path / "accept_server.py"
    script.write_text(ACCEPT_SERVER)
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    clients = []
    try:
        port = int(process.stdout.readline())
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
        for sock in clients:
            sock.close()
    assert process.returncode == 0, err[-2000:]
    assert int(out.split()[-1]) >= 200, out  # asyncio's reports of the failed accept()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-2000:]
    assert "cannot accept connections" in lines[0] and "Fix:" in lines[0]
