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
- ``fast``: one autograd node (:class:`_SparseAttention`).  The window branch runs a window
  kernel that returns its output and log-sum-exp: torch's flash varlen kernel with
  ``window_size_left = W - 1`` over runs of extended rows (half precision on CUDA), else a blocked
  kernel (blocks of ``W``: block ``n``'s queries see blocks ``n-1, n``; any device, float32 or
  wider).  The ``k`` selected compressed entries are gathered per query (in row chunks of bounded
  memory), and window, compressed logits and sink meet in one float32 softmax over ``[1 + k + 1]``
  terms.  Backward calls the window kernel's own backward with the output gradient scaled by the
  window's weight and the *merged* output (exact: its ``rowsum(dO * O)`` is then the merged
  softmax's), and computes the compressed and sink parts directly.
- ``flex``: the window branch through FlexAttention (block mask over segment and global index,
  compiled on CUDA) returning its log-sum-exp; the compressed branch and the sink are merged in
  exactly by log-sum-exp weights.  Forward-only on CPU.

Queries of halo rows (context parallelism) are zero and their outputs are dropped.
"""

from __future__ import annotations

import math
import warnings

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


# -- fast: one autograd node, window kernel + gathered compressed entries + sink ----------------
# Set to False to force the blocked window kernel on GPU too (benchmarks, debugging).
FLASH_WINDOW = True
_FLASH_FAILED: list[str] = []


class _BlockedWindow:
    """Sliding window over ext rows by blocks of ``W``: block ``n``'s queries see blocks ``n-1, n``.

    Any device and dtype (computed in float32 or wider).  ``forward`` returns the window-only
    output and its log-sum-exp; ``backward`` follows the flash kernel contract: given ``dO`` and
    an output ``O``, ``dS = P * (dO . v - rowsum(dO * O))``.
    """

    def __init__(self, plan: StreamPlan, scale: float):
        self.plan, self.scale = plan, scale

    def _blocks(self, q, k, v):
        w, te = self.plan.window, k.shape[0]
        nb = max(1, math.ceil(te / w))
        rows = nb * w
        qp = F.pad(q, (0, 0, 0, 0, 0, rows - te))
        kb = F.pad(k, (0, 0, w, rows - te)).unfold(0, 2 * w, w)  # [nb, D, 2W] view
        vb = F.pad(v, (0, 0, w, rows - te)).unfold(0, 2 * w, w).transpose(1, 2)  # [nb, 2W, Dv]
        return w, te, nb, rows, qp, kb, vb

    def _logits(self, qp, kb, nb, w, rows, h):
        logits = torch.bmm(qp.view(nb, w * h, -1), kb).view(rows, h, 2 * w) * self.scale
        return logits.masked_fill_(~self.plan.block_window_mask[:, None, :], float("-inf"))

    def forward(self, q, k, v):
        w, te, nb, rows, qp, kb, vb = self._blocks(q, k, v)
        h = q.shape[1]
        logits = self._logits(qp, kb, nb, w, rows, h)
        lse = torch.logsumexp(logits, dim=-1)  # pad rows see nothing: -inf
        p = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
        out = torch.bmm(p.view(nb, w * h, 2 * w), vb).view(rows, h, -1)
        return out[:te], lse[:te]

    def backward(self, d_out, q, k, v, out, lse):
        w, te, nb, rows, qp, kb, vb = self._blocks(q, k, v)
        h, d, dv = q.shape[1], q.shape[2], v.shape[1]
        logits = self._logits(qp, kb, nb, w, rows, h)
        p = torch.exp(logits - F.pad(lse, (0, 0, 0, rows - te))[..., None])
        dop = F.pad(d_out, (0, 0, 0, 0, 0, rows - te)).view(nb, w * h, dv)
        delta = F.pad((d_out * out).sum(-1), (0, 0, 0, rows - te))
        dp = torch.bmm(dop, vb.transpose(1, 2)).view(rows, h, 2 * w)
        ds = (p * (dp - delta[..., None])).view(nb, w * h, 2 * w)
        dq = torch.bmm(ds, kb.transpose(1, 2)).view(rows, h, d)[:te] * self.scale
        dk_b = torch.bmm(ds.transpose(1, 2), qp.view(nb, w * h, d)) * self.scale  # [nb, 2W, D]
        dv_b = torch.bmm(p.view(nb, w * h, 2 * w).transpose(1, 2), dop)  # [nb, 2W, Dv]

        def fold(blocks):  # block n's slot j is padded key row n*W + j; drop the W lead rows
            full = blocks.new_zeros((nb + 1) * w, blocks.shape[-1])
            full[: nb * w] += blocks[:, :w].reshape(nb * w, -1)
            full[w:] += blocks[:, w:].reshape(nb * w, -1)
            return full[w : w + te]

        return dq, fold(dk_b), fold(dv_b)


class _FlashWindow:
    """The window through torch's flash varlen kernel (``window_size_left = W - 1``) per ext run.

    Half-precision CUDA only.  The single key/value head is broadcast by the kernel (MQA).
    """

    def __init__(self, plan: StreamPlan, scale: float):
        self.plan, self.scale = plan, scale
        self.cu, self.max_len = plan.ext_runs
        self.state = None

    def _window(self):
        return {"window_size_left": self.plan.window - 1, "window_size_right": 0}

    def forward(self, q, k, v):
        k3, v3 = k.contiguous()[:, None], v.contiguous()[:, None]
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q.contiguous(), k3, v3, self.cu, self.cu, self.max_len, self.max_len, 0.0, True,
            False, scale=self.scale, **self._window(),
        )  # fmt: skip
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"unexpected varlen log-sum-exp shape {tuple(lse.shape)}")
        self.state = (lse, rng, unused)
        return out, lse.t()

    def backward(self, d_out, q, k, v, out, lse):
        lse_raw, rng, unused = self.state
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            d_out.contiguous(), q.contiguous(), k.contiguous()[:, None], v.contiguous()[:, None],
            out.contiguous(), lse_raw, self.cu, self.cu, self.max_len, self.max_len, 0.0, True,
            rng, unused, scale=self.scale, **self._window(),
        )  # fmt: skip
        return dq, dk[:, 0], dv[:, 0]


def _flash_window_usable(q, v) -> bool:
    return (
        FLASH_WINDOW
        and not _FLASH_FAILED
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] == v.shape[-1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


_CHUNK_ELEMS = 1 << 27  # gathered compressed rows per chunk (512 MB in float32)


def _row_chunks(sel: torch.Tensor, width: int):
    """``(r0, r1, flat group ids)`` over query rows, bounding the gathered ``[n, k, D]`` rows."""
    te, kk = sel.shape
    step = max(1, _CHUNK_ELEMS // max(1, kk * width))
    for r0 in range(0, te, step):
        r1 = min(te, r0 + step)
        yield r0, r1, sel[r0:r1].clamp(min=0).flatten()


class _SparseAttention(torch.autograd.Function):
    """Window + selected compressed entries + sink in one softmax, over extended rows.

    Forward: the window kernel gives ``(o_w, lse_w)``; the compressed logits of the ``k`` selected
    entries and the sink join ``lse_w`` in one softmax over ``[1 + k + 1]`` terms, whose first
    weight ``w_w`` scales ``o_w``.  Backward, with ``O`` the merged output and
    ``D = rowsum(dO * O)``: the window kernel's own backward with ``(w_w * dO, O)`` gives exactly
    the window part of the merged softmax gradient; the compressed part and the sink are a few
    batched products here.  Merge arithmetic in float32 or wider.
    """

    @staticmethod
    def forward(ctx, q, k, v, ck, cv, sel, sink, plan: StreamPlan, scale: float):
        cdt = _compute_dtype(q.dtype)
        te, h = q.shape[0], q.shape[1]
        dtypes = (q.dtype, k.dtype, v.dtype, sink.dtype)
        window = None
        if _flash_window_usable(q, v):
            try:
                window = _FlashWindow(plan, scale)
                o_w, lse_w = window.forward(q, k, v)
            except RuntimeError as exc:  # an old torch or an unsupported shape: fall back once
                _FLASH_FAILED.append(f"{type(exc).__name__}: {exc}"[:300])
                warnings.warn(
                    f"flash varlen window kernel unavailable ({_FLASH_FAILED[0]}); using the "
                    "blocked window kernel",
                    RuntimeWarning,
                    stacklevel=2,
                )
                window = None
        if window is None:
            window = _BlockedWindow(plan, scale)
            q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
            o_w, lse_w = window.forward(q, k, v)
        grouped = ck is not None
        parts = [lse_w.to(cdt)[..., None]]
        if grouped:
            logits_c = q.new_empty(te, h, sel.shape[1], dtype=cdt)
            ck_c, cv_c = ck.to(cdt), cv.to(cdt)
            for r0, r1, take in _row_chunks(sel, ck.shape[-1] + cv.shape[-1]):
                ck_sel = ck_c.index_select(0, take).view(r1 - r0, sel.shape[1], -1)
                torch.bmm(q[r0:r1].to(cdt), ck_sel.transpose(1, 2), out=logits_c[r0:r1])
            logits_c.mul_(scale).masked_fill_((sel < 0)[:, None, :], float("-inf"))
            parts.append(logits_c)
        parts.append(sink.to(cdt).view(1, h, 1).expand(te, h, 1))
        probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)  # [Te, H, 1 (+ k) + 1]
        del parts
        out = probs[..., :1] * o_w.to(cdt)
        if grouped:
            for r0, r1, take in _row_chunks(sel, ck.shape[-1] + cv.shape[-1]):
                cv_sel = cv_c.index_select(0, take).view(r1 - r0, sel.shape[1], -1)
                out[r0:r1].baddbmm_(probs[r0:r1, :, 1:-1], cv_sel)
        ctx.window, ctx.scale, ctx.grouped = window, scale, grouped
        ctx.dtypes = dtypes
        ctx.save_for_backward(q, k, v, ck, cv, sel, out, probs, lse_w)
        return out  # compute dtype; the caller casts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k, v, ck, cv, sel, out, probs, lse_w = ctx.saved_tensors
        window, scale = ctx.window, ctx.scale
        cdt = out.dtype
        d_out = d_out.to(cdt)
        delta = (d_out * out).sum(-1)  # [Te, H]
        wdt = q.dtype  # the window kernel's dtype (half for flash, cdt for blocked)
        dq, dk, dv = window.backward((probs[..., :1] * d_out).to(wdt), q, k, v, out.to(wdt), lse_w)
        dq = dq.to(cdt)
        d_sink = -(probs[..., -1] * delta).sum(0)
        d_ck = d_cv = None
        if ctx.grouped:
            kk = sel.shape[1]
            d_ck = torch.zeros(ck.shape, dtype=cdt, device=ck.device)
            d_cv = torch.zeros(cv.shape, dtype=cdt, device=cv.device)
            ck_c, cv_c = ck.to(cdt), cv.to(cdt)
            for r0, r1, take in _row_chunks(sel, ck.shape[-1] + cv.shape[-1]):
                n = r1 - r0
                ck_sel = ck_c.index_select(0, take).view(n, kk, -1)
                cv_sel = cv_c.index_select(0, take).view(n, kk, -1)
                p_c = probs[r0:r1, :, 1:-1]
                dl = torch.bmm(d_out[r0:r1], cv_sel.transpose(1, 2)).sub_(delta[r0:r1, :, None])
                dl.mul_(p_c)  # [n, H, k]
                dq[r0:r1].baddbmm_(dl, ck_sel, alpha=scale)
                d_ck_sel = torch.bmm(dl.transpose(1, 2), q[r0:r1].to(cdt)).mul_(scale)
                d_ck.index_add_(0, take, d_ck_sel.view(n * kk, -1))
                d_cv_sel = torch.bmm(p_c.transpose(1, 2), d_out[r0:r1])
                d_cv.index_add_(0, take, d_cv_sel.view(n * kk, -1))
            d_ck, d_cv = d_ck.to(ck.dtype), d_cv.to(cv.dtype)
        qd, kd, vd, sd = ctx.dtypes
        return dq.to(qd), dk.to(kd), dv.to(vd), d_ck, d_cv, None, d_sink.to(sd), None, None


def attention_fast(plan: StreamPlan, q, k_ext, v_ext, ck, cv, selected, sink, scale):
    te = k_ext.shape[0]
    cp = plan.shard is not None
    grouped = not _no_groups(ck)
    q_ext = _queries_in_ext(plan, q, te) if cp else q
    sel_ext = None
    if grouped:
        sel_ext = selected
        if cp:
            sel_ext = selected.new_full((te, selected.shape[1]), -1)
            sel_ext[plan.q_in_ext] = selected
    out = _SparseAttention.apply(
        q_ext,
        k_ext,
        v_ext,
        ck if grouped else None,
        cv if grouped else None,
        sel_ext,
        sink,
        plan,
        scale,
    )
    out = out.to(q.dtype)
    return out.index_select(0, plan.q_in_ext) if cp else out


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
