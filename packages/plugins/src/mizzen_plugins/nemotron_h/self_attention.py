"""The hybrid's attention layer: causal grouped-query self-attention over a packed (THD) batch.

Nemotron-H attention layers have no positional encoding (the Mamba layers carry order) and no
projection biases.  Q, K and V come from one fused projection ``qkv_proj`` (rows: all query heads,
then all key heads, then all value heads).

Invariants:
- A token attends to itself and to earlier tokens of its own sequence only.
- :func:`thd_causal_attention` is the single place that picks the attention kernel; the layer never
  calls a kernel directly.  It runs ``scaled_dot_product_attention`` per sequence (exact; one host
  sync for the sequence bounds).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mizzen_plugins.nemotron_h.config import NemotronHConfig
from mizzen_plugins.nemotron_h.packing import PackedSequences

__all__ = ["CausalSelfAttention", "thd_causal_attention"]


def thd_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSequences, *, scale: float
) -> torch.Tensor:
    """Causal attention of packed ``q [T, Hq, d]``, ``k``/``v [T, Hkv, d]`` -> ``[T, Hq, d]``."""
    pieces = []
    for start, end in packed.bounds():
        # [1, heads, L, d] per sequence; GQA: query head h reads key/value head h // (Hq / Hkv).
        attended = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k[start:end].transpose(0, 1).unsqueeze(0),
            v[start:end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        pieces.append(attended[0].transpose(0, 1))
    return torch.cat(pieces) if pieces else torch.empty_like(q)


class CausalSelfAttention(nn.Module):
    """Fused QKV projection, causal THD attention, output projection."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_size = c.num_attention_heads * c.attention_head_dim
        self.kv_size = c.num_key_value_heads * c.attention_head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.out_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for linear in (self.qkv_proj, self.out_proj):
            nn.init.normal_(linear.weight, std=self.config.initializer_range)

    def forward(self, hidden: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
        c = self.config
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = thd_causal_attention(
            q.unflatten(-1, (c.num_attention_heads, c.attention_head_dim)),
            k.unflatten(-1, (c.num_key_value_heads, c.attention_head_dim)),
            v.unflatten(-1, (c.num_key_value_heads, c.attention_head_dim)),
            packed,
            scale=c.attention_head_dim**-0.5,
        )
        return self.out_proj(out.flatten(-2))
