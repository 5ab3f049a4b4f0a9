"""The mixer's short causal depthwise convolution over a packed (THD) token axis.

``out[t, c] = bias[c] + sum_k weight[c, K-1-k] * x[t-k, c]`` over the ``k < K`` with
``t - k`` in the same sequence as ``t``: the convolution restarts at every sequence start, exactly as
if each sequence were convolved alone with zero left padding.

Invariants:
- ``weight`` is ``[channels, K]``; ``weight[:, K-1]`` multiplies the current token (the layout of
  ``torch.nn.Conv1d(groups=channels, padding=K-1)`` with its singleton axis squeezed, so checkpoint
  weights map by a reshape).
- ``K`` shifted, masked multiply-adds: no Python loop over tokens or sequences, no host sync; the
  tap mask comes from ``position`` (the token's offset in its sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_depthwise_conv"]


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, position: torch.Tensor
) -> torch.Tensor:
    """``x [T, C]``, ``weight [C, K]``, ``bias [C]`` or None, ``position [T]`` -> ``[T, C]``."""
    T, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"conv weight must be [{channels}, K], got {tuple(weight.shape)}")
    if position.shape != (T,):
        raise ValueError(f"position must be [{T}], got {tuple(position.shape)}")
    K = weight.shape[1]
    out = x * weight[:, K - 1]
    for shift in range(1, K):
        earlier = F.pad(x, (0, 0, shift, 0))[:T]  # earlier[t] = x[t - shift] (0 before t = 0)
        in_sequence = (position >= shift).unsqueeze(-1)
        out = out + torch.where(in_sequence, earlier, 0.0) * weight[:, K - 1 - shift]
    if bias is not None:
        out = out + bias
    return out
