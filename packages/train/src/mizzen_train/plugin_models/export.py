"""A plugin model's slot, exported: a PEFT adapter, and the merged model.

Where the plugin maps to a Hugging Face architecture (``ModelPlugin.hf``, e.g. ``nemotron_h``):

- the adapter names the Hugging Face modules (``model.layers.3.mixer.q_proj`` ...): a linear our
  model fuses (Nemotron-H's ``qkv_proj``) becomes its modules, ``A`` written once per module and
  ``B`` split along its output rows exactly as the base weight is, so ``peft`` or the embedded
  engine on the ``transformers`` model compute the slot's delta;
- the merged model (``W + alpha/r * B @ A`` in fp32, then the export dtype) is a Hugging Face
  directory ``transformers`` loads (``config.json``, ``model.safetensors``, the tokenizer).

Without one (``deepseek_v4``: no Hugging Face architecture exists for it), both use the plugin's
own module and state-dict names: the adapter is a PEFT adapter of the plugin's ``causal_lm``
module (``peft.PeftModel.from_pretrained(model, adapter)`` loads it onto the model the plugin
builds; its ``task_type`` is null, since the module is no ``transformers`` causal LM), and the merged model is a plugin base directory (``config.json`` + ``model.safetensors``
+ tokenizer) that ``[model] plugin = ...; path = <it>`` trains from or that the plugin reloads.

Invariants: factors are read from the slot's fp32 masters at the true rank; a directory appears
whole or not at all (temporary sibling, fsync, rename), never over an existing one; files 0644.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mizzen_train.plugin_models.base import CONFIG_FILE, WEIGHTS_FILE, PluginSource, load_plugin

__all__ = [
    "PluginExportSource",
    "export_plugin_adapter",
    "export_plugin_merged",
    "plugin_adapter_state",
]

#: The attribute of :class:`~mizzen_train.plugin_models.model.PluginGPT` holding the plugin model.
_LM = "lm."


def _our_path(layer_key: str) -> str:
    return layer_key.removeprefix(_LM)


@dataclass(frozen=True)
class PluginExportSource(PluginSource):
    """A plugin base as the exporters' ``source``: :func:`mizzen_train.hf.export_peft_adapter`
    and :func:`mizzen_train.hf.export_hf_snapshot` dispatch on these two methods, so every export
    path of SFT and RL serves a plugin model."""

    @classmethod
    def of(cls, source: PluginSource) -> PluginExportSource:
        return cls(**{f.name: getattr(source, f.name) for f in fields(PluginSource)})

    def export_peft_adapter(self, directory, *, executor, slot, base_model_name_or_path=None):
        return export_plugin_adapter(
            directory, executor=executor, slot=slot, source=self,
            base_model_name_or_path=base_model_name_or_path,
        )  # fmt: skip

    def export_hf_snapshot(self, directory, *, model, executor, slot, dtype, tokenizer):
        return export_plugin_merged(
            directory, model=model, executor=executor, slot=slot, source=self, dtype=dtype,
            tokenizer=tokenizer,
        )  # fmt: skip


def _modules_of(source: PluginSource, path: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    plugin = load_plugin(source.plugin)
    if plugin.hf is None:
        return (path,), None
    return plugin.hf.lora_modules(path, source.raw)


def plugin_adapter_state(executor: Any, slot: int, source: PluginSource) -> dict[str, Any]:
    """The PEFT safetensors state of ``slot`` (fp32 host tensors, by PEFT key)."""
    import torch

    from mizzen_rollout.api import peft_weight_key

    weights = executor.adapter_weights(slot)
    state = {}
    for key in executor.layers:
        lora_a = weights[f"{key}.lora_A"].to(device="cpu", dtype=torch.float32)
        lora_b = weights[f"{key}.lora_B"].to(device="cpu", dtype=torch.float32)
        modules, rows = _modules_of(source, _our_path(key))
        parts = lora_b.split(list(rows), dim=0) if rows is not None else [lora_b]
        for module, part in zip(modules, parts, strict=True):
            state[peft_weight_key(module, "lora_A")] = lora_a.clone().contiguous()
            state[peft_weight_key(module, "lora_B")] = part.clone().contiguous()
    return state


def export_plugin_adapter(
    directory: str | Path,
    *,
    executor: Any,
    slot: int,
    source: PluginSource,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``slot``'s adapter as a PEFT directory at ``directory`` (see the module docstring)."""
    from safetensors.torch import save_file

    from mizzen_rollout.api import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_config_dict

    spec = executor.slot_spec(slot)
    state = plugin_adapter_state(executor, slot, source)
    leaves = {
        module.rsplit(".", 1)[-1]
        for key in executor.layers
        for module in _modules_of(source, _our_path(key))[0]
    }
    config = adapter_config_dict(
        rank=spec.rank,
        alpha=spec.alpha,
        target_modules=sorted(leaves),
        base_model_name_or_path=base_model_name_or_path or str(source.directory),
    )
    if load_plugin(source.plugin).hf is None:
        # a plain torch module, not a transformers causal LM: peft's CAUSAL_LM wrapper would ask
        # it for generation hooks; without a task type peft wraps any module
        config["task_type"] = None

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return _write_whole(Path(directory), write)


def merged_state(model: Any, executor: Any, slot: int | None) -> dict[str, Any]:
    """The plugin model's state dict (our names, fp32, on the host) with ``slot``'s deltas merged
    into its slotted linears (``slot=None``: the base)."""
    import torch

    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.lm.state_dict().items()}
    layers = getattr(executor, "layers", {}) if executor is not None else {}
    for key in layers:  # a wrapped linear's tensors sit under ".base"
        path = _our_path(key)
        for name in ("weight", "bias"):
            if f"{path}.base.{name}" in state:
                state[f"{path}.{name}"] = state.pop(f"{path}.base.{name}")
    if slot is None:
        return state
    weights = executor.adapter_weights(slot)
    scale = executor.slot_spec(slot).scale
    for key in layers:
        a = weights[f"{key}.lora_A"].to("cpu", torch.float32)
        b = weights[f"{key}.lora_B"].to("cpu", torch.float32)
        state[f"{_our_path(key)}.weight"] = state[f"{_our_path(key)}.weight"] + scale * (b @ a)
    return state


def export_plugin_merged(
    directory: str | Path,
    *,
    model: Any,
    executor: Any,
    slot: int | None,
    source: PluginSource,
    dtype: str,
    tokenizer: Any = None,
) -> Path:
    """``slot``'s merged model (or the base) as a directory (see the module docstring)."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    state = merged_state(model, executor, slot)
    plugin = load_plugin(source.plugin)
    if plugin.hf is not None:
        state = plugin.hf.to_hf(state, source.raw)
    state = {k: v.to(torch_dtype).contiguous() for k, v in state.items()}
    config = dict(source.raw)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        else:
            from mizzen_train.hf.convert import copy_tokenizer_files

            copy_tokenizer_files(source.directory, tmp)

    return _write_whole(Path(directory), write)


def _write_whole(target: Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` into a temporary sibling, fsynced, 0644, renamed to ``target``; rank 0."""
    import torch

    from mizzen_train.hf.convert import make_readable

    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists; exports are written once, to a fresh path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        write(tmp)
        for path in sorted(tmp.iterdir()):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        make_readable(tmp)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
