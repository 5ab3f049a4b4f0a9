"""The one precision rule of the hybrid's sensitive arithmetic (norms, decays, dt, the scan).

Invariant: such arithmetic runs in ``promote_types(dtype, float32)``: float32 for bf16/fp16/fp32
activations, float64 for float64 ones (so float64 tests compare exactly, not at float32 rounding).
"""

from __future__ import annotations

import torch

__all__ = ["compute_dtype", "upcast"]


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype to do sensitive arithmetic on ``t`` in."""
    return torch.promote_types(t.dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its :func:`compute_dtype`."""
    return t.to(compute_dtype(t))
