"""DeepSeek-V4-style attention layer (toy scale, our own implementation).

Per token ``x``:

- queries go through an MLA-style low-rank bottleneck: ``q = W_qb(RMSNorm(W_qa x))``, ``H`` heads
  of ``nope + rope`` dims, the rope part rotated by the in-segment position;
- one shared key/value head ``kv = RMSNorm(W_kv x)`` (``nope + rope`` dims): the key is ``kv``
  with its rope part rotated, the value is ``kv`` itself;
- a per-head learned attention sink;
- a sliding window over the raw rows of the same segment;
- when ``compress_ratio = m > 0``: every ``m`` consecutive rows of a segment are pooled into one
  compressed entry with learned weights ``softmax_j(W_gate x_j + bias_j)`` (the rope part of the
  compressed key is rotated at the group's last position), and a small indexer picks the
  ``index_topk`` compressed entries each query attends to
  (:mod:`mizzen_plugins.deepseek_v4.indexer`);
- all branches share one softmax (:mod:`mizzen_plugins.deepseek_v4.kernels`), then ``W_o``.

Entry points: :meth:`DeepSeekV4Attention.forward` on a packed stream (THD; pass a
:class:`~mizzen_plugins.context_parallel.CPShard` and a process group for context parallelism)
and :meth:`DeepSeekV4Attention.forward_padded` on a right-padded batch (BSHD: every row is
computed at full padded length, pad outputs are zero).  Both return the indexer's choices as a
segment-local record that replays exactly (``topk=`` argument).

Invariants: packed and padded results agree at real tokens; a packed stream gives each sequence
exactly what it gets alone; CP gives each rank exactly its rows of the single-rank result; the
indexer receives no gradient through its discrete choice.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import nn

from mizzen_plugins.context_parallel import CPShard, all_gather_groups, exchange_left_halo
from mizzen_plugins.deepseek_v4.config import DeepSeekV4AttentionConfig
from mizzen_plugins.deepseek_v4.indexer import (
    from_record,
    select_fast,
    select_reference,
    to_local,
)
from mizzen_plugins.deepseek_v4.kernels import ATTENTION_IMPLS
from mizzen_plugins.deepseek_v4.stream import build_stream_plan
from mizzen_plugins.thd import PackedLayout

Impl = Literal["auto", "reference", "fast", "flex"]
_IMPLS = ("auto", "reference", "fast", "flex")


class AttentionOutput(NamedTuple):
    output: torch.Tensor
    topk: torch.Tensor | None  # segment-local group numbers, -1 unused; None when ratio == 0


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float):
    """Rotate the last ``rope_dim`` dims of ``x [T, ..., D]`` by ``positions [T]`` (rotate-half)."""
    if rope_dim == 0 or x.shape[0] == 0:
        return x
    cdt = torch.promote_types(x.dtype, torch.float32)
    half = rope_dim // 2
    inv = theta ** (-torch.arange(0, half, device=x.device, dtype=cdt) / half)
    ang = positions.to(cdt)[:, None] * inv[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].to(cdt)
    r1, r2 = rope[..., :half], rope[..., half:]
    rotated = torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _resolve_impl(impl: str) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl = {impl!r}: choose one of {', '.join(map(repr, _IMPLS))}")
    return "fast" if impl == "auto" else impl


@functools.lru_cache(maxsize=16)
def _uniform_layout(batch: int, seq_len: int, device: torch.device) -> PackedLayout:
    return PackedLayout([seq_len] * batch, device)


class DeepSeekV4Attention(nn.Module):
    def __init__(self, config: DeepSeekV4AttentionConfig):
        super().__init__()
        c = self.config = config
        d = c.head_dim
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.num_heads * d, bias=False)
        self.wkv = nn.Linear(c.hidden_size, d, bias=False)
        self.kv_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.sink = nn.Parameter(torch.zeros(c.num_heads))
        self.wo = nn.Linear(c.num_heads * d, c.hidden_size, bias=False)
        if c.compress_ratio > 0:
            self.pool_gate = nn.Linear(c.hidden_size, 1, bias=False)
            self.pool_position_bias = nn.Parameter(torch.zeros(c.compress_ratio))
            self.index_q = nn.Linear(c.q_lora_rank, c.index_heads * c.index_head_dim, bias=False)
            self.index_weight = nn.Linear(c.hidden_size, c.index_heads, bias=False)
            self.index_k = nn.Linear(c.hidden_size, c.index_head_dim, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        layout: PackedLayout | CPShard,
        *,
        process_group=None,
        topk: torch.Tensor | None = None,
        impl: Impl = "auto",
    ) -> AttentionOutput:
        """Packed stream ``hidden [T, hidden_size]`` -> ``AttentionOutput([T, hidden_size], topk)``.

        With a :class:`CPShard`, ``hidden`` holds this rank's rows (``shard.take(global)``) and
        ``process_group`` is the CP group (``None`` = the default group); every rank must call.
        ``topk``: a recorded ``[T, k]`` segment-local choice to replay instead of the indexer.
        """
        impl = _resolve_impl(impl)
        c = self.config
        shard = layout if isinstance(layout, CPShard) else None
        expected = shard.num_local_tokens if shard is not None else layout.num_tokens
        if hidden.dim() != 2 or hidden.shape != (expected, c.hidden_size):
            raise ValueError(
                f"hidden.shape = {tuple(hidden.shape)}: expected [{expected}, {c.hidden_size}] "
                "(the packed rows of this layout; use forward_padded for [B, S, hidden])"
            )
        plan = build_stream_plan(layout, c.window, c.compress_ratio, hidden.device)
        t, h, d = hidden.shape[0], c.num_heads, c.head_dim
        cq = self.q_norm(self.wq_a(hidden))
        q = apply_rope(self.wq_b(cq).view(t, h, d), plan.q_pos, c.rope_head_dim, c.rope_theta)
        kv = self.kv_norm(self.wkv(hidden))
        m = c.compress_ratio
        feats = kv if m == 0 else torch.cat([kv, self.pool_gate(hidden), self.index_k(hidden)], -1)
        if shard is not None:
            ext = exchange_left_halo(feats, shard, c.halo, process_group).rows
        else:
            ext = feats
        kv_ext = ext[:, :d]
        k_ext = apply_rope(kv_ext, plan.ext_pos, c.rope_head_dim, c.rope_theta)
        ck = cv = selected = record = None
        if m > 0:
            rows = ext[plan.own_group_rows]  # [Go, m, d + 1 + index_head_dim]
            alpha = torch.softmax(rows[..., d] + self.pool_position_bias, dim=1)
            payload = torch.cat([rows[..., :d], rows[..., d + 1 :]], dim=-1)
            pooled = (alpha[..., None] * payload).sum(dim=1)
            if shard is not None:
                pooled = all_gather_groups(pooled, shard, plan.groups, process_group)
            ckv, ik = pooled[:, :d], pooled[:, d:]
            ck = apply_rope(ckv, plan.groups.end_position, c.rope_head_dim, c.rope_theta)
            cv = ckv
            if topk is None:
                iq = self.index_q(cq).view(t, c.index_heads, c.index_head_dim)
                iw = self.index_weight(hidden) * c.index_heads**-0.5
                select = select_reference if impl == "reference" else select_fast
                selected = select(plan, iq.detach(), iw.detach(), ik.detach(), c.index_topk)
            else:
                selected = from_record(plan, topk)
            record = to_local(plan, selected)
        elif topk is not None:
            raise ValueError("topk was given but this layer has compress_ratio = 0 (no indexer)")
        if t == 0:
            out = q.new_zeros(0, h, d)
        else:
            v_ext = kv_ext  # the shared head: values are the un-rotated key rows
            out = ATTENTION_IMPLS[impl](plan, q, k_ext, v_ext, ck, cv, selected, self.sink, d**-0.5)
        return AttentionOutput(self.wo(out.reshape(t, h * d)), record)

    def forward_padded(
        self,
        hidden: torch.Tensor,
        lengths: Sequence[int] | torch.Tensor,
        *,
        topk: torch.Tensor | None = None,
        impl: Impl = "auto",
    ) -> AttentionOutput:
        """Right-padded ``hidden [B, S, hidden_size]`` -> ``([B, S, hidden_size], [B, S, k])``.

        Every row is computed at its full padded length ``S`` (the padded baseline); outputs at
        pad positions are zero and their top-k rows are ``-1``.
        """
        if hidden.dim() != 3:
            raise ValueError(f"hidden.shape = {tuple(hidden.shape)}: expected [B, S, hidden]")
        b, s, _ = hidden.shape
        lengths_t = torch.as_tensor(lengths, device=hidden.device, dtype=torch.long)
        if lengths_t.shape != (b,) or bool((lengths_t < 0).any() | (lengths_t > s).any()):
            raise ValueError(
                f"lengths = {lengths_t.tolist()}: need one length per row, each in 0..{s}"
            )
        layout = _uniform_layout(b, s, hidden.device)
        flat_topk = None if topk is None else topk.reshape(b * s, topk.shape[-1])
        res = self.forward(hidden.reshape(b * s, -1), layout, topk=flat_topk, impl=impl)
        valid = torch.arange(s, device=hidden.device)[None, :] < lengths_t[:, None]
        out = res.output.view(b, s, -1) * valid[..., None].to(res.output.dtype)
        rec = None
        if res.topk is not None:
            rec = torch.where(valid[..., None], res.topk.view(b, s, -1), -1)
        return AttentionOutput(out, rec)


class DeepSeekV4AttentionStack(nn.Module):
    """Pre-norm residual attention layers, one compression ratio per layer (0 = window only)."""

    def __init__(self, config: DeepSeekV4AttentionConfig, compress_ratios: Sequence[int]):
        super().__init__()
        self.norms = nn.ModuleList(
            nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps) for _ in compress_ratios
        )
        self.layers = nn.ModuleList(
            DeepSeekV4Attention(config.with_ratio(r)) for r in compress_ratios
        )

    def forward(
        self,
        hidden: torch.Tensor,
        layout: PackedLayout | CPShard,
        *,
        process_group=None,
        topk: Sequence[torch.Tensor | None] | None = None,
        impl: Impl = "auto",
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        if topk is not None and len(topk) != len(self.layers):
            raise ValueError(f"topk has {len(topk)} entries for {len(self.layers)} layers")
        records = []
        for i, (norm, layer) in enumerate(zip(self.norms, self.layers, strict=True)):
            res = layer(
                norm(hidden),
                layout,
                process_group=process_group,
                topk=None if topk is None else topk[i],
                impl=impl,
            )
            hidden = hidden + res.output
            records.append(res.topk)
        return hidden, records
