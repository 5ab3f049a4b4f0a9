"""The embedded engine's HTTP boundary, case by case (issue 31's probe of the engine), over real
HTTP on 127.0.0.1 against the tiny-model server (``limited_server``: read timeout 2 s).

Framing (raw sockets): ``Content-Length: -1`` and ``zz`` are answered 400 (no hang, no dropped
connection without an answer), a chunked body is one request, a 64 MiB body (declared or chunked)
is refused with 413 at once, a stalled body is answered 408 within the read timeout.  Values:
NaN temperature, ``min_p`` 2, ``top_k`` 2.5, ``sampling_seed`` 2**80, ``stop`` an object,
``stop_token_ids`` strings, ``max_new_tokens`` 2.5 and true, 100,000-deep JSON, bytes that are not
UTF-8 and a lone surrogate are each a 400 naming the field or the problem.  Paths: weights and
adapters outside the load directory get one 403 whether or not the path exists.  CLI: ``serve``
with an impossible port, a busy port or a missing model directory is one line on stderr, exit 2.
After all of it, a good ``/generate`` is answered.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=25, labels=["engine", "rollout"])

GOOD = {"text": "hello", "sampling_params": {"max_new_tokens": 2}, "rid": "good"}


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def exchange(url: str, data: bytes, *, wait_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``wait_s``)."""
    with socket.create_connection(_address(url), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


def head(length: str, extra: str = "") -> bytes:
    return (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


@pytest.mark.parametrize("length", ["-1", "zz"])
def test_a_bad_content_length_is_answered_400(limited_server, length):
    start = time.monotonic()
    answer = exchange(limited_server.url, head(length, "Connection: close\r\n") + b"{}")
    assert status_of(answer) == 400 and time.monotonic() - start < 5


def test_a_chunked_body_is_one_request(limited_server):
    body = json.dumps(GOOD).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:]))
    data = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n" + chunked + b"0\r\n\r\n"
    )
    answer = exchange(limited_server.url, data)
    assert status_of(answer) == 200 and answer.count(b"HTTP/1.1 ") == 1
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["meta_info"]["id"] == "good"


def _send_big(url: str, first: bytes, chunk: bytes, times: int) -> tuple[bytes, float]:
    """Send ``first``, then ``chunk`` up to ``times`` while the server reads; the answer."""
    start = time.monotonic()
    with socket.create_connection(_address(url), timeout=10) as sock:
        sock.sendall(first)
        try:
            for _ in range(times):
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered and closed: the rest is never read
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except OSError:
            pass
    return answer, time.monotonic() - start


def test_a_64_mib_body_is_refused_fast(limited_server):
    size = 64 * 2**20
    answer, elapsed = _send_big(limited_server.url, head(str(size)), b"x" * 2**20, 64)
    assert status_of(answer) == 413 and elapsed < 10
    # the server closes with the client's bytes unread, so the kernel may reset the connection
    # before the client reads the body (a race in TCP, not the server): judge a body that came
    body = answer.partition(b"\r\n\r\n")[2]
    assert not body or b"byte limit" in body, answer
    chunk = b"x" * 2**20
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    answer, elapsed = _send_big(
        limited_server.url,
        b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        framed,
        64,
    )
    assert status_of(answer) == 413 and elapsed < 10


def test_a_stalled_body_is_answered_within_the_read_timeout(limited_server):
    start = time.monotonic()
    answer = exchange(limited_server.url, head("100") + b'{"text": ', wait_s=15)
    elapsed = time.monotonic() - start
    assert status_of(answer) == 408 and elapsed < limited_server.read_timeout_s + 3
    start = time.monotonic()  # a stalled head: the connection is closed
    assert exchange(limited_server.url, b"POST /generate HTTP/1.1\r\nHost:", wait_s=15) == b""
    assert time.monotonic() - start < limited_server.read_timeout_s + 3


def _post(url: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{url}/generate", content=content, timeout=30)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ('{"temperature": NaN}', "sampling_params.temperature"),
        ('{"min_p": 2}', "sampling_params.min_p"),
        ('{"top_k": 2.5}', "sampling_params.top_k"),
        (f'{{"sampling_seed": {2**80}}}', "sampling_params.sampling_seed"),
        ('{"stop": {"a": 1}}', "sampling_params.stop"),
        ('{"stop_token_ids": ["1", "2"]}', "sampling_params.stop_token_ids[0]"),
        ('{"max_new_tokens": 2.5}', "sampling_params.max_new_tokens"),
        ('{"max_new_tokens": true}', "sampling_params.max_new_tokens"),
    ],
)
def test_bad_sampling_values_are_400_naming_the_field(limited_server, sampling, field):
    answer = _post(limited_server.url, b'{"text": "x", "sampling_params": %s}' % sampling.encode())
    assert answer.status_code == 400, answer.text
    assert f"field '{field}'" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64"),
        (b'{"text": "caf\xe9"}', "not UTF-8 (byte 13"),
        (b'{"text": "\\ud800"}', "field 'text' holds a lone surrogate"),
        (b'{"text": "x", "sampling_params": {"max_new_tokens": 1' + b"0" * 5000 + b"}}", "JSON"),
    ],
)
def test_undecodable_bodies_are_400(limited_server, content, message):
    answer = _post(limited_server.url, content)
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "field"),
    [("/update_weights_from_disk", "model_path"), ("/load_lora_adapter", "lora_path")],
)
def test_paths_outside_the_load_dir_get_one_answer_whatever_exists(limited_server, path, field):
    def ask(where):
        body = {"model_path": str(where)} if field == "model_path" else {
            "lora_name": "x", "lora_path": str(where)}  # fmt: skip
        answer = httpx.post(f"{limited_server.url}{path}", json=body, timeout=30)
        return answer.status_code, answer.json()["error"]["message"].replace(str(where), "P")

    existing, missing = limited_server.outside, limited_server.outside / "nothing-here"
    escaping = limited_server.loadable / ".." / "outside"
    answers = {ask(existing), ask(missing), ask(escaping), ask("/etc"), ask("relative/dir")}
    assert len(answers) == 1
    status, message = answers.pop()
    assert status == 403 and f"'{field}' 'P' is not under a directory" in message
    inside = httpx.post(
        f"{limited_server.url}/update_weights_from_disk",
        json={"model_path": str(limited_server.loadable / "none")},
        timeout=60,
    )
    assert inside.status_code == 400 and "loading" in inside.json()["message"]  # it was tried


def test_a_good_generate_is_answered_after_everything(limited_server):
    answer = httpx.post(f"{limited_server.url}/generate", json=GOOD, timeout=30)
    assert answer.status_code == 200 and answer.json()["meta_info"]["id"] == "good"
    assert httpx.get(f"{limited_server.url}/health_generate", timeout=30).status_code == 200


def _serve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mizzen_rollout", "serve", "--backend", "echo", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def _busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "99999"], "--port 99999 is not a TCP port; use 0..65535"),
        (["--port", "BUSY"], "the port is busy or not yours: pick another --port"),
        (["--model", "/no/such/model"], "--model /no/such/model: no such directory"),
    ],
)
def test_serve_refuses_in_one_line_with_exit_2(args, message):
    busy = _busy_port()
    try:
        port = str(busy.getsockname()[1])
        proc = _serve(*[port if a == "BUSY" else a for a in args])
    finally:
        busy.close()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


def test_parallel_requests_still_generate(limited_server):
    """The worker threads answer concurrent requests (one of them a slow stalled body)."""
    stalled = threading.Thread(
        target=exchange, args=(limited_server.url, head("50") + b"{"), kwargs={"wait_s": 10}
    )
    stalled.start()
    with httpx.Client(base_url=limited_server.url, timeout=30) as client:
        for i in range(5):
            answer = client.post("/generate", json={**GOOD, "rid": f"p{i}"})
            assert answer.status_code == 200
    stalled.join()
