"""``/update_weights_from_disk`` on the embedded engine over real HTTP: the server switches to
another model directory of the same architecture and generates what transformers generates on it;
a directory it cannot load is refused with the reason and the old model keeps serving; the echo
backend has no weights to update."""

from __future__ import annotations

import asyncio

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.engines import (
    EngineRequestError,
    GenerateRequest,
    SamplingParams,
    SGLangClient,
    protocol,
)
from mizzen_rollout.engines.embedded import schema
from mizzen_rollout.engines.launcher import embedded_server

register_cpu_ci(est_time=25, labels=["engine", "rollout"])

PROMPT = "Colour of lime?"


def _model_dir(path, seed: int):
    import torch
    import transformers

    from mizzen_rollout.engines.embedded.backend import load_tiny_config
    from mizzen_rollout.engines.embedded.tokenizer import hf_byte_tokenizer

    config = {**load_tiny_config(), "initializer_range": 0.2}  # distinct greedy answers per seed
    model_type = config.pop("model_type")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config)
    )
    model.save_pretrained(str(path))
    tokenizer = hf_byte_tokenizer()
    tokenizer.save_pretrained(str(path))
    ids = tokenizer(PROMPT)["input_ids"]
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=[], pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


async def _generate(client: SGLangClient, rid: str) -> list[int]:
    ids = await client.tokenize(PROMPT)
    result = await client.generate(
        GenerateRequest(
            request_id=rid,
            input_ids=ids,
            sampling=SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
        )
    )
    return list(result.output_ids)


def test_server_switches_model_directories(tmp_path):
    first = _model_dir(tmp_path / "a", seed=1)
    second = _model_dir(tmp_path / "b", seed=2)
    assert first != second

    async def scenario(url):
        async with SGLangClient(url) as client:
            before = await _generate(client, "w1")
            message = await client.update_weights_from_disk(str(tmp_path / "b"))
            after = await _generate(client, "w2")
            with pytest.raises(EngineRequestError, match=r"loading .*nowhere failed"):
                await client.update_weights_from_disk(str(tmp_path / "nowhere"))
            still = await _generate(client, "w3")
            return before, message, after, still

    with embedded_server(model_path=str(tmp_path / "a")) as server:
        before, message, after, still = asyncio.run(scenario(server.url))
    assert before == first
    assert message == f"serving {tmp_path / 'b'}"
    assert after == second and still == second


def test_echo_backend_refuses_and_requests_are_validated(echo_servers):
    async def scenario(url):
        async with SGLangClient(url) as client:
            with pytest.raises(EngineRequestError, match="no weights to update"):
                await client.update_weights_from_disk("/tmp")

    asyncio.run(scenario(echo_servers[0].url))

    def parse(body):
        return schema.validate("UpdateWeightFromDiskReqInput", body, "update").model_path

    with pytest.raises(schema.RequestRefused, match="field 'load_format': Input should be 'auto'"):
        parse({"model_path": "/m", "load_format": "dummy"})
    with pytest.raises(schema.RequestRefused, match="field 'flush': Extra inputs"):
        parse({"model_path": "/m", "flush": True})
    assert parse({"model_path": "/m", "weight_version": "3"}) == "/m"
    assert protocol.parse_update_weights_response(
        {"success": False, "message": "no"}, engine="e"
    ) == (False, "no")
