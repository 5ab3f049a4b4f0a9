"""Export one slot's LoRA adapter as a PEFT adapter directory (the unit of RL weight sync).

:func:`export_peft_adapter` writes ``adapter_config.json`` and ``adapter_model.safetensors`` in
the PEFT format of :mod:`mizzen_rollout.api` (what ``peft`` saves and loads) for the Hugging Face
Llama layout of :mod:`mizzen_train.hf.mapping`: a slotted megatron linear becomes the HF modules
it fuses, each with its own factors --

- ``A`` (``[r, in]``, shared by the fused outputs) is written once per HF module (``q_proj``,
  ``k_proj`` and ``v_proj`` carry the same ``A``; so do ``gate_proj`` and ``up_proj``);
- ``B`` (``[out, r]``) is split along its output axis exactly as the base weight is
  (:meth:`LlamaLayout.to_hf`), so ``B_q A`` is the ``q_proj`` rows of the fused delta ``B A``;

and ``lora_alpha / r`` is the slot's scale.  So ``W_hf + (alpha/r) B_hf A_hf`` equals the merged
snapshot of :func:`~mizzen_train.hf.export_hf_snapshot` module by module (in fp32).

Invariants:
- The factors are read from the slot's fp32 masters at its true rank (no max-rank padding);
  they are written in fp32.
- Collective under tensor parallelism (the executor all-gathers split factors); global rank 0
  writes.  The directory appears whole or not at all (temporary sibling, fsync, rename); the
  target must not exist; its files are 0644.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from mizzen_rollout.api import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    adapter_config_dict,
    peft_weight_key,
)
from mizzen_train.hf.convert import HFLlamaConfig, layout_of, make_readable
from mizzen_train.hf.mapping import LINEARS, hf_linear_names

__all__ = ["export_peft_adapter", "peft_adapter_state"]


def peft_adapter_state(executor: Any, slot: int, source: HFLlamaConfig) -> dict[str, torch.Tensor]:
    """The PEFT safetensors state of ``slot`` (fp32 host tensors, by PEFT key); collective."""
    weights = executor.adapter_weights(slot)
    from megatron.core import parallel_state

    # adapter_weights joined the TP shards: a fused factor is in this TP size's fused layout
    layout = layout_of(source.spec, parallel_state.get_tensor_model_parallel_world_size())
    state: dict[str, torch.Tensor] = {}
    for key in executor.layers:
        lora_a = weights[f"{key}.lora_A"].to(device="cpu", dtype=torch.float32)
        lora_b = weights[f"{key}.lora_B"].to(device="cpu", dtype=torch.float32)
        modules = hf_linear_names(key)
        parts = layout.to_hf(key, lora_b) if len(modules) > 1 else [lora_b]
        for module, part in zip(modules, parts, strict=True):
            state[peft_weight_key(module, "lora_A")] = lora_a.clone().contiguous()
            state[peft_weight_key(module, "lora_B")] = part.clone().contiguous()
    return state


def export_peft_adapter(
    directory: str | Path,
    *,
    executor: Any,
    slot: int,
    source: HFLlamaConfig,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``slot``'s adapter as a PEFT directory at ``directory`` (see the module docstring).

    A plugin model's source (:class:`mizzen_train.plugin_models.export.PluginExportSource`) writes its
    own (its module names), through its ``export_peft_adapter``."""
    if hasattr(source, "export_peft_adapter"):
        return source.export_peft_adapter(
            directory, executor=executor, slot=slot,
            base_model_name_or_path=base_model_name_or_path,
        )  # fmt: skip
    target = Path(directory)
    spec = executor.slot_spec(slot)
    state = peft_adapter_state(executor, slot, source)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists; adapters are written once, to a fresh path")
    leaves = {leaf for key in executor.layers for leaf in LINEARS[key.rsplit(".", 1)[-1]][1]}
    config = adapter_config_dict(
        rank=spec.rank,
        alpha=spec.alpha,
        target_modules=sorted(leaves),
        base_model_name_or_path=base_model_name_or_path or str(source.path.parent),
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        from safetensors.torch import save_file

        save_file(state, str(tmp / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_FILE).write_text(
            json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        for path in sorted(tmp.iterdir()):
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        make_readable(tmp)
        os.rename(tmp, target)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
