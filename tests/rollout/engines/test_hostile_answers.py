"""The SGLang client and the rollout against a hostile engine: answers a real HTTP server on
127.0.0.1 sends byte for byte (broken encodings, bombs, slow drips, escapes, values that break
the sample rules).

What is pinned: every such answer is an :class:`EngineError` naming the endpoint or the field and
the rule (never another exception); ``timeout_s`` bounds a whole exchange; a body is read up to
a cap; an error body reaches messages escaped and bounded; a result that breaks the sample rules
becomes a ``FAILED`` sample and the batch still returns; a base URL that is not
``http(s)://host[:port]`` is refused when the client is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.data import PromptRecord
from mizzen_rollout.engines import (
    EngineProtocolError,
    EngineRequestError,
    EngineTimeoutError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RetryPolicy,
    SGLangClient,
    protocol,
)
from mizzen_rollout.engines import client as client_module
from mizzen_rollout.rollout import RolloutConfig, run_rollout
from mizzen_rollout.samples import SampleStatus

register_cpu_ci(est_time=8, labels=["engine", "rollout"])

NO_RETRY = RetryPolicy(max_attempts=1)

GENERATE_ANSWER = {
    "text": "hi",
    "output_ids": [5, 6],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
    },
}
CHAT_ANSWER = {
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": {"content": [{"token": "h", "logprob": -0.1}]},
            "finish_reason": "stop",
            "token_ids": [4],
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}


class _HostileServer:
    """A real HTTP server: ``routes[path]`` is ``(status, body bytes, headers)`` or a callable
    writing the answer itself with the handler."""

    def __init__(self, routes):
        outer = self
        self.routes = routes
        self.paths: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer()

            def _answer(self):
                outer.paths.append(self.path)
                route = outer.routes.get(self.path, (200, b"{}", ()))
                if callable(route):
                    route(self)
                    return
                status, body, headers = route
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client stopped reading (a cap)
                    self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _json(value, status=200, headers=()):
    return (status, json.dumps(value).encode(), tuple(headers))


async def _call(url, method, *args, **client_kwargs):
    async with SGLangClient(url, retry=NO_RETRY, **client_kwargs) as client:
        return await getattr(client, method)(*args)


def _run(url, method, *args, **client_kwargs):
    return asyncio.run(_call(url, method, *args, **client_kwargs))


def _mutated(answer, mutate):
    answer = copy.deepcopy(answer)
    mutate(answer)
    return answer


# ------------------------------------------------------------ 1. values that break the sample rules
@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda a: a.update(output_ids=[5, -1]), "'output_ids[1]'"),
        (lambda a: a.update(output_ids=[5, 2**40]), "'output_ids[1]'"),
        (
            lambda a: a["meta_info"]["output_token_logprobs"].__setitem__(1, [-0.2, -6, None]),
            "'meta_info.output_token_logprobs[1][1]'",
        ),
        (
            lambda a: a["meta_info"]["output_token_logprobs"].__setitem__(0, [3.0, 5, None]),
            "'meta_info.output_token_logprobs[0][0]'",
        ),
        (
            lambda a: a["meta_info"]["output_token_logprobs"].__setitem__(0, [math.inf, 5, None]),
            "'meta_info.output_token_logprobs[0][0]'",
        ),
        (lambda a: a["meta_info"].update(completion_tokens=-2), "'meta_info.completion_tokens'"),
        (lambda a: a.update(text=["hi"]), "'text'"),
    ],
)
def test_generate_answer_breaking_sample_rules_names_the_field(mutate, field):
    with pytest.raises(EngineProtocolError) as info:
        protocol.parse_generate_response(
            _mutated(GENERATE_ANSWER, mutate), request_id="r", engine="http://e"
        )
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda c: c.update(token_ids=[-3]), "'choices[0].token_ids[0]'"),
        (lambda c: c.update(prompt_token_ids=[1, -1]), "'choices[0].prompt_token_ids[1]'"),
        (lambda c: c["logprobs"]["content"][0].update(logprob=2.0), "logprobs.content[0]"),
        (lambda c: c["message"].update(content=123), "'choices[0].message.content'"),
        (lambda c: c["message"].update(content={"text": "hi"}), "'choices[0].message.content'"),
    ],
)
def test_chat_answer_breaking_sample_rules_names_the_field(mutate, field):
    answer = _mutated(CHAT_ANSWER, lambda a: mutate(a["choices"][0]))
    with pytest.raises(EngineProtocolError) as info:
        protocol.parse_chat_response(answer, request_id="r", engine="http://e")
    assert field in str(info.value)


def test_tokenize_answer_with_a_negative_id_names_the_field():
    with pytest.raises(EngineProtocolError, match=r"tokens\[1\]' is -7; it must be an integer"):
        protocol.parse_tokenize_response({"tokens": [1, -7]}, engine="http://e")


def test_log_prob_rounding_noise_and_minus_infinity_are_read_not_refused():
    answer = _mutated(
        GENERATE_ANSWER,
        lambda a: a["meta_info"].update(
            output_token_logprobs=[[protocol.LOGPROB_ROUNDING / 2, 5, None], [-math.inf, 6, None]]
        ),
    )
    result = protocol.parse_generate_response(answer, request_id="r", engine="e")
    assert result.output_logprobs == (0.0, protocol.LOGPROB_FLOOR)
    chat = protocol.parse_chat_response(
        _mutated(CHAT_ANSWER, lambda a: a["choices"][0]["message"].update(content=None)),
        request_id="r",
        engine="e",
    )
    assert chat.text == ""


class _ResultDispatcher:
    """A dispatcher of the caller's own (rollout's ``Dispatcher`` protocol) handing back results
    the protocol layer never saw: the rollout must keep its invariant on them too."""

    def __init__(self, output_ids, logprobs):
        self.output_ids, self.logprobs = output_ids, logprobs

    async def generate(self, request):
        return GenerateResult(
            request_id=request.request_id,
            text="x",
            output_ids=tuple(self.output_ids),
            finish=FinishReason("stop"),
            prompt_tokens=1,
            completion_tokens=len(self.output_ids),
            output_logprobs=tuple(self.logprobs),
        )

    async def generate_batch(self, requests):
        return [await self.generate(r) for r in requests]

    async def chat(self, request):
        raise AssertionError("no chat prompts here")

    async def tokenize(self, text):
        return [1, 2]


@pytest.mark.parametrize(
    ("output_ids", "logprobs", "field"),
    [([5, -1], [-0.1, -0.2], "response_tokens[1]"), ([5], [0.5], "rollout_logprobs[0]")],
)
def test_a_result_breaking_sample_rules_fails_its_sample_not_the_batch(output_ids, logprobs, field):
    prompts = [PromptRecord(input="a", index=0), PromptRecord(input="b", index=1)]
    config = RolloutConfig(n_samples=2, batch_size=1)
    batch = asyncio.run(run_rollout(prompts, _ResultDispatcher(output_ids, logprobs), config))
    samples = batch.all_samples
    assert len(samples) == 4
    for sample in samples:
        assert sample.status is SampleStatus.FAILED
        assert field in sample.error and "sample rules" in sample.error
        assert sample.response_tokens == [] and sample.rollout_logprobs is None
        sample.validate()


def test_a_hostile_generate_answer_over_http_fails_samples_and_the_batch_returns():
    bad = _mutated(GENERATE_ANSWER, lambda a: a.update(output_ids=[5, -1]))
    routes = {"/generate": _json(bad), "/tokenize": _json({"tokens": [1, 2]})}
    prompts = [PromptRecord(input="a", index=0)]

    async def go(url):
        async with SGLangClient(url, retry=NO_RETRY) as client:
            return await run_rollout(prompts, client, RolloutConfig(n_samples=2))

    with _HostileServer(routes) as server:
        batch = asyncio.run(go(server.url))
    assert [s.status for s in batch.all_samples] == [SampleStatus.FAILED] * 2
    assert "'output_ids[1]'" in batch.all_samples[0].error


# ------------------------------------------------------------ 2. bodies that do not decode
@pytest.mark.parametrize(
    ("route", "rule"),
    [
        ((200, b'{"tokens": [1], "x": "\xff\xfe"}', ()), "is not UTF-8"),
        ((200, b"[" * 100_000 + b"]" * 100_000, ()), "nests too deep"),
        ((200, b'{"tokens": [1' + b"0" * 5000 + b"]}", ()), "is not JSON"),
        ((200, b"not gzip at all", (("Content-Encoding", "gzip"),)), "Content-Encoding"),
    ],
    ids=["not-utf8", "deep", "huge-int", "gzip-garbage"],
)
def test_a_body_that_does_not_decode_is_a_protocol_error_naming_the_endpoint(route, rule):
    with _HostileServer({"/tokenize": route}) as server, pytest.raises(EngineProtocolError) as info:
        _run(server.url, "tokenize", "hello")
    assert "/tokenize" in str(info.value) and rule in str(info.value)


class _RaisingTokenizer(_ResultDispatcher):
    async def tokenize(self, text):
        raise RuntimeError("a bug below the rollout")


def test_an_unexpected_tokenize_error_fails_the_group_not_the_batch():
    batch = asyncio.run(
        run_rollout(
            [PromptRecord(input="a", index=0)],
            _RaisingTokenizer([5], [-0.1]),
            RolloutConfig(n_samples=2),
        )
    )
    assert [s.status for s in batch.all_samples] == [SampleStatus.FAILED] * 2
    assert "unexpected RuntimeError: a bug below" in batch.all_samples[0].error


# ------------------------------------------------------------ 3. the deadline of one exchange
def _drip(handler):
    """200 with a valid answer, then one byte of padding every 0.2 s (3 s in all)."""
    body = json.dumps(GENERATE_ANSWER).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body) + 15))
    handler.end_headers()
    try:
        handler.wfile.write(body)
        handler.wfile.flush()
        for _ in range(15):
            time.sleep(0.2)
            handler.wfile.write(b" ")
            handler.wfile.flush()
    except OSError:  # the client gave up
        pass


def test_timeout_bounds_the_whole_exchange_not_each_read():
    with _HostileServer({"/generate": _drip}) as server:
        started = time.perf_counter()
        with pytest.raises(EngineTimeoutError, match=r"no answer within 0\.5 s"):
            _run(server.url, "generate", GenerateRequest("drip", text="x"), timeout_s=0.5)
        elapsed = time.perf_counter() - started
        assert "/abort_request" in server.paths  # the request was aborted on the server
    assert elapsed < 2.0


def _slow_answer(handler):
    """A valid answer after 0.6 s (a generation that takes its time)."""
    time.sleep(0.6)
    body = json.dumps(GENERATE_ANSWER).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_waiting_for_a_pooled_connection_is_not_counted_in_the_deadline():
    """Three requests on one connection, each answered in 0.6 s, deadline 1 s: the last waits
    1.2 s for the connection, and is not timed out for it (the wait is not the engine's)."""

    async def three(url):
        client = SGLangClient(url, timeout_s=1.0, retry=NO_RETRY, max_connections=1)
        try:
            requests = [GenerateRequest(f"q{i}", text="x") for i in range(3)]
            return await asyncio.gather(*(client.generate(r) for r in requests))
        finally:
            await client.aclose()

    with _HostileServer({"/generate": _slow_answer}) as server:
        results = asyncio.run(three(server.url))
    assert [r.finish.kind for r in results] == ["stop"] * 3
    assert "/abort_request" not in server.paths


def test_a_multi_token_stop_sequence_is_read_as_token_ids():
    answer = _mutated(GENERATE_ANSWER, lambda a: a["meta_info"].update(
        finish_reason={"type": "stop", "matched": [1, 2, 3]}))  # fmt: skip
    result = protocol.parse_generate_response(answer, request_id="r", engine="http://e")
    assert result.finish.matched == (1, 2, 3)


# ------------------------------------------------------------ 4. the size cap
def test_a_body_inflating_past_the_cap_is_refused_naming_the_limit():
    padded = json.dumps(GENERATE_ANSWER).encode() + b" " * (8 * 2**20)
    bomb = (200, gzip.compress(padded, 9), (("Content-Encoding", "gzip"),))
    with _HostileServer({"/generate": bomb}) as server:
        with pytest.raises(EngineProtocolError, match="max_response_bytes=1048576"):
            _run(
                server.url, "generate", GenerateRequest("bomb", text="x"), max_response_bytes=2**20
            )
        # within the cap the same answer is read
        result = _run(
            server.url, "generate", GenerateRequest("ok", text="x"), max_response_bytes=16 * 2**20
        )
    assert result.output_ids == (5, 6)


def test_a_plain_body_past_the_cap_is_refused_and_the_default_cap_is_documented():
    big = (200, b" " * (2 * 2**20) + b"{}", ())
    with (
        _HostileServer({"/generate": big}) as server,
        pytest.raises(EngineProtocolError, match="max_response_bytes=1048576"),
    ):
        _run(server.url, "generate", GenerateRequest("r", text="x"), max_response_bytes=2**20)
    assert client_module.MAX_RESPONSE_BYTES == 64 * 2**20


def test_an_error_body_is_kept_bounded():
    huge_error = (400, b"e" * (4 * 2**20), ())
    with (
        _HostileServer({"/generate": huge_error}) as server,
        pytest.raises(EngineRequestError) as info,
    ):
        _run(server.url, "generate", GenerateRequest("r", text="x"))
    assert len(info.value.body) < 4 * 2**20  # not the whole 4 MiB sent
    assert len(info.value.body) <= client_module.MAX_ERROR_BODY_BYTES
    assert len(str(info.value)) < 1000


# ------------------------------------------------------------ 5. malformed fields, named
@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (
            lambda a: a["meta_info"].update(finish_reason={"type": ["stop"]}),
            "'meta_info.finish_reason'",
        ),
        (
            lambda a: a["meta_info"].update(finish_reason={"type": {"stop": 1}}),
            "'meta_info.finish_reason'",
        ),
        (
            lambda a: a["meta_info"]["output_token_logprobs"].__setitem__(0, [10**400, 5, None]),
            "'meta_info.output_token_logprobs[0][0]'",
        ),
        (
            lambda a: a["meta_info"].update(finish_reason={"type": "stop", "matched": [2, "x"]}),
            "'meta_info.finish_reason.matched[1]'",
        ),
        (
            lambda a: a["meta_info"].update(finish_reason={"type": "abort", "message": [1]}),
            "'meta_info.finish_reason.message'",
        ),
    ],
)
def test_malformed_generate_fields_are_named_not_type_or_overflow_errors(mutate, field):
    with pytest.raises(EngineProtocolError) as info:
        protocol.parse_generate_response(
            _mutated(GENERATE_ANSWER, mutate), request_id="r", engine="http://e"
        )
    assert field in str(info.value)
    assert len(str(info.value)) < 400  # a 400-digit number is shown cut


@pytest.mark.parametrize("finish", [["stop"], {"stop": 1}])
def test_a_malformed_chat_finish_reason_is_named(finish):
    answer = _mutated(CHAT_ANSWER, lambda a: a["choices"][0].update(finish_reason=finish))
    with pytest.raises(EngineProtocolError, match=r"'choices\[0\]\.finish_reason'"):
        protocol.parse_chat_response(answer, request_id="r", engine="http://e")


# ------------------------------------------------------------ 6. escaped error bodies
ANSI_BODY = b"\x1b[2J\x1b[31mFAKE: all good\x1b[0m\r\nsecret\x07"


def test_an_error_body_reaches_the_message_escaped():
    with (
        _HostileServer({"/generate": (400, ANSI_BODY, ())}) as server,
        pytest.raises(EngineRequestError) as info,
    ):
        _run(server.url, "generate", GenerateRequest("r", text="x"))
    message = str(info.value)
    assert not any(c in message for c in "\x1b\r\n\x07")
    assert "\\x1b[2J" in message and "\\r\\n" in message
    assert info.value.body == ANSI_BODY.decode()  # the body itself is kept as it came


def test_the_cli_prints_an_engine_error_body_escaped(tmp_path, capfd):
    from mizzen_rollout.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1?"}\n')
    routes = {"/generate": (400, ANSI_BODY, ()), "/tokenize": _json({"tokens": [1, 2]})}
    with _HostileServer(routes) as server:
        code = main(
            ["generate", "--data", str(data), "--out", str(tmp_path / "out.jsonl"), "--n", "1",
             "--no-progress", "--no-chat-template", "--engine-url", server.url]
        )  # fmt: skip
    out, err = capfd.readouterr()
    assert code == 1 and "first error" in out
    assert "\x1b" not in out + err and "\\x1b[2J" in out
    assert (tmp_path / "out.jsonl").is_file()


# ------------------------------------------------------------ 9. the base URL rule
@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("localhost:1", "the scheme is not http or https"),
        ("127.0.0.1:1", "the scheme is not http or https"),
        ("ftp://127.0.0.1:1", "the scheme is not http or https"),
        ("http://:30000", "it has no host"),
        ("http://127.0.0.1:0", "port 0"),
        ("http://127.0.0.1:99999", "out of range"),
    ],
)
def test_a_base_url_that_is_not_http_host_port_is_refused_by_the_constructor(url, problem):
    with pytest.raises(ValueError) as info:
        SGLangClient(url)
    message = str(info.value)
    assert problem in message and "http(s)://host[:port]" in message and repr(url) in message


def test_good_base_urls_are_accepted():
    async def go():
        for url in ("http://127.0.0.1:30000", "https://engine.example:443/v1/", "http://h"):
            async with SGLangClient(url) as client:
                assert client.base_url == url.rstrip("/")

    asyncio.run(go())
