"""A slot's adapter exported as a PEFT directory is what the real ``peft`` package loads: peft's
``PeftModel`` on the transformers base gives the logits of our merged snapshot and of the
slotted megatron model, every factor lands under peft's own key names, a model peft saves has
the same layout, and the embedded engine's LoRA forward hooks give peft's logits too.

Grouped-query attention (4 heads, 2 key/value groups) and SwiGLU make the fused q/k/v and
gate/up splits of ``B`` matter: a wrong split order changes the logits."""

from __future__ import annotations

import json

import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=20, labels=["train", "lora"])

RANK, ALPHA = 4, 8.0


def _export(tmp: str) -> dict:
    from mizzen_train.batch import SlotBatch
    from mizzen_train.executor import SlotExecutor
    from mizzen_train.hf import (
        export_hf_snapshot,
        export_peft_adapter,
        import_hf_llama,
        write_tiny_llama,
    )
    from mizzen_train.specs import ExecutorConfig

    source = write_tiny_llama(f"{tmp}/base", seed=5, initializer_range=0.1)
    imported = import_hf_llama(source, device="cpu")
    executor = SlotExecutor(
        imported.model, ExecutorConfig(num_slots=2, max_rank=8, micro_batch_size=2)
    )
    generator = torch.Generator().manual_seed(9)
    weights = {
        name: (torch.rand(shape, generator=generator) - 0.5) * 0.4
        for name, shape in executor.adapter_shapes(RANK).items()
    }
    executor.load_slot(1, RANK, ALPHA, weights=weights)  # slot 1 at rank 4 < max rank 8
    adapter = export_peft_adapter(
        f"{tmp}/adapter", executor=executor, slot=1, source=imported.source
    )
    merged = export_hf_snapshot(
        f"{tmp}/merged", model=imported.model, source=imported.source, executor=executor, slot=1
    )
    ids = torch.randint(3, 259, (2, 24), generator=generator)
    batch = SlotBatch(
        input_ids=ids[:, :-1],
        target_ids=ids[:, 1:],
        loss_mask=torch.ones(2, 23, dtype=torch.bool),
        slot_ids=torch.ones(2, 23, dtype=torch.long),
    )
    return {
        "base": str(source),
        "adapter": str(adapter),
        "merged": str(merged),
        "ids": ids,
        "megatron_logprobs": executor.forward_logprobs(batch),
    }


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def test_peft_loads_our_adapter_and_matches_the_merged_export(kit, tmp_path):
    import peft
    import transformers
    from safetensors import safe_open

    (made,) = kit.run_ranks(_export, args=(str(tmp_path),))
    adapter = tmp_path / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    load = transformers.AutoModelForCausalLM.from_pretrained
    base = load(made["base"], dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter))
    model.eval()
    assert isinstance(model.peft_config["default"], peft.LoraConfig)
    ids = made["ids"]
    with_peft = _logprobs(model, ids)
    merged = _logprobs(load(made["merged"], dtype=torch.float32), ids)
    plain = _logprobs(load(made["base"], dtype=torch.float32), ids)
    assert float((with_peft - plain).abs().max()) > 1e-2  # the adapter changes the model
    assert float((with_peft - merged).abs().max()) < 1e-4
    assert float((with_peft - made["megatron_logprobs"]).abs().max()) < 1e-4

    # every factor under peft's own names and shapes: peft saves the same keys for this model
    saved = tmp_path / "peft-saved"
    fresh = peft.get_peft_model(
        load(made["base"], dtype=torch.float32),
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=config["target_modules"]),
    )
    fresh.save_pretrained(str(saved))

    def shapes(path):
        with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118

    assert shapes(adapter) == shapes(saved)
    ours = peft.LoraConfig.from_pretrained(str(adapter))
    assert (ours.r, ours.lora_alpha, ours.use_dora, ours.use_rslora) == (RANK, ALPHA, False, False)

    # the embedded engine applies the same adapter through its forward hooks
    from mizzen_rollout.engines.embedded.backend import TransformersBackend

    backend = TransformersBackend(model_path=made["base"])
    backend.load_lora("t@v1", str(adapter))
    with backend.adapters.active("t@v1"):
        hooked = _logprobs(backend.model, ids)
    assert float((hooked - with_peft).abs().max()) < 1e-5
    assert torch.equal(_logprobs(backend.model, ids), plain)  # inactive: the base, bit for bit
