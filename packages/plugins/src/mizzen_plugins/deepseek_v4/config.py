"""Configuration of the DeepSeek-V4-style attention layers (toy scale, our own design).

Invariants: every field is validated once here, with the field name and the fix in the message;
``compress_ratio == 0`` means a window-only layer (no compressed branch, no indexer); head
dimensions of queries and of the shared key/value head are ``nope_head_dim + rope_head_dim``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

MODEL_TYPE = "mizzen_deepseek_v4_attention"


@dataclass(frozen=True)
class DeepSeekV4AttentionConfig:
    hidden_size: int = 256
    num_heads: int = 4
    q_lora_rank: int = 64  # MLA-style low-rank query projection
    nope_head_dim: int = 32  # position-free part of queries and of the shared KV head
    rope_head_dim: int = 16  # rotary part
    window: int = 16  # sliding window (keys t-window+1 .. t of the same segment)
    compress_ratio: int = 4  # rows pooled per compressed entry; 0 = window only
    index_heads: int = 2
    index_head_dim: int = 16
    index_topk: int = 4  # compressed entries each query attends to
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        positive = (
            "hidden_size",
            "num_heads",
            "q_lora_rank",
            "nope_head_dim",
            "window",
            "index_heads",
            "index_head_dim",
            "index_topk",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"DeepSeekV4AttentionConfig.{name} = {getattr(self, name)}: must be >= 1"
                )
        if self.rope_head_dim < 0 or self.rope_head_dim % 2:
            raise ValueError(
                f"DeepSeekV4AttentionConfig.rope_head_dim = {self.rope_head_dim}: must be even and "
                ">= 0 (rotary pairs)"
            )
        if self.compress_ratio < 0:
            raise ValueError(
                f"DeepSeekV4AttentionConfig.compress_ratio = {self.compress_ratio}: must be >= 0 "
                "(0 = window-only layer)"
            )

    @property
    def head_dim(self) -> int:
        return self.nope_head_dim + self.rope_head_dim

    @property
    def halo(self) -> int:
        """Rows before a context-parallel chunk that its window or its groups reach."""
        return max(self.window - 1, self.compress_ratio - 1, 0)

    def with_ratio(self, ratio: int) -> DeepSeekV4AttentionConfig:
        return replace(self, compress_ratio=ratio)


# Hugging Face-style config keys -> DeepSeekV4AttentionConfig fields (DeepSeek-V3.2 names where
# they exist; sliding_window / compress_ratios are ours).
_HF_KEYS = {
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "q_lora_rank": "q_lora_rank",
    "qk_nope_head_dim": "nope_head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "sliding_window": "window",
    "index_n_heads": "index_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
}


@dataclass(frozen=True)
class DeepSeekV4StackConfig:
    """A stack of attention layers sharing one attention config, one ratio per layer."""

    attention: DeepSeekV4AttentionConfig = field(default_factory=DeepSeekV4AttentionConfig)
    compress_ratios: tuple[int, ...] = (0, 4)

    def __post_init__(self) -> None:
        if not self.compress_ratios or any(int(r) != r or r < 0 for r in self.compress_ratios):
            raise ValueError(
                f"DeepSeekV4StackConfig.compress_ratios = {self.compress_ratios!r}: need one "
                "integer >= 0 per layer (0 = window-only layer)"
            )

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> DeepSeekV4StackConfig:
        """From a ``config.json``-style dict; unknown keys are ignored, bad values named."""
        kwargs = {field_: hf[key] for key, field_ in _HF_KEYS.items() if key in hf}
        ratios = hf.get("compress_ratios")
        if ratios is None:
            n = hf.get("num_hidden_layers")
            if not isinstance(n, int) or n < 1:
                raise ValueError(
                    "config needs 'compress_ratios' (one per layer, 0 = window only) or an "
                    f"integer 'num_hidden_layers' >= 1 (got {n!r})"
                )
            ratios = [hf.get("compress_ratio", DeepSeekV4AttentionConfig.compress_ratio)] * n
        elif "num_hidden_layers" in hf and hf["num_hidden_layers"] != len(ratios):
            raise ValueError(
                f"config: num_hidden_layers = {hf['num_hidden_layers']} but compress_ratios has "
                f"{len(ratios)} entries; give one ratio per layer"
            )
        return cls(DeepSeekV4AttentionConfig(**kwargs), tuple(ratios))
