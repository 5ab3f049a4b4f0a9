"""Packed (THD) batches for the hybrid: many sequences concatenated along one token axis.

A batch of sequences of lengths ``l_0, l_1, …`` is stored as ``[total_tokens, …]`` tensors plus
``cu_seqlens = [0, l_0, l_0 + l_1, …]`` (int32/int64, on the tokens' device).

Invariants:
- :func:`packed_sequences` validates ``cu_seqlens`` once per forward (1-D, starts at 0,
  non-decreasing, ends at the token count) and derives everything the layers need from it, so no
  layer re-derives or re-validates it.
- ``seq_idx[t]`` is the index of the sequence token ``t`` belongs to (non-decreasing);
  ``position[t]`` is ``t``'s offset inside its sequence.  Every recurrent or convolutional state
  restarts where ``position == 0``.  Empty sequences are allowed and own no token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

__all__ = ["PackedSequences", "packed_sequences", "uniform_cu_seqlens"]


@dataclass(frozen=True)
class PackedSequences:
    """The sequence structure of a packed batch, derived once from ``cu_seqlens``."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1], int64
    seq_idx: torch.Tensor  # [total_tokens], int64, non-decreasing
    position: torch.Tensor  # [total_tokens], int64, offset inside the sequence
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.seq_idx.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` token offsets of every non-empty sequence (one host sync)."""
        cu = self.cu_seqlens.tolist()
        return [(s, e) for s, e in itertools.pairwise(cu) if e > s]


def packed_sequences(cu_seqlens: torch.Tensor, num_tokens: int) -> PackedSequences:
    """Validate ``cu_seqlens`` for ``num_tokens`` packed tokens and derive ``seq_idx``/``position``."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries [0, ..., total_tokens], got shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    # One host sync for the three checks and max_seqlen.
    first, last, min_len, max_len = torch.stack(
        [cu[0], cu[-1], lengths.min(), lengths.max()]
    ).tolist()
    if first != 0 or last != num_tokens or min_len < 0:
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at the token count {num_tokens}; "
            f"got {cu_seqlens.tolist()}"
        )
    tokens = torch.arange(num_tokens, device=cu.device)
    seq_idx = torch.searchsorted(cu[1:], tokens, right=True)
    position = tokens - cu[seq_idx]
    return PackedSequences(cu_seqlens=cu, seq_idx=seq_idx, position=position, max_seqlen=max_len)


def uniform_cu_seqlens(batch: int, seqlen: int, device: torch.device | str) -> torch.Tensor:
    """``cu_seqlens`` of ``batch`` sequences of ``seqlen`` tokens each (a ``[B, L]`` batch)."""
    return torch.arange(batch + 1, device=device, dtype=torch.int64) * seqlen
