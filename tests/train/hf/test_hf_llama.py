"""HF Llama <-> megatron: import then export is the identity, logits match transformers' own
LlamaForCausalLM (fp32, tied and untied, grouped-query attention, TP=1 and TP=2), a slot's merged
snapshot computes what the slotted executor computes, packed rows equal unpacked sequences, bad
directories are refused with the file named, and a snapshot serves in the embedded engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["train", "megatron", "lora"])

ATOL = 2e-5


def _hf_logprobs(directory, input_ids, target_ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)


def _batch(rows, seq_len, vocab, seed, slot=-1):
    from mizzen_train.batch import SlotBatch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len + 1), generator=generator)
    return SlotBatch(
        input_ids=ids[:, :-1],
        target_ids=ids[:, 1:],
        loss_mask=torch.ones(rows, seq_len, dtype=torch.bool),
        slot_ids=torch.full((rows, seq_len), slot, dtype=torch.long),
    )


def _executor(model, num_slots=1):
    from mizzen_train.executor import SlotExecutor
    from mizzen_train.specs import ExecutorConfig

    return SlotExecutor(model, ExecutorConfig(num_slots=num_slots, max_rank=8, micro_batch_size=2))


def _round_trip_and_parity(tmp: str) -> dict:
    from mizzen_train.hf import export_hf_snapshot, import_hf_llama, write_tiny_llama

    results = {}
    for tie in (True, False):
        source = write_tiny_llama(f"{tmp}/tiny-{tie}", seed=3, tie_word_embeddings=tie)
        imported = import_hf_llama(source, device="cpu")
        batch = _batch(4, 48, imported.spec.vocab_size, seed=1)
        executor = _executor(imported.model)
        ours = executor.forward_logprobs(batch)
        reference = _hf_logprobs(source, batch.input_ids, batch.target_ids)
        exported = export_hf_snapshot(
            f"{tmp}/export-{tie}", model=imported.model, source=imported.source
        )
        from safetensors.torch import load_file

        before = load_file(str(source / "model.safetensors"))
        after = load_file(str(exported / "model.safetensors"))
        results[tie] = {
            "max_diff": float((ours - reference).abs().max()),
            "same_names": set(before) == set(after),
            "bitwise": all(torch.equal(before[k], after[k]) for k in before),
            "files": sorted(p.name for p in exported.iterdir()),
            "leftovers": sorted(p.name for p in Path(tmp).iterdir() if p.name.startswith(".tmp")),
        }
    return results


def test_import_export_round_trip_and_logits_parity(kit, tmp_path):
    (results,) = kit.run_ranks(_round_trip_and_parity, args=(str(tmp_path),))
    for tie, result in results.items():
        assert result["max_diff"] < ATOL, (tie, result)
        assert result["same_names"] and result["bitwise"], (tie, result)
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(result["files"])
        assert result["leftovers"] == []
    config = json.loads((tmp_path / "export-False" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"


def _merged_slot_and_packing(tmp: str) -> dict:
    from mizzen_train.hf import export_hf_snapshot, import_hf_llama, write_tiny_llama

    source = write_tiny_llama(f"{tmp}/tiny", seed=5)
    imported = import_hf_llama(source, device="cpu")
    executor = _executor(imported.model, num_slots=2)
    generator = torch.Generator().manual_seed(9)
    weights = {
        name: (torch.rand(shape, generator=generator) - 0.5) * 0.4
        for name, shape in executor.adapter_shapes(4).items()
    }
    executor.load_slot(1, 4, 8.0, weights=weights)
    round_trip = executor.adapter_weights(1)
    batch = _batch(2, 32, imported.spec.vocab_size, seed=2, slot=1)
    slotted = executor.forward_logprobs(batch)
    snapshot = export_hf_snapshot(
        f"{tmp}/slot1", model=imported.model, source=imported.source, executor=executor, slot=1
    )
    merged = _hf_logprobs(snapshot, batch.input_ids, batch.target_ids)
    base = _hf_logprobs(source, batch.input_ids, batch.target_ids)

    # two sequences packed in one row with segment ids == each sequence on its own
    from dataclasses import replace

    first, second = _batch(1, 20, 259, seed=3, slot=1), _batch(1, 12, 259, seed=4, slot=1)
    packed = replace(
        _batch(2, 32, 259, seed=0, slot=1),
        input_ids=torch.cat([first.input_ids, second.input_ids], 1).repeat(2, 1),
        target_ids=torch.cat([first.target_ids, second.target_ids], 1).repeat(2, 1),
        segment_ids=torch.tensor([[0] * 20 + [1] * 12]).repeat(2, 1),
    )
    packed_lp = executor.forward_logprobs(packed)[0]
    alone = torch.cat(
        [
            _hf_logprobs(snapshot, first.input_ids, first.target_ids)[0],
            _hf_logprobs(snapshot, second.input_ids, second.target_ids)[0],
        ]
    )
    unmasked = replace(packed, segment_ids=None)
    return {
        "factors_exact": all(torch.equal(round_trip[k], weights[k]) for k in weights),
        "merged_diff": float((slotted - merged).abs().max()),
        "lora_changes_model": float((merged - base).abs().max()),
        "packed_diff": float((packed_lp - alone).abs().max()),
        "unmasked_diff": float((executor.forward_logprobs(unmasked)[0] - alone).abs().max()),
    }


def test_merged_slot_snapshot_and_packed_rows_match_transformers(kit, tmp_path):
    (result,) = kit.run_ranks(_merged_slot_and_packing, args=(str(tmp_path),))
    assert result["factors_exact"]
    assert result["lora_changes_model"] > 1e-2, "the adapter must change the model"
    assert result["merged_diff"] < ATOL, result
    assert result["packed_diff"] < ATOL, result
    assert result["unmasked_diff"] > 1e-3, "without segment ids the second sequence sees the first"


def _tensor_parallel(tmp: str) -> dict:
    from mizzen_train.hf import export_hf_snapshot, import_hf_llama, write_tiny_llama

    rank = torch.distributed.get_rank()
    source = Path(f"{tmp}/tiny")
    if rank == 0:
        write_tiny_llama(source, seed=7, vocab_size=260, tie_word_embeddings=False)
    torch.distributed.barrier()
    imported = import_hf_llama(source, device="cpu")
    executor = _executor(imported.model)
    batch = _batch(2, 24, 260, seed=6)
    ours = executor.forward_logprobs(batch)
    export_hf_snapshot(f"{tmp}/tp-export", model=imported.model, source=imported.source)
    torch.distributed.barrier()
    reference = _hf_logprobs(source, batch.input_ids, batch.target_ids)
    from safetensors.torch import load_file

    before = load_file(str(source / "model.safetensors"))
    after = load_file(f"{tmp}/tp-export/model.safetensors")
    return {
        "max_diff": float((ours - reference).abs().max()),
        "bitwise": set(before) == set(after)
        and all(torch.equal(before[k], after[k]) for k in before),
        "local_fc1": tuple(imported.model.decoder.layers[0].mlp.linear_fc1.weight.shape),
    }


def test_tensor_parallel_import_and_export(kit, tmp_path):
    results = kit.run_ranks(_tensor_parallel, world_size=2, tp=2, args=(str(tmp_path),))
    for result in results:
        assert result["max_diff"] < ATOL, result
        assert result["bitwise"], result
        assert result["local_fc1"] == (128, 64)  # [gate_r; up_r] of intermediate 128 over TP=2


def _broken_directories(tmp: str) -> dict:
    from safetensors.torch import load_file, save_file

    from mizzen_train.errors import HFModelError
    from mizzen_train.hf import import_hf_llama, write_tiny_llama

    good = write_tiny_llama(f"{tmp}/good", seed=1)
    config = json.loads((good / "config.json").read_text())
    weights = load_file(str(good / "model.safetensors"))

    def variant(name, *, config_patch=None, drop=None, reshape=None):
        directory = Path(tmp) / name
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**config, **(config_patch or {})}))
        tensors = {k: v for k, v in weights.items() if k != drop}
        if reshape:
            tensors[reshape] = tensors[reshape][:-1].clone()
        save_file(tensors, str(directory / "model.safetensors"))
        try:
            import_hf_llama(directory, device="cpu")
        except HFModelError as exc:
            return str(exc)
        return "imported"

    missing = Path(tmp) / "empty"
    missing.mkdir()
    try:
        import_hf_llama(missing, device="cpu")
        empty = "imported"
    except HFModelError as exc:
        empty = str(exc)
    return {
        "empty": empty,
        "model_type": variant("mistral", config_patch={"model_type": "gpt2"}),
        "bias": variant("bias", config_patch={"attention_bias": True}),
        "rope": variant(
            "rope",
            config_patch={
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
            },
        ),
        "missing": variant("missing", drop="model.layers.1.mlp.up_proj.weight"),
        "shape": variant("shape", reshape="model.layers.0.self_attn.k_proj.weight"),
        "heads": variant("heads", config_patch={"num_key_value_heads": 3}),
    }


def test_broken_directories_are_refused_with_file_and_fix(kit, tmp_path):
    (errors,) = kit.run_ranks(_broken_directories, args=(str(tmp_path),))
    assert "config.json: no such file" in errors["empty"] and "Fix:" in errors["empty"]
    assert "model_type='gpt2'" in errors["model_type"] and "Llama family" in errors["model_type"]
    assert "attention_bias=True" in errors["bias"]
    assert "rope_scaling='linear'" in errors["rope"]
    assert "1 tensor(s) missing" in errors["missing"] and "up_proj" in errors["missing"]
    assert "k_proj.weight has shape (31, 64)" in errors["shape"]
    assert "num_key_value_heads" in errors["heads"]
    for name, message in errors.items():
        assert str(tmp_path) in message, (name, message)


def _snapshot_for_engine(tmp: str) -> dict:
    import transformers

    from mizzen_train.hf import export_hf_snapshot, import_hf_llama, write_tiny_llama

    source = write_tiny_llama(f"{tmp}/tiny", seed=11)
    imported = import_hf_llama(source, device="cpu")
    executor = _executor(imported.model)
    generator = torch.Generator().manual_seed(1)
    weights = {
        n: torch.randn(s, generator=generator) * 0.3 for n, s in executor.adapter_shapes(8).items()
    }
    executor.load_slot(0, 8, 16.0, weights=weights)
    snapshot = export_hf_snapshot(
        f"{tmp}/snapshot", model=imported.model, source=imported.source, executor=executor, slot=0
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(snapshot)
    model = transformers.AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    prompt = tokenizer("The answer is")["input_ids"]
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0
    )
    return {"snapshot": str(snapshot), "prompt": prompt, "expected": out[0, len(prompt) :].tolist()}


def test_snapshot_serves_in_embedded_engine(kit, tmp_path):
    import asyncio

    from mizzen_rollout.engines import GenerateRequest, SamplingParams, SGLangClient
    from mizzen_rollout.engines.launcher import embedded_server

    (made,) = kit.run_ranks(_snapshot_for_engine, args=(str(tmp_path),))

    async def generate(url):
        async with SGLangClient(url) as client:
            tokens = await client.tokenize("The answer is")
            result = await client.generate(
                GenerateRequest(
                    request_id="snap-1",
                    input_ids=tokens,
                    sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
                )
            )
            return tokens, list(result.output_ids)

    with embedded_server(model_path=made["snapshot"]) as server:
        tokens, output = asyncio.run(generate(server.url))
    assert tokens == made["prompt"]
    assert output == made["expected"]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_mapping_to_hf_and_back_is_exact(tp_size):
    from mizzen_train.hf.mapping import LlamaLayout, hf_linear_names, hf_param_names

    layout = LlamaLayout(
        num_attention_heads=8, num_query_groups=2, head_dim=4, ffn_hidden_size=12, tp_size=tp_size
    )
    qkv = torch.arange((8 + 4) * 4 * 3, dtype=torch.float32).reshape(48, 3)
    q, k, v = layout.to_hf("decoder.layers.0.self_attention.linear_qkv", qkv)
    assert q.shape == (32, 3) and k.shape == (8, 3) and v.shape == (8, 3)
    assert torch.equal(q[:16], qkv[:16]) and torch.equal(k[:4], qkv[16:20])  # group 0: q q q q k v
    assert torch.equal(layout.from_hf("linear_qkv", [q, k, v]), qkv)
    fc1 = torch.arange(24 * 2, dtype=torch.float32).reshape(24, 2)
    gate, up = layout.to_hf("decoder.layers.0.mlp.linear_fc1", fc1)
    local = fc1.chunk(tp_size)[0]  # what TP rank 0 holds: its own [gate_r; up_r]
    assert torch.equal(local[: 12 // tp_size], gate[: 12 // tp_size])
    assert torch.equal(layout.from_hf("linear_fc1", [gate, up]), fc1)
    assert hf_linear_names("decoder.layers.2.mlp.linear_fc1") == (
        "model.layers.2.mlp.gate_proj",
        "model.layers.2.mlp.up_proj",
    )
    assert hf_param_names("decoder.layers.1.self_attention.linear_proj.base.weight") == (
        "model.layers.1.self_attn.o_proj.weight",
    )
    with pytest.raises(KeyError, match="no Hugging Face Llama counterpart"):
        hf_param_names("decoder.layers.0.self_attention.linear_qkv.bias")
