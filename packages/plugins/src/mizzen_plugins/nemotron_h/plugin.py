"""The ``nemotron_h`` entry of the ``mizzen.plugins`` entry-point group.

Invariant: this module only assembles the :class:`~mizzen_plugins.ModelPlugin`; everything it names
imports on a CPU machine (GPU kernels load lazily inside the scan backend).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mizzen_plugins.discovery import HFMapping, ModelPlugin
from mizzen_plugins.nemotron_h.config import MODEL_TYPE, NemotronHConfig
from mizzen_plugins.nemotron_h.model import HybridCausalLM, build_model
from mizzen_plugins.nemotron_h.weights import HUB_PREFIX, from_hf, hf_linear_modules, to_hf

__all__ = ["PLUGIN", "TINY_CONFIG"]

#: A Nemotron-H-style hybrid small enough to fine-tune on a CPU in seconds (byte vocabulary):
#: every layer kind once plus a second Mamba layer, hidden 32.
TINY_CONFIG: dict[str, Any] = {
    "model_type": MODEL_TYPE,
    "vocab_size": 259,
    "hidden_size": 32,
    "hybrid_override_pattern": "M*M-",
    "ssm_state_size": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 1,
    "conv_kernel": 4,
    "chunk_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "initializer_range": 0.1,
    "max_position_embeddings": 512,
}


def causal_lm(hf_config: Mapping[str, Any]) -> HybridCausalLM:
    return build_model(NemotronHConfig.from_hf_dict(hf_config))


def _to_hf(state_dict: Mapping[str, Any], hf_config: Mapping[str, Any]) -> dict:
    """Our state dict under the hub checkpoint names (``backbone.``, as published)."""
    return to_hf(state_dict, NemotronHConfig.from_hf_dict(hf_config), prefix=HUB_PREFIX)


def _from_hf(hf_state_dict: Mapping[str, Any], hf_config: Mapping[str, Any]) -> dict:
    return from_hf(hf_state_dict, NemotronHConfig.from_hf_dict(hf_config), prefix=HUB_PREFIX)


def _lora_modules(path: str, hf_config: Mapping[str, Any]):
    return hf_linear_modules(path, NemotronHConfig.from_hf_dict(hf_config))


PLUGIN = ModelPlugin(
    name="nemotron_h",
    family=MODEL_TYPE,
    config_class=NemotronHConfig,
    build=build_model,
    description="Nemotron-H-style hybrid: Mamba-2 mixers, causal attention and MLPs from a pattern",
    causal_lm=causal_lm,
    # not "out_proj": the Mamba mixer's is fused into the scan's output kernels of mamba_ssm
    # (peft refuses LoRA on it for Mamba models), and the attention's has the same leaf name
    lora_targets=("in_proj", "qkv_proj", "up_proj", "down_proj"),
    tiny_config=TINY_CONFIG,
    hf=HFMapping(to_hf=_to_hf, from_hf=_from_hf, lora_modules=_lora_modules),
)
