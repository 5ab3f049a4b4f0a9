"""Configuration of the DeepSeek-V4-style attention layers (toy scale, our own design).

Invariants: every field is validated once here, with the field name and the fix in the message;
``compress_ratio == 0`` means a window-only layer (no compressed branch, no indexer); head
dimensions of queries and of the shared key/value head are ``nope_head_dim + rope_head_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
