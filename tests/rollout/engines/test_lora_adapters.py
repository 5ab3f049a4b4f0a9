"""LoRA adapters on the embedded engine over real HTTP, driven by the SGLang client.

Adapters are made by the real ``peft`` package (``save_pretrained`` of a LoRA with non-zero
factors) on the tiny Llama.  The embedded server loads them by name from their directory
(SGLang's ``/load_lora_adapter``), routes a request to one by ``lora_path`` on ``/generate`` or
by ``model = "<base>:<name>"`` on ``/v1/chat/completions`` -- each generating exactly what
peft's model generates -- serves the base model to requests without one, refuses a name twice,
an unknown name and a broken directory with SGLang's 400 answer, and unloads.  The request and
answer shapes are pinned to SGLang's documented fields (the fixtures below), on the client side
and on the server side alike.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.engines import (
    ChatRequest,
    EngineRequestError,
    GenerateRequest,
    SamplingParams,
    SGLangClient,
    protocol,
)
from mizzen_rollout.engines.embedded import schema
from mizzen_rollout.engines.embedded.app import chat_request
from mizzen_rollout.engines.launcher import embedded_server

register_cpu_ci(est_time=25, labels=["engine", "rollout", "lora"])

# io_struct.py: LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput (lora_id is filled in by
# SGLang's tokenizer manager, never by a client) and the LoRAUpdateOutput both answer with.
SGLANG_LOAD_LORA_FIELDS = {"lora_name", "lora_path", "pinned", "lora_id"}
SGLANG_UNLOAD_LORA_FIELDS = {"lora_name", "lora_id"}
SGLANG_LORA_UPDATE_OUTPUT_FIELDS = {
    "success", "error_message", "loaded_adapters", "rid", "http_worker_ipc",
}  # fmt: skip
# The answer of docs/advanced_features/lora.md (dynamic loading), verbatim in shape.
SGLANG_LOAD_ANSWER = {
    "rid": None,
    "http_worker_ipc": None,
    "success": True,
    "error_message": "",
    "loaded_adapters": {"lora0": "Nutanix/Meta-Llama-3.1-8B-Instruct_SFT_lora_4_alpha_16"},
}
# A newer SGLang serialises a loaded adapter as its LoRARef.
SGLANG_LOAD_ANSWER_REFS = {
    "success": True,
    "error_message": None,
    "loaded_adapters": {
        "lora0": {"lora_id": "ab12", "lora_name": "lora0", "lora_path": "/a/b", "pinned": False}
    },
}
PROMPT = "Tell me a colour:"
SAMPLING = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _peft_adapter(base_dir, target, *, seed: int, modules):
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=modules, init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    with torch.no_grad():  # large factors: the greedy answer must change
        for name, param in lora.named_parameters():
            if "lora_" in name:
                param.mul_(8.0)
    lora.save_pretrained(str(target))
    lora.eval()
    return lora


def _greedy(model, ids) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False,
            eos_token_id=[], pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    import torch
    import transformers

    from mizzen_rollout.engines.embedded.backend import load_tiny_config
    from mizzen_rollout.engines.embedded.tokenizer import hf_byte_tokenizer

    root = tmp_path_factory.mktemp("lora")
    config = {**load_tiny_config(), "initializer_range": 0.1}
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config)
    )
    base.save_pretrained(str(root / "base"))
    tokenizer = hf_byte_tokenizer()
    tokenizer.save_pretrained(str(root / "base"))
    ids = tokenizer(PROMPT)["input_ids"]
    a = _peft_adapter(root / "base", root / "a", seed=1, modules=["q_proj", "v_proj", "down_proj"])
    b = _peft_adapter(root / "base", root / "b", seed=2, modules=["o_proj", "gate_proj"])
    expected = {"a": _greedy(a, ids), "b": _greedy(b, ids)}
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(root / "base"))
    expected["base"] = _greedy(plain, ids)
    assert len({tuple(v) for v in expected.values()}) == 3, expected
    return root, expected


def test_sglang_lora_shapes_are_what_the_client_sends_and_parses():
    load = protocol.build_load_lora_payload("lora0", "/a/b")
    assert set(load) <= SGLANG_LOAD_LORA_FIELDS and load["pinned"] is False
    assert set(protocol.build_unload_lora_payload("lora0")) <= SGLANG_UNLOAD_LORA_FIELDS
    assert set(schema.LoadLoRAAdapterReqInput.model_fields) <= SGLANG_LOAD_LORA_FIELDS
    assert protocol.LORA_UPDATE_RESPONSE_FIELDS <= SGLANG_LORA_UPDATE_OUTPUT_FIELDS
    assert (protocol.LOAD_LORA_PATH, protocol.UNLOAD_LORA_PATH) == (
        "/load_lora_adapter",
        "/unload_lora_adapter",
    )
    assert protocol.parse_lora_update_response(SGLANG_LOAD_ANSWER, engine="e") == (
        True, "", {"lora0": SGLANG_LOAD_ANSWER["loaded_adapters"]["lora0"]},
    )  # fmt: skip
    assert protocol.parse_lora_update_response(SGLANG_LOAD_ANSWER_REFS, engine="e")[2] == {
        "lora0": "/a/b"
    }
    # routing: lora_path names the adapter on /generate; chat writes base-model:adapter-name
    generate = protocol.build_generate_payload(GenerateRequest("r", text="x", lora_path="t@v3"))
    assert generate["lora_path"] == "t@v3"
    chat = protocol.build_chat_payload(
        ChatRequest("r", [{"role": "user", "content": "x"}], model="base", lora_name="t@v3")
    )
    assert chat["model"] == "base:t@v3"
    parsed, _ = chat_request(chat)
    assert (parsed.model, parsed.lora_name) == ("base", "t@v3")
    explicit, _ = chat_request({**chat, "model": "base", "lora_path": "x@v1"})
    assert explicit.lora_name == "x@v1"  # chat requests take SGLang's explicit lora_path too
    # ... but the adapter in the model field wins when both are given
    assert chat_request({**chat, "lora_path": "x@v1"})[0].lora_name == "t@v3"
    with pytest.raises(schema.RequestRefused, match="field 'lora_int_id': Extra inputs"):
        schema.validate("LoadLoRAAdapterReqInput", {**load, "lora_int_id": 3}, "load")


def test_embedded_server_loads_routes_refuses_and_unloads(adapters):
    import httpx

    root, expected = adapters

    async def scenario(url: str):
        async with SGLangClient(url) as client:
            ids = await client.tokenize(PROMPT)

            async def generate(rid, lora=None):
                result = await client.generate(
                    GenerateRequest(rid, input_ids=ids, sampling=SAMPLING, lora_path=lora)
                )
                return list(result.output_ids)

            loaded = await client.load_lora_adapter("a@v1", str(root / "a"))
            assert loaded == {"a@v1": str(root / "a")}
            loaded = await client.load_lora_adapter("b@v1", str(root / "b"))
            assert set(loaded) == {"a@v1", "b@v1"}
            got = {
                "a": await generate("g1", "a@v1"),
                "b": await generate("g2", "b@v1"),
                "base": await generate("g3"),
            }
            chat = await client.chat(
                ChatRequest("c1", [{"role": "user", "content": PROMPT}], sampling=SAMPLING,
                            lora_name="b@v1")
            )  # fmt: skip
            chat_base = await client.chat(
                ChatRequest("c2", [{"role": "user", "content": PROMPT}], sampling=SAMPLING)
            )
            with pytest.raises(EngineRequestError, match="already loaded") as twice:
                await client.load_lora_adapter("a@v1", str(root / "b"))
            assert twice.value.status_code == 400
            with pytest.raises(EngineRequestError, match=r"no .*adapter_model\.safetensors"):
                await client.load_lora_adapter("c@v1", str(root / "nowhere"))
            with pytest.raises(EngineRequestError, match="names no loaded LoRA adapter"):
                await generate("g4", "c@v1")
            raw = httpx.post(f"{url}{protocol.LOAD_LORA_PATH}", json={"lora_name": "a@v1",
                             "lora_path": str(root / "a")})  # fmt: skip
            left = await client.unload_lora_adapter("a@v1")
            with pytest.raises(EngineRequestError, match="is not loaded"):
                await client.unload_lora_adapter("a@v1")
            with pytest.raises(EngineRequestError, match="names no loaded LoRA adapter"):
                await generate("g5", "a@v1")
            after = await generate("g6", "b@v1")
            return got, chat, chat_base, raw, left, after

    with embedded_server(model_path=str(root / "base")) as server:
        got, chat, chat_base, raw, left, after = asyncio.run(scenario(server.url))
    assert got == expected
    assert list(chat.output_ids) != list(chat_base.output_ids)  # the chat request was routed
    assert raw.status_code == 400
    body = raw.json()
    assert set(body) <= SGLANG_LORA_UPDATE_OUTPUT_FIELDS and body["success"] is False
    assert "already loaded" in body["error_message"]
    assert left == {"b@v1": str(root / "b")} and after == expected["b"]


def test_one_batch_serves_each_row_its_own_adapter(adapters):
    """A batched /generate whose rows name different adapters (and none): every row generates
    what peft's model of its adapter generates, as if it were alone."""
    root, expected = adapters
    order = ["a", "base", "b", "a", "b"]

    async def scenario(url: str):
        async with SGLangClient(url) as client:
            ids = await client.tokenize(PROMPT)
            await client.load_lora_adapter("a@v1", str(root / "a"))
            await client.load_lora_adapter("b@v1", str(root / "b"))
            rows = [
                GenerateRequest(
                    f"row{i}", input_ids=ids, sampling=SAMPLING,
                    lora_path=None if name == "base" else f"{name}@v1",
                )
                for i, name in enumerate(order)
            ]  # fmt: skip
            mixed = await client.generate_batch(rows)
            with pytest.raises(EngineRequestError, match="names no loaded LoRA adapter"):
                await client.generate_batch([rows[0], GenerateRequest(
                    "bad", input_ids=ids, sampling=SAMPLING, lora_path="c@v1")])  # fmt: skip
            return mixed

    with embedded_server(model_path=str(root / "base")) as server:
        mixed = asyncio.run(scenario(server.url))
    assert [list(r.output_ids) for r in mixed] == [expected[name] for name in order]


def test_echo_backend_serves_no_adapters(echo_servers):
    async def scenario(url):
        async with SGLangClient(url) as client:
            with pytest.raises(EngineRequestError, match="serves no LoRA adapters"):
                await client.load_lora_adapter("a@v1", "/tmp")

    asyncio.run(scenario(echo_servers[0].url))
    assert json.dumps(protocol.build_lora_update_response(False, "no", {}))
