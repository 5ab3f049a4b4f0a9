"""Document-causal attention over a packed (THD) token stream.

``causal_thd_attention(q, k, v, cu_seqlens)`` computes, for every segment of the stream, ordinary
causal softmax attention of that segment's queries over that segment's keys and nothing else.

Implementations (``impl``):

- ``"reference"``: a plain loop over segments with an explicit mask and softmax, computed in
  ``float32`` or wider (``float64`` stays ``float64``).  The ground truth for tests.
- ``"fast"``: segments are bucketed by length (:func:`mizzen_plugins.thd.plan_length_buckets`,
  batches split into powers of two), each bucket gathered into a right-padded ``[n, P, heads,
  dim]`` buffer and run, as a ``[n, heads, P, dim]`` view, through one
  ``scaled_dot_product_attention(is_causal=True)`` call; output rows are copied back with one
  multi-tensor copy.  Right padding plus the causal mask means no real query ever sees a pad key,
  so no mask tensor is needed and torch picks its fastest dense causal kernel (cuDNN on Hopper).
  Pad rows are copies of real rows; their outputs are dropped and their output gradient is zero,
  so they send no gradient anywhere.  The whole bucketed computation is one autograd node (no
  zero-filled full-size gradients, no scatter-adds).  On CUDA a bucket shape the process has not
  run yet takes the flash kernel during a plan's first call, and from the second call on torch's
  default choice (cuDNN builds its graph once per shape and process, tens of ms).
- ``"varlen"``: torch's flash varlen kernel directly on the packed stream (CUDA, half precision;
  whole segments only).  No copies and nothing to build.
- ``"cudnn"``: cuDNN's fused attention on the packed stream as ragged tensors, one kernel per
  direction (:mod:`mizzen_plugins.attention.cudnn_ragged`; Hopper or later, half precision,
  whole segments only, needs the optional ``nvidia-cudnn-frontend`` package).
- ``"flex"``: FlexAttention with a document-causal block mask (compiled on CUDA).  Forward-only
  on CPU (torch does not implement its backward there).
- ``"auto"``: ``"cudnn"`` where it can run and its padded softmax statistics weigh no more than
  the queries; otherwise ``"fast"``, except the first call of a layout whose bucket shapes are not
  all built yet runs ``"varlen"`` where it applies (a layout used once never pays for cuDNN
  builds).

The generalised entry :func:`causal_attention_pieces` serves context parallelism: each *piece*
pairs a run of query rows with a run of key rows of one segment, aligned bottom-right (the last
query sees the last key), so a rank can attend its local queries to all-gathered keys.

Invariants: outputs have q's dtype and shape ``[tokens, heads_q, dim_v]``; ``heads_q`` must be a
multiple of ``heads_kv`` (grouped-query attention); a segment of length 0 contributes nothing; no
query attends outside its segment or to a later position.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from mizzen_plugins.attention import cudnn_ragged
from mizzen_plugins.thd import PackedLayout, plan_length_buckets

__all__ = [
    "AttentionPieces",
    "causal_attention_pieces",
    "causal_thd_attention",
    "useful_causal_flops",
]

Impl = Literal["auto", "reference", "fast", "flex", "varlen", "cudnn"]
_IMPLS = ("auto", "reference", "fast", "flex", "varlen", "cudnn")

# One more SDPA call (forward + backward launches and Python) costs roughly this much time; the
# bucket planner trades it against padded quadratic work at about this many FLOP/s.
_CALL_OVERHEAD_S = 40e-6
_ASSUMED_FLOPS = 450e12


@dataclass(frozen=True)
class AttentionPieces:
    """Runs of query rows attending to runs of key rows, bottom-right causal.

    Piece ``i``: queries ``q[q_start[i] : q_start[i] + q_len[i]]`` attend to keys
    ``k[k_start[i] : k_start[i] + k_len[i]]``; query ``j`` of the piece sees keys
    ``0 .. k_len - q_len + j`` of the piece.  ``k_len >= q_len`` always.
    """

    q_start: tuple[int, ...]
    k_start: tuple[int, ...]
    q_len: tuple[int, ...]
    k_len: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.q_start)
        if not (len(self.k_start) == len(self.q_len) == len(self.k_len) == n):
            raise ValueError("AttentionPieces fields must all have one entry per piece")
        for i in range(n):
            if self.k_len[i] < self.q_len[i] or self.q_len[i] < 0:
                raise ValueError(
                    f"piece {i}: q_len = {self.q_len[i]}, k_len = {self.k_len[i]}; bottom-right "
                    "causal pieces need 0 <= q_len <= k_len"
                )

    @classmethod
    def from_layout(cls, layout: PackedLayout) -> AttentionPieces:
        return cls(layout.starts, layout.starts, layout.lengths, layout.lengths)

    @property
    def num_pieces(self) -> int:
        return len(self.q_start)


def causal_thd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int] | PackedLayout,
    *,
    max_seqlen: int | None = None,
    scale: float | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Causal attention inside each segment of a packed stream.

    Args:
        q: ``[tokens, heads_q, dim]``.
        k: ``[tokens, heads_kv, dim]`` with ``heads_q % heads_kv == 0``.
        v: ``[tokens, heads_kv, dim_v]``.
        cu_seqlens: ``[num_segments + 1]`` int tensor ``[0, L0, L0+L1, ...]`` (one host sync to
            read it), or a :class:`~mizzen_plugins.thd.PackedLayout` (no sync; its bucket plan is
            cached on it, so pass the same layout to every layer).
        max_seqlen: optional, flash-style; checked against the real longest segment.
        scale: softmax scale, default ``dim ** -0.5``.
        impl: ``"auto"`` | ``"reference"`` | ``"fast"`` | ``"flex"`` | ``"varlen"`` |
            ``"cudnn"`` (see module docstring).

    Returns:
        ``[tokens, heads_q, dim_v]`` in q's dtype.
    """
    layout = (
        cu_seqlens
        if isinstance(cu_seqlens, PackedLayout)
        else PackedLayout.from_cu_seqlens(cu_seqlens)
    )
    _check_qkv(q, k, v, same_tokens=True)
    if q.shape[0] != layout.num_tokens:
        raise ValueError(
            f"q.shape[0] = {q.shape[0]} but cu_seqlens describes {layout.num_tokens} tokens; "
            "pass the cu_seqlens of this packed batch"
        )
    if max_seqlen is not None and max_seqlen < layout.max_seqlen:
        raise ValueError(
            f"max_seqlen = {max_seqlen} but the longest segment has {layout.max_seqlen} tokens; "
            "pass max(lengths) or leave max_seqlen unset"
        )
    auto = impl == "auto"
    impl = _resolve_impl(impl)
    if impl == "cudnn" or (auto and _cudnn_preferred(q, k, v, layout)):
        return _cudnn_causal(q, k, v, layout, scale)
    if impl == "flex":
        return _flex_document_causal(q, k, v, layout.to(q.device), scale)
    if impl == "varlen" or (auto and _varlen_first(q, k, v, layout)):
        return _varlen_causal(q, k, v, layout, scale)
    pieces = AttentionPieces.from_layout(layout)
    return causal_attention_pieces(q, k, v, pieces, scale=scale, impl=impl, plan_owner=layout)


def causal_attention_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: AttentionPieces,
    *,
    scale: float | None = None,
    impl: Impl = "auto",
    plan_owner: PackedLayout | None = None,
) -> torch.Tensor:
    """Bottom-right causal attention over ``pieces`` (see :class:`AttentionPieces`).

    Every query row must belong to exactly one piece.  ``plan_owner``, when given, caches the
    gather plan (keyed by the pieces) so repeated calls reuse it.
    """
    _check_qkv(q, k, v, same_tokens=False)
    covered = sum(pieces.q_len)
    if covered != q.shape[0]:
        raise ValueError(
            f"pieces cover {covered} query rows but q has {q.shape[0]}; every query row must "
            "belong to exactly one piece"
        )
    impl = _resolve_impl(impl)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if impl in ("flex", "varlen", "cudnn"):
        raise ValueError(
            f'impl="{impl}" runs whole segments only (causal_thd_attention); use "fast" or '
            '"reference" for pieces'
        )
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    if impl == "reference":
        return _reference_pieces(q, k, v, pieces, scale)
    return _fast_pieces(q, k, v, pieces, scale, plan_owner)


# -- validation ----------------------------------------------------------------------------------
def _resolve_impl(impl: str) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl = {impl!r}: choose one of {', '.join(map(repr, _IMPLS))}")
    return "fast" if impl == "auto" else impl


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_tokens: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name}.shape = {tuple(t.shape)}: expected [tokens, heads, dim] (THD)"
            )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k.shape = {tuple(k.shape)}, v.shape = {tuple(v.shape)}: k and v need the same "
            "tokens and heads"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q dim {q.shape[-1]} != k dim {k.shape[-1]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"heads_q = {q.shape[1]} is not a multiple of heads_kv = {k.shape[1]} "
            "(grouped-query attention needs heads_q % heads_kv == 0)"
        )
    if same_tokens and q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k has {k.shape[0]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")


# -- reference -----------------------------------------------------------------------------------
def _reference_pieces(q, k, v, pieces: AttentionPieces, scale: float) -> torch.Tensor:
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, ql, kl in zip(
        pieces.q_start, pieces.k_start, pieces.q_len, pieces.k_len, strict=True
    ):
        if ql == 0:
            continue
        qi = q[qs : qs + ql].to(compute).transpose(0, 1)  # [H, ql, D]
        ki = k[ks : ks + kl].to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v[ks : ks + kl].to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(-1, -2) * scale  # [H, ql, kl]
        qpos = torch.arange(ql, device=q.device)[:, None] + (kl - ql)
        kpos = torch.arange(kl, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ vi).transpose(0, 1))
    # pieces need not be in q-row order: place each piece's rows where they belong
    order = [i for i in range(pieces.num_pieces) if pieces.q_len[i] > 0]
    rows = torch.cat(
        [torch.arange(pieces.q_start[i], pieces.q_start[i] + pieces.q_len[i]) for i in order]
    ).to(q.device)
    out = torch.cat(outs, dim=0)
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(rows.numel(), device=q.device)
    return out.index_select(0, inverse).to(q.dtype)


# -- fast: length-bucketed dense causal SDPA, one autograd node ---------------------------------
# Bucket batch sizes are powers of two, so the set of (n, P) shapes a process ever runs stays
# small: cuDNN builds one execution graph per shape (tens of ms each), then reuses it.
POW2_BATCHES = True
# Shapes already run with torch's default SDPA choice (cuDNN on Hopper) in this process.
_BUILT_SHAPES: set[tuple] = set()


@dataclass(frozen=True)
class _BucketPlan:
    """Where every padded slot of the bucketed batch reads from and writes to.

    The padded batch is one ``[N, heads, dim]`` buffer cut into square buckets ``(offset, n, P)``:
    ``n`` pieces of ``P`` slots each, viewed as ``[n, heads, P, dim]`` without a copy.  Piece slot
    ``j`` holds key ``j`` of the piece (pad slots repeat the last key) and, for a piece of
    ``q_len < k_len`` queries (bottom-right, context parallel), query ``j - (k_len - q_len)``, so a
    plain top-left causal mask gives every real query exactly its keys.  Pad slots hold copies of
    real rows (finite values); their outputs are dropped and their incoming gradient is zero, so
    they send no gradient anywhere.
    """

    q_src: torch.Tensor  # [N] q row copied into each slot
    k_src: torch.Tensor  # [N] k/v row copied into each slot
    pad_q_slots: torch.Tensor  # slots holding no real query (output gradient forced to zero)
    buckets: tuple[tuple[int, int, int], ...]  # (slot offset, n, P)
    q_spans: tuple[tuple[int, int, int, int], ...]  # (bucket, local slot, q row, q_len)
    k_spans: tuple[tuple[int, int, int, int], ...]  # (bucket, local slot, k row, k_len)
    keys_disjoint: bool  # no key row in two pieces (always, without context parallelism)
    keys_cover_all: bool  # every key row in some piece
    calls: list[int]  # [number of forward calls so far] (mutable: backend policy)


def _split_pow2(members: list[int], k_lens: list[int], align: int) -> list[tuple[int, list[int]]]:
    """Split a bucket into power-of-two batches, longest pieces first, each padded to its max."""
    members = sorted(members, key=lambda i: -k_lens[i])
    out, start, n = [], 0, len(members)
    while start < n:
        size = 1 << ((n - start).bit_length() - 1)
        group = members[start : start + size]
        out.append((math.ceil(k_lens[group[0]] / align) * align, group))
        start += size
    return out


def _build_bucket_plan(
    pieces: AttentionPieces, num_q: int, num_k: int, call_cost: float, device
) -> _BucketPlan:
    live = [i for i in range(pieces.num_pieces) if pieces.q_len[i] > 0]
    k_lens = [pieces.k_len[i] for i in live]
    groups: list[tuple[int, list[int]]] = []
    for b in plan_length_buckets(k_lens, align=64, call_cost=call_cost):
        if POW2_BATCHES:
            groups.extend(_split_pow2(list(b.members), k_lens, 64))
        else:
            groups.append((b.padded_length, list(b.members)))
    # per piece (in slot order): its bucket's P and its first slot; then all slots at once
    order, piece_p, piece_base, q_spans, k_spans, shapes = [], [], [], [], [], []
    offset = 0
    for bucket, (p, members) in enumerate(groups):
        for m, member in enumerate(members):
            i = live[member]
            order.append(i)
            piece_p.append(p)
            piece_base.append(offset + m * p)
            q_len, k_len = pieces.q_len[i], pieces.k_len[i]
            q_spans.append((bucket, m * p + k_len - q_len, pieces.q_start[i], q_len))
            k_spans.append((bucket, m * p, pieces.k_start[i], k_len))
        shapes.append((offset, len(members), p))
        offset += len(members) * p

    def field(values):
        return torch.tensor([values[i] for i in order], dtype=torch.long)

    qs, ks, ql, kl = (
        field(f) for f in (pieces.q_start, pieces.k_start, pieces.q_len, pieces.k_len)
    )
    reps = torch.tensor(piece_p, dtype=torch.long)
    pid = torch.repeat_interleave(torch.arange(len(order)), reps, output_size=offset)
    j = torch.arange(offset) - torch.tensor(piece_base, dtype=torch.long)[pid]
    qpos = j - (kl - ql)[pid]  # query index inside the piece held by each slot
    q_src = qs[pid] + torch.minimum(qpos.clamp(min=0), ql[pid] - 1)
    k_src = ks[pid] + torch.minimum(j, kl[pid] - 1)
    pad_q = ((qpos < 0) | (j >= kl[pid])).nonzero().flatten()
    covered = sorted((k0, k0 + n) for _, _, k0, n in k_spans)
    disjoint = all(a[1] <= b[0] for a, b in itertools.pairwise(covered))
    return _BucketPlan(
        q_src=q_src.to(device),
        k_src=k_src.to(device),
        pad_q_slots=pad_q.to(device),
        buckets=tuple(shapes),
        q_spans=tuple(sorted(q_spans, key=lambda x: x[2])),
        k_spans=tuple(sorted(k_spans, key=lambda x: x[2])),
        keys_disjoint=disjoint,
        keys_cover_all=disjoint and sum(n for _, _, _, n in k_spans) == num_k,
        calls=[0],
    )


def _bucket_views(x: torch.Tensor, offset: int, n: int, p: int) -> torch.Tensor:
    """Slots ``offset : offset + n*p`` of a ``[N, heads, dim]`` buffer as ``[n, heads, P, dim]``."""
    return x[offset : offset + n * p].view(n, p, x.shape[1], x.shape[2]).transpose(1, 2)


def _flat(xb: torch.Tensor) -> torch.Tensor:
    """``[n, heads, P, dim]`` -> ``[n*P, heads, dim]`` (a view when memory is ``[n, P, h, d]``)."""
    n, h, p, d = xb.shape
    return xb.transpose(1, 2).reshape(n * p, h, d)


def _copy_spans(dst: torch.Tensor, srcs: list[torch.Tensor], spans) -> None:
    """``dst[row : row + n] = srcs[bucket][slot : slot + n]`` for every span, one launch."""
    if spans:
        torch._foreach_copy_(
            [dst[r : r + n] for _, _, r, n in spans],
            [srcs[b][s : s + n] for b, s, _, n in spans],
        )


def _key_grads(g_buckets: list[torch.Tensor], plan: _BucketPlan, shape, dtype) -> torch.Tensor:
    make = torch.empty if plan.keys_cover_all else torch.zeros
    out = make(shape, dtype=dtype, device=g_buckets[0].device)
    if plan.keys_cover_all:
        _copy_spans(out, g_buckets, plan.k_spans)
        return out
    if plan.keys_disjoint:
        _copy_spans(out, g_buckets, plan.k_spans)
    else:  # a key row in several pieces (context parallelism): accumulate piece by piece
        for b, s, r, n in plan.k_spans:
            out[r : r + n] += g_buckets[b][s : s + n]
    return out


def _dense_causal(qb, kb, vb, scale: float) -> torch.Tensor:
    extra = {"enable_gqa": True} if qb.shape[1] != kb.shape[1] else {}
    return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, **extra)


def _dense_causal_forward(qb, kb, vb, scale: float):
    """Dense causal SDPA on one bucket; returns ``(out, state)`` for :func:`_dense_causal_backward`.

    Runs ``F.scaled_dot_product_attention`` on detached leaves, so torch picks its fastest dense
    kernel (cuDNN / flash on GPU, any backend elsewhere) and its own backward is reused.
    """
    leaves = [t.detach().requires_grad_(True) for t in (qb, kb, vb)]
    with torch.enable_grad():
        ob = _dense_causal(*leaves, scale)
    return ob.detach(), (leaves, ob)


def _dense_causal_backward(state, dob):
    leaves, ob = state
    return torch.autograd.grad(ob, leaves, dob)


def _backend_for(qb, kb, first_call: bool):
    """SDPA backend policy per bucket shape (CUDA only).

    A shape this process has not run through torch's default choice yet is run on the flash /
    memory-efficient kernels during a plan's first call (no cuDNN graph build for a layout that may
    be used once); from the plan's second call on (the next layers of the same batch) it takes the
    default choice, which builds the cuDNN graph once for the whole process.
    """
    if not qb.is_cuda:
        return contextlib.nullcontext()
    shape = (*qb.shape, kb.shape[1], kb.shape[-1], qb.dtype, qb.device)
    if shape in _BUILT_SHAPES:
        return contextlib.nullcontext()
    if first_call:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        )
    _BUILT_SHAPES.add(shape)
    return contextlib.nullcontext()


class _BucketedCausal(torch.autograd.Function):
    """Gather into padded buckets, dense causal SDPA per bucket, copy rows back; one graph node.

    Passes over the ``[tokens, heads, dim]`` data: forward gathers q, k, v (one each) and copies
    the real output rows out (one); backward gathers the output gradient (one, pad slots zeroed)
    and copies dq, dk, dv out (one each).  No zero-filled full-size gradients, no scatter-adds
    (except for key rows shared by two pieces under context parallelism).
    """

    @staticmethod
    def forward(ctx, q, k, v, plan: _BucketPlan, scale: float, need_grad: bool):
        first_call = plan.calls[0] == 0
        plan.calls[0] += 1
        q_pad = q.index_select(0, plan.q_src)
        k_pad = k.index_select(0, plan.k_src)
        v_pad = v.index_select(0, plan.k_src)
        outs, states = [], []
        for off, n, p in plan.buckets:
            views = [_bucket_views(x, off, n, p) for x in (q_pad, k_pad, v_pad)]
            with _backend_for(views[0], views[1], first_call):
                if need_grad:
                    ob, state = _dense_causal_forward(*views, scale)
                    states.append(state)
                else:
                    ob = _dense_causal(*views, scale)
            outs.append(_flat(ob))
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        _copy_spans(out, outs, plan.q_spans)
        ctx.plan, ctx.states = plan, states
        ctx.kv_meta = ((k.shape, k.dtype), (v.shape, v.dtype))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        plan: _BucketPlan = ctx.plan
        do_pad = dout.index_select(0, plan.q_src)
        if plan.pad_q_slots.numel():
            do_pad.index_fill_(0, plan.pad_q_slots, 0)
        grads: list[list[torch.Tensor]] = [[], [], []]
        for (off, n, p), state in zip(plan.buckets, ctx.states, strict=True):
            bucket_grads = _dense_causal_backward(state, _bucket_views(do_pad, off, n, p))
            for acc, g in zip(grads, bucket_grads, strict=True):
                acc.append(_flat(g))
        ctx.states = None  # free the per-bucket graphs
        dq = dout.new_empty(dout.shape[0], dout.shape[1], grads[0][0].shape[-1])
        _copy_spans(dq, grads[0], plan.q_spans)
        (k_shape, k_dtype), (v_shape, v_dtype) = ctx.kv_meta
        dk = _key_grads(grads[1], plan, k_shape, k_dtype)
        dv = _key_grads(grads[2], plan, v_shape, v_dtype)
        return dq, dk, dv, None, None, None


def _bucket_plan(q, k, pieces: AttentionPieces, plan_owner) -> _BucketPlan:
    hq, d = q.shape[1], q.shape[2]
    call_cost = _CALL_OVERHEAD_S * _ASSUMED_FLOPS / (7.0 * hq * d)
    key = ("causal_bucket_plan", pieces, q.shape[0], k.shape[0], round(call_cost), POW2_BATCHES)

    def build():
        return _build_bucket_plan(pieces, q.shape[0], k.shape[0], call_cost, q.device)

    return plan_owner.cached((*key, q.device), build) if plan_owner is not None else build()


def _fast_pieces(q, k, v, pieces: AttentionPieces, scale: float, plan_owner) -> torch.Tensor:
    plan = _bucket_plan(q, k, pieces, plan_owner)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _BucketedCausal.apply(q, k, v, plan, scale, need_grad)


# -- varlen: torch's flash varlen kernel on the packed stream ------------------------------------
def _varlen_usable(q, k, v) -> bool:
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and d == v.shape[-1]
        and d % 8 == 0
        and d <= 256
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


def _varlen_first(q, k, v, layout: PackedLayout) -> bool:
    """``"auto"``: run a layout's first call on the varlen kernel when buckets would need builds.

    The bucketed path is faster once torch has built (cuDNN) its kernels for the bucket shapes;
    building costs tens of ms per new shape, which a layout used once never earns back.  The
    first call of a layout with unbuilt shapes therefore runs on the varlen kernel (no copies, no
    builds); its second call (the next layer) takes the bucketed path and builds what is missing.
    """
    if q.shape[0] == 0 or not _varlen_usable(q, k, v):
        return False
    plan = _bucket_plan(q, k, AttentionPieces.from_layout(layout), layout)
    if plan.calls[0] > 0:
        return False
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    shapes = {(n, hq, p, d, hk, v.shape[-1], q.dtype, q.device) for _, n, p in plan.buckets}
    if shapes <= _BUILT_SHAPES:
        return False
    plan.calls[0] += 1
    return True


class _VarlenCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        m = ctx.max_len
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, m, m, 0.0, True, rng, unused,
            scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None


def _varlen_causal(q, k, v, layout: PackedLayout, scale) -> torch.Tensor:
    if not _varlen_usable(q, k, v):
        raise ValueError(
            f'impl="varlen" runs torch\'s flash varlen kernel: CUDA, float16/bfloat16, equal q/v '
            f"head dims (a multiple of 8, <= 256); got {q.device}, {q.dtype}, dims "
            f'{q.shape[-1]}/{v.shape[-1]}; use impl="fast"'
        )
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cu = layout.cached(
        ("cu_seqlens_int32", q.device), lambda: layout.to(q.device).cu_seqlens.to(torch.int32)
    )
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _VarlenCausal.apply(q, k, v, cu, max(layout.max_seqlen, 1), scale)


# -- cudnn: one ragged cuDNN kernel per direction -------------------------------------------------
def _cudnn_preferred(q, k, v, layout: PackedLayout) -> bool:
    """``"auto"``'s choice: cuDNN ragged where it runs, unless its padded statistics (one fp32 per
    head and padded row) would outweigh the queries (a very skewed length mix)."""
    if cudnn_ragged.stats_bytes(layout, q.shape[1]) > q.numel() * q.element_size():
        return False
    return cudnn_ragged.usable(q, k, v)


def _cudnn_causal(q, k, v, layout: PackedLayout, scale) -> torch.Tensor:
    if not cudnn_ragged.usable(q, k, v):
        raise ValueError(
            f'impl="cudnn" runs cuDNN\'s ragged fused attention: CUDA with compute capability '
            f">= 9.0, float16/bfloat16, equal head dims (a multiple of 8, <= 128), the "
            f"nvidia-cudnn-frontend package; got {q.device}, {q.dtype}, dims "
            f'{q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]}; use impl="fast"'
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return cudnn_ragged.cudnn_ragged_causal(q, k, v, layout, scale)


# -- flex ----------------------------------------------------------------------------------------
_COMPILED_FLEX = None


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _flex_document_causal(q, k, v, layout: PackedLayout, scale) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    t = q.shape[0]
    if t == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    seg = layout.segment_ids

    def document_causal(b, h, qi, ki):
        return (seg[qi] == seg[ki]) & (ki <= qi)

    block_mask = layout.cached(
        ("flex_document_causal", q.device),
        lambda: create_block_mask(
            document_causal, None, None, t, t, device=q.device, _compile=q.is_cuda
        ),
    )
    out = _flex_fn(q.device)(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def useful_causal_flops(lengths: Sequence[int], heads: int, dim: int) -> int:
    """Forward FLOPs of causal attention over ``lengths`` (no padding); x3.5 for fwd+bwd."""
    return 4 * heads * dim * sum(n * (n + 1) // 2 for n in lengths)
