"""The SGLang client against the embedded server over real HTTP on 127.0.0.1.

Covers generate (text / ids), log-probs (checked against a teacher-forced forward pass of the
same model), chat, abort mid-generation, timeouts, retries on 5xx and connection errors, and no
retry on 4xx.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.engines import (
    ChatRequest,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    RetryPolicy,
    SamplingParams,
    SGLangClient,
    protocol,
)
from mizzen_rollout.engines.embedded.tokenizer import ByteTokenizer
from mizzen_rollout.engines.launcher import find_free_port

register_cpu_ci(est_time=40, labels=["engine", "rollout"])

FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.01, backoff_max_s=0.05)


def run(coro):
    return asyncio.run(coro)


async def _generate(url, request, **client_kwargs):
    async with SGLangClient(url, **client_kwargs) as client:
        return await client.generate(request)


def test_generate_text_and_input_ids_agree(embedded_server):
    sampling = SamplingParams(max_new_tokens=12, seed=5)

    async def go():
        async with SGLangClient(embedded_server.url) as client:
            assert await client.health()
            ids = await client.tokenize("The capital of France is")
            assert ids == ByteTokenizer().encode("The capital of France is")
            by_text = await client.generate(
                GenerateRequest("t1", text="The capital of France is", sampling=sampling)
            )
            by_ids = await client.generate(GenerateRequest("t2", input_ids=ids, sampling=sampling))
            return ids, by_text, by_ids

    ids, by_text, by_ids = run(go())
    assert by_text.output_ids == by_ids.output_ids  # same seed, same prompt tokens
    assert by_text.prompt_tokens == by_ids.prompt_tokens == len(ids)
    assert by_text.completion_tokens == len(by_text.output_ids) <= 12
    assert by_text.output_logprobs is None
    assert by_text.engine == embedded_server.url and by_text.latency_s > 0
    assert by_text.finish.kind in ("stop", "length")


def test_sampling_is_reproducible_per_request_id(embedded_server):
    sampling = SamplingParams(max_new_tokens=16, ignore_eos=True)

    async def go():
        async with SGLangClient(embedded_server.url) as client:
            a = await client.generate(GenerateRequest("same-id", text="hello", sampling=sampling))
            b = await client.generate(GenerateRequest("same-id", text="hello", sampling=sampling))
            c = await client.generate(GenerateRequest("other-id", text="hello", sampling=sampling))
            return a, b, c

    a, b, c = run(go())
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
    assert a.finish == FinishReason("length") and len(a.output_ids) == 16


def test_logprobs_match_a_teacher_forced_forward_pass(embedded_server):
    import torch

    from mizzen_rollout.engines.embedded.backend import TransformersBackend

    prompt = ByteTokenizer().encode("2 + 2 =")
    results = {}
    for temperature in (1.0, 0.7, 0.0):
        sampling = SamplingParams(max_new_tokens=10, temperature=temperature, ignore_eos=True)
        results[temperature] = run(
            _generate(
                embedded_server.url,
                GenerateRequest(
                    f"lp-{temperature}", input_ids=prompt, sampling=sampling, return_logprob=True
                ),
            )
        )
    backend = TransformersBackend(seed=0)  # the same seeded tiny model the server built
    for temperature, result in results.items():
        assert len(result.output_logprobs) == len(result.output_ids) == 10
        ids = torch.tensor([prompt + list(result.output_ids)])
        with torch.no_grad():
            logits = backend.model(ids).logits[0, len(prompt) - 1 : -1].float()
        scale = temperature if temperature > 0 else 1.0
        expected = torch.log_softmax(logits / scale, -1).gather(
            1, torch.tensor(result.output_ids).unsqueeze(1)
        )
        assert torch.allclose(torch.tensor(result.output_logprobs), expected.squeeze(1), atol=1e-4)
    greedy = results[0.0]
    assert all(lp <= 0 for lp in greedy.output_logprobs)


def test_stop_strings_end_generation_and_are_trimmed(embedded_server):
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    full = run(_generate(embedded_server.url, GenerateRequest("s1", text="abc", sampling=greedy)))
    stop = full.text[5:7]
    assert stop, full.text
    stopped = run(
        _generate(
            embedded_server.url,
            GenerateRequest(
                "s2",
                text="abc",
                sampling=SamplingParams(
                    max_new_tokens=24, temperature=0, ignore_eos=True, stop=[stop]
                ),
            ),
        )
    )
    assert stopped.finish == FinishReason("stop", matched=stop)
    assert stopped.text == full.text[: full.text.index(stop)]
    assert len(stopped.output_ids) < len(full.output_ids)


def test_chat_completions(embedded_server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    result = run(
        _chat(
            embedded_server.url,
            ChatRequest(
                "chat-1",
                messages=messages,
                sampling=SamplingParams(max_new_tokens=6),
                return_logprob=True,
            ),
        )
    )
    assert result.prompt_token_ids == tuple(ByteTokenizer().apply_chat_template(messages))
    assert result.prompt_tokens == len(result.prompt_token_ids)
    assert len(result.output_ids) == len(result.output_logprobs) == result.completion_tokens
    assert result.finish.kind in ("stop", "length")


async def _chat(url, request):
    async with SGLangClient(url) as client:
        return await client.chat(request)


def test_abort_mid_generation(embedded_server):
    long = SamplingParams(max_new_tokens=3000, ignore_eos=True)

    async def go():
        async with SGLangClient(embedded_server.url) as client:
            task = asyncio.create_task(
                client.generate(
                    GenerateRequest("to-abort", text="x", sampling=long, return_logprob=True)
                )
            )
            await asyncio.sleep(0.4)
            await client.abort("to-abort")
            return await task

    started = time.perf_counter()
    result = run(go())
    assert result.finish.kind == "abort"
    assert 0 < len(result.output_ids) < 3000
    assert len(result.output_logprobs) == len(result.output_ids)
    assert time.perf_counter() - started < 3.0  # 3000 tokens would take ~5 s


def test_timeout_raises_and_aborts_the_request_on_the_server(embedded_server):
    long = SamplingParams(max_new_tokens=3000, ignore_eos=True)
    with pytest.raises(EngineTimeoutError, match=r"no answer within 0\.3 s"):
        run(
            _generate(
                embedded_server.url, GenerateRequest("slow", text="x", sampling=long), timeout_s=0.3
            )
        )
    # The server aborted "slow": a new request gets the (serialised) model right away.
    started = time.perf_counter()
    quick = run(
        _generate(
            embedded_server.url,
            GenerateRequest("quick", text="x", sampling=SamplingParams(max_new_tokens=2)),
        )
    )
    assert quick.completion_tokens <= 2
    assert time.perf_counter() - started < 2.0


def test_unsupported_parameter_is_a_4xx_and_never_retried(embedded_server):
    sampling = SamplingParams(max_new_tokens=2, extra={"frequency_penalty": 0.5})

    async def go():
        async with SGLangClient(embedded_server.url, retry=FAST_RETRY) as client:
            with pytest.raises(EngineRequestError) as info:
                await client.generate(GenerateRequest("bad", text="x", sampling=sampling))
            return client.attempts, info.value

    attempts, error = run(go())
    assert attempts == 1
    assert error.status_code == 400
    assert "frequency_penalty=0.5 is not implemented" in str(error)


class _ScriptedServer:
    """A real HTTP server answering /generate with scripted statuses, then a valid answer."""

    def __init__(self, statuses, port=0):
        self.statuses = list(statuses)
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.hits += 1
                if outer.statuses:
                    status, answer = outer.statuses.pop(0), {"error": "scripted"}
                else:
                    status = 200
                    answer = protocol.build_generate_response(
                        request_id=body["rid"],
                        text="ok",
                        output_ids=[7],
                        finish=FinishReason("stop", matched=2),
                        prompt_tokens=1,
                        output_logprobs=None,
                        e2e_latency=0.0,
                    )
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retries_5xx_then_succeeds():
    server = _ScriptedServer([503, 500])
    try:
        result = run(_generate(server.url, GenerateRequest("r", text="x"), retry=FAST_RETRY))
    finally:
        server.close()
    assert server.hits == 3
    assert result.text == "ok" and result.output_ids == (7,)


def test_gives_up_after_bounded_5xx_retries():
    server = _ScriptedServer([502, 502, 502, 502])
    try:
        with pytest.raises(EngineUnavailableError, match="gave up after 3 attempt"):
            run(_generate(server.url, GenerateRequest("r", text="x"), retry=FAST_RETRY))
    finally:
        server.close()
    assert server.hits == 3


@pytest.mark.parametrize("status", [400, 404, 422])
def test_no_retry_on_4xx(status):
    server = _ScriptedServer([status])
    try:
        with pytest.raises(EngineRequestError) as info:
            run(_generate(server.url, GenerateRequest("r", text="x"), retry=FAST_RETRY))
    finally:
        server.close()
    assert server.hits == 1
    assert info.value.status_code == status


def test_connection_errors_are_retried_then_reported():
    url = f"http://127.0.0.1:{find_free_port()}"

    async def go():
        async with SGLangClient(url, retry=FAST_RETRY) as client:
            assert not await client.health()
            with pytest.raises(EngineUnavailableError, match="Check that the engine is running"):
                await client.generate(GenerateRequest("r", text="x"))
            return client.attempts

    assert run(go()) == FAST_RETRY.max_attempts


def test_connection_retry_reaches_a_server_that_comes_up_late():
    port = find_free_port()
    holder = {}

    def start_later():
        time.sleep(0.3)
        holder["server"] = _ScriptedServer([], port=port)

    threading.Thread(target=start_later, daemon=True).start()
    retry = RetryPolicy(max_attempts=8, backoff_s=0.1, backoff_max_s=0.4)
    try:
        result = run(
            _generate(f"http://127.0.0.1:{port}", GenerateRequest("late", text="x"), retry=retry)
        )
    finally:
        if "server" in holder:
            holder["server"].close()
    assert result.text == "ok"


def test_a_local_model_directory_works(tmp_path):
    """``--model PATH``: a Hugging Face model + tokenizer saved locally (no hub involved)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mizzen_rollout.engines.embedded.backend import TransformersBackend, load_tiny_config
    from mizzen_rollout.engines.embedded.tokenizer import TokenizerError

    words = ["<unk>", "<s>", "</s>", "a", "b", "c", "d", "e"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    hf_tok.save_pretrained(tmp_path)
    config = {k: v for k, v in load_tiny_config().items() if k != "model_type"}
    config.update(vocab_size=len(words), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path)

    backend = TransformersBackend(model_path=str(tmp_path))
    assert str(tmp_path) in backend.description
    prompt = backend.tokenizer.encode("a b c")
    assert prompt == [3, 4, 5]
    gen = backend.generate(
        prompt,
        SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
        request_id="local",
        return_logprob=True,
        should_abort=lambda: False,
    )
    assert len(gen.output_ids) == len(gen.logprobs) == 6
    assert all(0 <= t < len(words) for t in gen.output_ids)
    assert gen.finish == FinishReason("length")
    with pytest.raises(TokenizerError, match="no chat template"):
        backend.tokenizer.apply_chat_template([{"role": "user", "content": "a"}])
