"""A small causal language model around the DeepSeek-V4-style attention (toy scale, our design).

``embedding -> [x + attention(norm(x)); x + mlp(norm(x))] per layer -> norm -> lm_head``, where
``attention`` is :class:`~mizzen_plugins.deepseek_v4.attention.DeepSeekV4Attention` (one
compression ratio per layer, 0 = window only) and ``mlp`` a SwiGLU
(``down_proj(silu(gate_proj x) * up_proj x)``).  This is what makes the attention plugin
trainable as a language model (``mizzen-train`` with ``[model] plugin = "deepseek_v4"``); there is
no Hugging Face architecture for it, so its checkpoints are this module's own state dicts.

Invariants:
- The model works on packed (THD) batches: ``input_ids [T]`` with ``cu_seqlens [n + 1]``; each
  sequence's logits equal those of running it alone (the attention's packed-stream invariant;
  the MLP and norms are per token).  A ``[B, L]`` batch is ``B`` sequences of ``L`` tokens.
- The config is read from a Hugging Face-style dict (the attention keys of
  :class:`~mizzen_plugins.deepseek_v4.config.DeepSeekV4StackConfig` plus ``vocab_size``,
  ``intermediate_size``, ``tie_word_embeddings``), and written back by
  :meth:`DeepSeekV4ModelConfig.to_hf_dict`, so ``from_hf_dict(c.to_hf_dict()) == c``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mizzen_plugins.deepseek_v4.attention import DeepSeekV4Attention
from mizzen_plugins.deepseek_v4.config import _HF_KEYS, DeepSeekV4StackConfig
from mizzen_plugins.thd import PackedLayout

__all__ = ["LM_MODEL_TYPE", "DeepSeekV4CausalLM", "DeepSeekV4ModelConfig", "build_causal_lm"]

LM_MODEL_TYPE = "mizzen_deepseek_v4"


@dataclass(frozen=True)
class DeepSeekV4ModelConfig:
    """The attention stack's config plus the language-model parts around it."""

    stack: DeepSeekV4StackConfig
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DeepSeek-V4 model config: {name!r} = {value!r} must be >= 1")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError("DeepSeek-V4 model config: 'tie_word_embeddings' must be a bool")
        if not (isinstance(self.initializer_range, int | float) and self.initializer_range > 0):
            raise ValueError("DeepSeek-V4 model config: 'initializer_range' must be > 0")

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> DeepSeekV4ModelConfig:
        if not isinstance(hf, Mapping):
            raise ValueError(f"expected a config dict, got {type(hf).__name__}")
        missing = [k for k in ("vocab_size", "intermediate_size") if k not in hf]
        if missing:
            raise ValueError(f"DeepSeek-V4 model config: {missing} required but missing")
        return cls(
            stack=DeepSeekV4StackConfig.from_hf_dict(hf),
            vocab_size=hf["vocab_size"],
            intermediate_size=hf["intermediate_size"],
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            initializer_range=hf.get("initializer_range", 0.02),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        attention = self.stack.attention
        hf: dict[str, Any] = {"model_type": LM_MODEL_TYPE}
        hf.update({key: getattr(attention, name) for key, name in _HF_KEYS.items()})
        hf["compress_ratios"] = list(self.stack.compress_ratios)
        hf["num_hidden_layers"] = len(self.stack.compress_ratios)
        hf.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "stack"})
        return hf


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepSeekV4Block(nn.Module):
    def __init__(self, config: DeepSeekV4ModelConfig, ratio: int) -> None:
        super().__init__()
        attention = config.stack.attention
        eps = attention.rms_norm_eps
        self.attention_norm = nn.RMSNorm(attention.hidden_size, eps=eps)
        self.attention = DeepSeekV4Attention(attention.with_ratio(ratio))
        self.mlp_norm = nn.RMSNorm(attention.hidden_size, eps=eps)
        self.mlp = SwiGLU(attention.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), layout).output
        return x + self.mlp(self.mlp_norm(x))


class DeepSeekV4CausalLM(nn.Module):
    """Token ids of a packed batch -> next-token logits (see the module docstring)."""

    def __init__(self, config: DeepSeekV4ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.stack.attention.hidden_size
        self.embedding = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            DeepSeekV4Block(config, ratio) for ratio in config.stack.compress_ratios
        )
        self.final_norm = nn.RMSNorm(hidden, eps=config.stack.attention.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(hidden, config.vocab_size, bias=False)
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=std)

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | PackedLayout | None = None
    ) -> torch.Tensor:
        """``[T]`` packed (with ``cu_seqlens``) -> ``[T, vocab]``; ``[B, L]`` -> ``[B, L, vocab]``."""
        batch_shape = input_ids.shape
        layout = PackedLayout.of_input_ids(input_ids, cu_seqlens)
        x = self.embedding(input_ids.reshape(-1))
        for block in self.layers:
            x = block(x, layout)
        x = self.final_norm(x)
        weight = self.embedding.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).reshape(*batch_shape, -1)


def build_causal_lm(hf_config: Mapping[str, Any]) -> DeepSeekV4CausalLM:
    """A randomly initialised model for a Hugging Face-style config dict."""
    return DeepSeekV4CausalLM(DeepSeekV4ModelConfig.from_hf_dict(hf_config))
