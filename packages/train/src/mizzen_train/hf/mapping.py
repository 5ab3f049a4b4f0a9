"""The one table between megatron-core's Llama-shaped GPT and Hugging Face's ``LlamaForCausalLM``.

Every conversion (base weights in, merged snapshots out, and the LoRA factors a PEFT export will
write) goes through this module, so the names and the fused layouts are written once.

Names (``i`` = global layer number - 1; a megatron key of a slotted layer drops ``.base``)::

    embedding.word_embeddings.weight                 model.embed_tokens.weight
    decoder.layers.i.input_layernorm.weight          model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv       model.layers.i.self_attn.{q,k,v}_proj
    decoder.layers.i.self_attention.linear_proj      model.layers.i.self_attn.o_proj
    decoder.layers.i.pre_mlp_layernorm.weight        model.layers.i.post_attention_layernorm.weight
    decoder.layers.i.mlp.linear_fc1                  model.layers.i.mlp.{gate,up}_proj
    decoder.layers.i.mlp.linear_fc2                  model.layers.i.mlp.down_proj
    decoder.final_layernorm.weight                   model.norm.weight
    output_layer.weight                              lm_head.weight (absent when tied)

Fused layouts along the output axis (dim 0 of a weight, of a LoRA B, of a merged delta):

- ``linear_qkv``: per query group ``g`` (``num_query_groups`` of them), the group's
  ``heads_per_group`` query heads, then its key head, then its value head, each ``head_dim`` rows.
  Tensor parallelism splits whole groups, so the layout does not depend on the TP size.
- ``linear_fc1`` (SwiGLU): the concatenation of every TP rank's local ``[gate_r; up_r]`` (megatron
  chunks each rank's own fc1 output into gate and up), i.e. ``[gate; up]`` at TP=1.

Invariants:
- :meth:`LlamaLayout.to_hf` and :meth:`LlamaLayout.from_hf` are exact inverses (pure reshapes and
  concatenations; no arithmetic), for any tensor whose dim 0 is the fused output axis.
- Module names are Hugging Face's (``q_proj`` … ``down_proj``), the names PEFT targets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

#: Slotted megatron linears (the executor's ``target_modules``) -> (HF parent, HF modules in
#: fused output order).
LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attn", ("o_proj",)),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", ("down_proj",)),
}

#: Per-layer norms: megatron leaf path -> HF leaf path.
LAYER_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}

#: Whole-model tensors: megatron name -> HF name.
GLOBALS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)$")
_LAYER_PARAM = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def megatron_param_name(name: str) -> str:
    """A parameter name of the (possibly slotted) megatron model without the LoRA wrapper's
    ``.base``, e.g. ``decoder.layers.0.self_attention.linear_qkv.weight``."""
    return name.replace(".base.", ".")


def hf_linear_names(layer_key: str) -> tuple[str, ...]:
    """HF module paths (no ``.weight``) of a megatron linear key, in fused output order.

    ``decoder.layers.3.mlp.linear_fc1`` -> ``(model.layers.3.mlp.gate_proj,
    model.layers.3.mlp.up_proj)``."""
    match = _LAYER_KEY.match(layer_key)
    if match is None or match.group(3) not in LINEARS:
        raise KeyError(f"{layer_key!r} is not a slotted Llama linear ({sorted(LINEARS)})")
    layer, _, leaf = match.groups()
    parent, modules = LINEARS[leaf]
    return tuple(f"model.layers.{layer}.{parent}.{module}" for module in modules)


def hf_param_names(name: str) -> tuple[str, ...]:
    """HF parameter names that one megatron parameter maps to (several for a fused linear)."""
    name = megatron_param_name(name)
    if name in GLOBALS:
        return (GLOBALS[name],)
    match = _LAYER_PARAM.match(name)
    if match is not None:
        layer, rest = match.groups()
        if rest in LAYER_NORMS:
            return (f"model.layers.{layer}.{LAYER_NORMS[rest]}",)
        if rest.endswith(".weight"):
            key = f"decoder.layers.{layer}.{rest[: -len('.weight')]}"
            return tuple(f"{module}.weight" for module in hf_linear_names(key))
    raise KeyError(
        f"megatron parameter {name!r} has no Hugging Face Llama counterpart (biases, learned "
        "positions and LayerNorm shifts are not part of the Llama shape)"
    )


@dataclass(frozen=True)
class LlamaLayout:
    """The shape facts the fused layouts need."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    tp_size: int = 1

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @staticmethod
    def _leaf(key: str) -> str:
        """The ``linear_*`` component of a layer key, parameter or factor name."""
        return next((part for part in key.split(".") if part.startswith("linear_")), key)

    def to_hf(self, key: str, fused: torch.Tensor) -> list[torch.Tensor]:
        """Split ``fused`` (dim 0 = the megatron output axis of linear ``key``) into the HF
        modules' tensors, in :func:`hf_linear_names` order."""
        leaf = self._leaf(key)
        if leaf == "linear_qkv":
            groups = fused.reshape(
                self.num_query_groups, self.heads_per_group + 2, self.head_dim, *fused.shape[1:]
            )
            q = groups[:, : self.heads_per_group].reshape(-1, *fused.shape[1:])
            k = groups[:, self.heads_per_group].reshape(-1, *fused.shape[1:])
            v = groups[:, self.heads_per_group + 1].reshape(-1, *fused.shape[1:])
            return [q, k, v]
        if leaf == "linear_fc1":
            ranks = fused.reshape(self.tp_size, 2, -1, *fused.shape[1:])
            gate = ranks[:, 0].reshape(-1, *fused.shape[1:])
            up = ranks[:, 1].reshape(-1, *fused.shape[1:])
            return [gate, up]
        return [fused]

    def from_hf(self, key: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`to_hf`."""
        leaf = self._leaf(key)
        if leaf == "linear_qkv":
            q, k, v = parts
            rest = q.shape[1:]
            q = q.reshape(self.num_query_groups, self.heads_per_group, self.head_dim, *rest)
            k = k.reshape(self.num_query_groups, 1, self.head_dim, *rest)
            v = v.reshape(self.num_query_groups, 1, self.head_dim, *rest)
            return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
        if leaf == "linear_fc1":
            gate, up = parts
            rest = gate.shape[1:]
            gate = gate.reshape(self.tp_size, 1, -1, *rest)
            up = up.reshape(self.tp_size, 1, -1, *rest)
            return torch.cat([gate, up], dim=1).reshape(-1, *rest)
        (only,) = parts
        return only
