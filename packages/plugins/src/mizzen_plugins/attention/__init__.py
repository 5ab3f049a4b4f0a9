"""Attention kernels shared by the mizzen plugins (packed THD streams).

Public entry: :func:`causal_thd_attention` (document-causal attention over ``cu_seqlens``).
"""

from mizzen_plugins.attention.causal import (
    AttentionPieces,
    causal_attention_pieces,
    causal_thd_attention,
    useful_causal_flops,
)

__all__ = [
    "AttentionPieces",
    "causal_attention_pieces",
    "causal_thd_attention",
    "useful_causal_flops",
]
