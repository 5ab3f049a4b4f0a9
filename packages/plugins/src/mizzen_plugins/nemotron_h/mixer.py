"""The Mamba-2-style selective state-space mixer of the hybrid (our implementation).

For the ``T`` packed tokens ``u [T, hidden]`` of a THD batch::

    z, xBC, dt = split(in_proj(u), [inner, conv_channels, heads])
    x, B, C    = split(silu(causal_depthwise_conv(xBC)), [inner, G*N, G*N])
    dt         = clamp(softplus(dt + dt_bias), *dt_limit)           # per head
    y          = selective_scan(x, dt, A = -exp(A_log), B, C) + D * x   # per-head decay exp(dt*A)
    out        = out_proj(rms_norm_per_group(y * silu(z)) * norm.weight)

Invariants:
- The convolution and the scan restart at every sequence start of the packed batch: each sequence's
  output equals running it alone.
- Parameter shapes follow Hugging Face NemotronH (``in_proj``, ``conv1d`` as ``[channels, K]``,
  ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``), so weights map one-to-one (see
  :mod:`mizzen_plugins.nemotron_h.weights`).
- Decay, ``dt``, skip and normalisation arithmetic run in at least float32 whatever the parameter
  dtype (:mod:`mizzen_plugins.nemotron_h.numerics`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mizzen_plugins.nemotron_h.config import NemotronHConfig
from mizzen_plugins.nemotron_h.conv import causal_depthwise_conv
from mizzen_plugins.nemotron_h.numerics import compute_dtype, upcast
from mizzen_plugins.nemotron_h.scan_backend import selective_scan
from mizzen_plugins.thd import PackedLayout

__all__ = ["GatedRMSNorm", "Mamba2Mixer"]


class GatedRMSNorm(nn.Module):
    """``weight * rms_norm(y * silu(z))``, RMS over groups of ``group_size``; at least float32
    inside, the result in ``z``'s dtype (the activations' dtype)."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        if size % group_size:
            raise ValueError(f"group_size {group_size} must divide size {size}")
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = upcast(y) * F.silu(upcast(z))
        groups = gated.unflatten(-1, (-1, self.group_size))
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(normed.dtype) * normed.flatten(-2)).to(z.dtype)


class Mamba2Mixer(nn.Module):
    """Input projection, causal depthwise conv, selective scan, gated norm, output projection."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.in_proj = nn.Linear(c.hidden_size, c.in_proj_size, bias=c.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(c.conv_channels, c.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(c.conv_channels)) if c.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(c.ssm_num_heads))
        self.A_log = nn.Parameter(torch.empty(c.ssm_num_heads))
        self.D = nn.Parameter(torch.empty(c.ssm_num_heads))
        self.norm = GatedRMSNorm(
            c.ssm_inner_size, group_size=c.ssm_inner_size // c.ssm_num_groups, eps=c.norm_eps
        )
        self.out_proj = nn.Linear(c.ssm_inner_size, c.hidden_size, bias=c.proj_bias)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        c = self.config
        for linear in (self.in_proj, self.out_proj):
            nn.init.normal_(linear.weight, std=c.initializer_range)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        bound = 1.0 / math.sqrt(c.conv_kernel)  # nn.Conv1d's default for a depthwise conv
        nn.init.uniform_(self.conv_weight, -bound, bound)
        if self.conv_bias is not None:
            nn.init.uniform_(self.conv_bias, -bound, bound)
        # A = -(1 .. heads): a spread of decay rates.  dt log-uniform in [dt_min, dt_max].
        self.A_log.copy_(torch.log(torch.arange(1, c.ssm_num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        log_dt = torch.rand(c.ssm_num_heads) * (math.log(c.dt_max) - math.log(c.dt_min))
        dt = torch.exp(log_dt + math.log(c.dt_min)).clamp(min=c.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt
        self.norm.weight.fill_(1.0)

    def forward(self, hidden: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        c = self.config
        T = hidden.shape[0]
        H, P, G, N = c.ssm_num_heads, c.ssm_head_dim, c.ssm_num_groups, c.ssm_state_size
        z, xBC, dt = self.in_proj(hidden).split([c.ssm_inner_size, c.conv_channels, H], dim=-1)
        xBC = F.silu(causal_depthwise_conv(xBC, self.conv_weight, self.conv_bias, layout.positions))
        x, B, C = xBC.split([c.ssm_inner_size, G * N, G * N], dim=-1)
        dt = F.softplus(upcast(dt) + self.dt_bias.to(compute_dtype(dt))).clamp(*c.dt_limit)
        A = -torch.exp(self.A_log.to(dt.dtype))
        x_heads = x.reshape(1, T, H, P)
        y = selective_scan(
            x_heads,
            dt.unsqueeze(0),
            A,
            B.reshape(1, T, G, N),
            C.reshape(1, T, G, N),
            chunk_size=c.chunk_size,
            seq_idx=layout.segment_ids.unsqueeze(0),
        )
        y = upcast(y) + upcast(x_heads) * self.D.to(compute_dtype(y))[:, None]
        y = self.norm(y.reshape(T, c.ssm_inner_size), z)
        return self.out_proj(y)
