"""The hybrid's attention layer: causal grouped-query self-attention over a packed (THD) batch.

Nemotron-H attention layers have no positional encoding (the Mamba layers carry order) and no
projection biases.  Q, K and V come from one fused projection ``qkv_proj`` (rows: all query heads,
then all key heads, then all value heads).

Invariants:
- A token attends to itself and to earlier tokens of its own sequence only.
- The kernel is the workspace's shared document-causal attention,
  :func:`mizzen_plugins.attention.causal_thd_attention` (its ``"auto"`` implementation), called with
  the batch's :class:`~mizzen_plugins.thd.PackedLayout` so its plan is built once per batch and
  reused by every attention layer.
"""

from __future__ import annotations

import torch
from torch import nn

from mizzen_plugins.attention import causal_thd_attention
from mizzen_plugins.nemotron_h.config import NemotronHConfig
from mizzen_plugins.thd import PackedLayout

__all__ = ["CausalSelfAttention"]


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

    def forward(self, hidden: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        c = self.config
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = causal_thd_attention(
            q.unflatten(-1, (c.num_attention_heads, c.attention_head_dim)),
            k.unflatten(-1, (c.num_key_value_heads, c.attention_head_dim)),
            v.unflatten(-1, (c.num_key_value_heads, c.attention_head_dim)),
            layout,
            scale=c.attention_head_dim**-0.5,
        )
        return self.out_proj(out.flatten(-2))
