"""Sparse attention of DeepSeek-V4-style layers: sliding window + selected compressed + sink.

For query ``t`` with heads ``h`` the logits are, in one softmax:

- window: ``q[t,h] . k[s] * scale`` for raw rows ``s`` of the same segment with
  ``0 <= t - s < window`` (by global index);
- compressed: ``q[t,h] . ck[g] * scale`` for each selected group ``g`` (``-1`` slots ignored);
- sink: the learned per-head logit ``sink[h]``, which takes probability mass but adds no value.

The output is the probability-weighted sum of the raw values ``v[s]`` and compressed values
``cv[g]``.  All three implementations compute exactly this:

- ``reference``: loops over segments, a dense ``[H, Lq, Le + G_s + 1]`` logit matrix each, in
  float32 or wider (float64 stays float64).
- ``fast``: vectorised over the stream.  Extended rows are cut into blocks of ``window``; block
  ``n``'s queries see keys of blocks ``n-1`` and ``n`` (``2 * window`` candidates, masked by the
  plan), computed with two batched matmuls over ``unfold`` views; the selected compressed entries
  are gathered per query; one softmax over ``[2W + topk + 1]`` logits.  Any device, any dtype
  (half inputs are computed in float32).
- ``flex``: the window branch through FlexAttention (block mask over segment and global index,
  compiled on CUDA) returning its log-sum-exp; the compressed branch and the sink are merged in
  exactly by log-sum-exp weights.  Forward-only on CPU.

Queries of halo rows (context parallelism) are zero and their outputs are dropped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mizzen_plugins.deepseek_v4.stream import StreamPlan


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def attention_reference(plan: StreamPlan, q, k_ext, v_ext, ck, cv, selected, sink, scale):
    """``q [Tq,H,D]``, ``k_ext/v_ext [Te,D]``, ``ck/cv [G,D]``, ``selected [Tq,k]`` global ids."""
    cdt = _compute_dtype(q.dtype)
    cu = plan.groups.cu_groups.tolist() if plan.groups is not None else None
    outs = [q.new_zeros(0, q.shape[1], v_ext.shape[-1], dtype=cdt)]
    for s, q0, q1, e0, e1 in plan.segment_runs:
        qs = q[q0:q1].to(cdt).transpose(0, 1)  # [H, Lq, D]
        ks, vs = k_ext[e0:e1].to(cdt), v_ext[e0:e1].to(cdt)
        dist = plan.q_gidx[q0:q1, None] - plan.ext_gidx[None, e0:e1]
        allowed = (dist >= 0) & (dist < plan.window)
        logits = [(qs @ ks.T * scale).masked_fill(~allowed, float("-inf"))]
        values = [vs]
        if cu is not None and cu[s + 1] > cu[s]:
            g0, g1 = cu[s], cu[s + 1]
            ids = torch.arange(g0, g1, device=q.device)
            chosen = (selected[q0:q1, :, None] == ids[None, None, :]).any(dim=1)  # [Lq, Gs]
            logits.append((qs @ ck[g0:g1].to(cdt).T * scale).masked_fill(~chosen, float("-inf")))
            values.append(cv[g0:g1].to(cdt))
        logits.append(sink.to(cdt)[:, None, None].expand(-1, q1 - q0, 1))
        p = torch.softmax(torch.cat(logits, dim=-1), dim=-1)[..., :-1]
        o = p @ torch.cat(values, dim=0)  # [H, Lq, Dv]
        outs.append(o.transpose(0, 1))
    # segment runs are in query-row order and cover every query row
    return torch.cat(outs, dim=0).to(q.dtype)


def _no_groups(ck) -> bool:
    return ck is None or ck.shape[0] == 0


def _gather_selected(plan: StreamPlan, selected, ck, cv, te: int):
    sel_ext = torch.full((te, selected.shape[1]), -1, dtype=torch.long, device=selected.device)
    sel_ext[plan.q_in_ext] = selected
    take = sel_ext.clamp(min=0)
    return sel_ext, ck[take], cv[take]  # [Te,k], [Te,k,D], [Te,k,Dv]


def _queries_in_ext(plan: StreamPlan, q, te: int):
    return q.new_zeros(te, *q.shape[1:]).index_copy(0, plan.q_in_ext, q)


def attention_fast(plan: StreamPlan, q, k_ext, v_ext, ck, cv, selected, sink, scale):
    cdt = _compute_dtype(q.dtype)
    te, h, d = k_ext.shape[0], q.shape[1], q.shape[2]
    dv = v_ext.shape[-1]
    w = plan.window
    nb = max(1, math.ceil(te / w))
    rows = nb * w  # ext rows padded to whole blocks; pad rows see nothing but the sink
    q_pad = q.new_zeros(rows, h, d, dtype=cdt).index_copy(0, plan.q_in_ext, q.to(cdt) * scale)
    kb = F.pad(k_ext.to(cdt), (0, 0, w, rows - te)).unfold(0, 2 * w, w)  # [nb, D, 2W] view
    logits_w = torch.bmm(q_pad.view(nb, w * h, d), kb).view(rows, h, 2 * w)
    logits_w = logits_w.masked_fill_(~plan.block_window_mask[:, None, :], float("-inf"))
    parts = [logits_w]
    grouped = not _no_groups(ck)
    if grouped:
        sel_ext, ck_sel, cv_sel = _gather_selected(plan, selected, ck.to(cdt), cv.to(cdt), rows)
        logits_c = torch.einsum("thd,tkd->thk", q_pad, ck_sel)
        parts.append(logits_c.masked_fill_((sel_ext < 0)[:, None, :], float("-inf")))
    parts.append(sink.to(cdt).view(1, h, 1).expand(rows, h, 1))
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)  # [rows, H, 2W (+ k) + 1]
    vb = F.pad(v_ext.to(cdt), (0, 0, w, rows - te)).unfold(0, 2 * w, w).transpose(1, 2)
    # p[..., :2W] as [nb, W*H, 2W] is a strided view (row stride = p.shape[-1]): no copy
    out = torch.bmm(p[..., : 2 * w].view(nb, w * h, 2 * w), vb).view(rows, h, dv)
    if grouped:
        out = out + torch.einsum("thk,tkd->thd", p[..., 2 * w : -1], cv_sel)
    return out.index_select(0, plan.q_in_ext).to(q.dtype)


_COMPILED_FLEX = None


def _flex_with_lse(q4, k4, v4, block_mask, scale):
    from torch.nn.attention import flex_attention as fa

    global _COMPILED_FLEX
    fn = fa.flex_attention
    if q4.is_cuda:
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(fa.flex_attention, dynamic=False)
        fn = _COMPILED_FLEX
    if hasattr(fa, "AuxRequest"):
        out, aux = fn(
            q4,
            k4,
            v4,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=True,
            return_aux=fa.AuxRequest(lse=True),
        )
        return out, aux.lse
    return fn(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True)


def attention_flex(plan: StreamPlan, q, k_ext, v_ext, ck, cv, selected, sink, scale):
    from torch.nn.attention.flex_attention import create_block_mask

    te, h = k_ext.shape[0], q.shape[1]
    gidx, seg, w = plan.ext_gidx, plan.ext_seg, plan.window

    def window_mask(b, hh, qi, ki):
        dist = gidx[qi] - gidx[ki]
        return (seg[qi] == seg[ki]) & (dist >= 0) & (dist < w)

    block_mask = plan.layout.cached(
        ("dsv4_flex_mask", id(plan), q.device),
        lambda: create_block_mask(
            window_mask, None, None, te, te, device=q.device, _compile=q.is_cuda
        ),
    )
    q_ext = _queries_in_ext(plan, q, te)
    out_w, lse_w = _flex_with_lse(
        q_ext.transpose(0, 1)[None], k_ext[None, None], v_ext[None, None], block_mask, scale
    )
    cdt = _compute_dtype(q.dtype)
    out_w = out_w[0].transpose(0, 1).to(cdt)  # [Te, H, Dv]
    lse_w = lse_w[0].transpose(0, 1).to(cdt)  # [Te, H]
    logs = [lse_w[..., None]]
    if not _no_groups(ck):
        sel_ext, ck_sel, cv_sel = _gather_selected(plan, selected, ck.to(cdt), cv.to(cdt), te)
        logits_c = torch.einsum("thd,tkd->thk", q_ext.to(cdt), ck_sel) * scale
        logs.append(logits_c.masked_fill((sel_ext < 0)[:, None, :], float("-inf")))
    logs.append(sink.to(cdt).view(1, h, 1).expand(te, h, 1))
    weights = torch.softmax(torch.cat(logs, dim=-1), dim=-1)  # [Te, H, 1 + k + 1]
    out = weights[..., :1] * out_w
    if not _no_groups(ck):
        out = out + torch.einsum("thk,tkd->thd", weights[..., 1 : 1 + sel_ext.shape[1]], cv_sel)
    return out.index_select(0, plan.q_in_ext).to(q.dtype)


ATTENTION_IMPLS = {
    "reference": attention_reference,
    "fast": attention_fast,
    "flex": attention_flex,
}
