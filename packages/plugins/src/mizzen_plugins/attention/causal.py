"""Document-causal attention over a packed (THD) token stream.

``causal_thd_attention(q, k, v, cu_seqlens)`` computes, for every segment of the stream, ordinary
causal softmax attention of that segment's queries over that segment's keys and nothing else.

Implementations (``impl``):

- ``"reference"``: a plain loop over segments with an explicit mask and softmax, computed in
  ``float32`` or wider (``float64`` stays ``float64``).  The ground truth for tests.
- ``"fast"``: segments are bucketed by length (:func:`mizzen_plugins.thd.plan_length_buckets`),
  each bucket gathered into a right-padded ``[n, heads, P, dim]`` batch and run through one
  ``scaled_dot_product_attention(is_causal=True)`` call, then scattered back.  Right padding plus
  the causal mask means no real query ever sees a pad key, so no mask tensor is needed and torch
  is free to pick its fastest dense causal kernel (flash / cuDNN on GPU).  Pad rows are copies of
  real rows; their outputs are dropped, so they receive exactly zero gradient.
- ``"flex"``: FlexAttention with a document-causal block mask (compiled on CUDA).  Forward-only
  on CPU (torch does not implement its backward there).
- ``"auto"``: ``"fast"`` (it runs on every device and dtype).

The generalised entry :func:`causal_attention_pieces` serves context parallelism: each *piece*
pairs a run of query rows with a run of key rows of one segment, aligned bottom-right (the last
query sees the last key), so a rank can attend its local queries to all-gathered keys.

Invariants: outputs have q's dtype and shape ``[tokens, heads_q, dim_v]``; ``heads_q`` must be a
multiple of ``heads_kv`` (grouped-query attention); a segment of length 0 contributes nothing; no
query attends outside its segment or to a later position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from mizzen_plugins.thd import PackedLayout, plan_length_buckets

__all__ = [
    "AttentionPieces",
    "causal_attention_pieces",
    "causal_thd_attention",
    "useful_causal_flops",
]

Impl = Literal["auto", "reference", "fast", "flex"]
_IMPLS = ("auto", "reference", "fast", "flex")

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
        impl: ``"auto"`` | ``"reference"`` | ``"fast"`` | ``"flex"`` (see module docstring).

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
    impl = _resolve_impl(impl)
    if impl == "flex":
        return _flex_document_causal(q, k, v, layout.to(q.device), scale)
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
    if impl == "flex":
        raise ValueError(
            'impl="flex" runs whole segments only (causal_thd_attention); use "fast" or '
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


# -- fast: length-bucketed dense causal SDPA ------------------------------------------------------
@dataclass(frozen=True)
class _GatherPlan:
    q_rows: torch.Tensor  # [N_pad] which q row fills each padded slot
    k_rows: torch.Tensor  # [N_pad] which k row fills each padded slot
    out_index: torch.Tensor  # [Tq] slot of the padded output holding each query row
    buckets: tuple[tuple[int, int], ...]  # (n, P) square buckets, in slot order
    ragged: tuple[tuple[int, int, int], ...]  # (slot offset, q_len, k_len) bottom-right pieces


def _build_gather_plan(pieces: AttentionPieces, call_cost: float, device) -> _GatherPlan:
    # Square pieces (q_len == k_len, the whole-segment case) are bucketed; the few ragged pieces
    # (context parallel: a chunk that starts mid-segment) each get one masked call.  Built with
    # vectorised CPU tensor ops (one host->device copy per index tensor).
    n = pieces.num_pieces
    q_start = torch.tensor(pieces.q_start, dtype=torch.long)
    k_start = torch.tensor(pieces.k_start, dtype=torch.long)
    q_len = torch.tensor(pieces.q_len, dtype=torch.long)
    square = [i for i in range(n) if pieces.q_len[i] == pieces.k_len[i] > 0]
    ragged = [i for i in range(n) if pieces.k_len[i] > pieces.q_len[i] > 0]
    buckets = plan_length_buckets([pieces.q_len[i] for i in square], align=64, call_cost=call_cost)
    slot_base = torch.zeros(n, dtype=torch.long)
    q_rows, k_rows, bucket_shapes = [], [], []
    slot = 0
    for b in buckets:
        p = b.padded_length
        ids = torch.tensor([square[m] for m in b.members], dtype=torch.long)
        offs = torch.minimum(torch.arange(p)[None, :], (q_len[ids] - 1)[:, None])  # [n_b, P]
        q_rows.append((q_start[ids][:, None] + offs).flatten())
        k_rows.append((k_start[ids][:, None] + offs).flatten())
        slot_base[ids] = slot + p * torch.arange(len(ids))
        slot += p * len(ids)
        bucket_shapes.append((len(ids), p))
    # after the square part, q_rows and k_rows stop being parallel: each ragged piece appends
    # its q_len query rows to q_rows and its k_len key rows to k_rows.
    ragged_specs = []
    for i in ragged:
        ql, kl = pieces.q_len[i], pieces.k_len[i]
        ragged_specs.append((slot, ql, kl))
        slot_base[i] = slot
        q_rows.append(pieces.q_start[i] + torch.arange(ql))
        k_rows.append(pieces.k_start[i] + torch.arange(kl))
        slot += ql
    # out_index[r] = slot of query row r: pieces partition the query rows
    order = torch.argsort(q_start[q_len > 0])
    live = torch.nonzero(q_len > 0).flatten()[order]
    piece_of_row = torch.repeat_interleave(live, q_len[live])
    rows = torch.arange(piece_of_row.numel())
    out_index = slot_base[piece_of_row] + rows - q_start[piece_of_row]
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return _GatherPlan(
        q_rows=cat(q_rows).to(device),
        k_rows=cat(k_rows).to(device),
        out_index=out_index.to(device),
        buckets=tuple(bucket_shapes),
        ragged=tuple(ragged_specs),
    )


def _fast_pieces(q, k, v, pieces: AttentionPieces, scale: float, plan_owner) -> torch.Tensor:
    hq, d = q.shape[1], q.shape[2]
    call_cost = _CALL_OVERHEAD_S * _ASSUMED_FLOPS / (7.0 * hq * d)
    key = ("causal_gather_plan", pieces, round(call_cost), q.device)
    build = lambda: _build_gather_plan(pieces, call_cost, q.device)  # noqa: E731
    plan = plan_owner.cached(key, build) if plan_owner is not None else build()
    gqa = q.shape[1] != k.shape[1]
    n_square = sum(n * p for n, p in plan.buckets)
    q_sq = q.index_select(0, plan.q_rows[:n_square])
    k_sq = k.index_select(0, plan.k_rows[:n_square])
    v_sq = v.index_select(0, plan.k_rows[:n_square])
    outs = []
    off = 0
    for n, p in plan.buckets:
        sl = slice(off, off + n * p)
        # contiguous [n, H, P, D]: the layout dense causal SDPA kernels are tuned for
        qb = q_sq[sl].view(n, p, hq, d).transpose(1, 2).contiguous()
        kb = k_sq[sl].view(n, p, k.shape[1], d).transpose(1, 2).contiguous()
        vb = v_sq[sl].view(n, p, v.shape[1], v.shape[2]).transpose(1, 2).contiguous()
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(ob.transpose(1, 2).reshape(n * p, hq, v.shape[2]))
        off += n * p
    # ragged (bottom-right) pieces: queries and keys stored back to back after the buckets
    q_pos = n_square
    k_pos = n_square
    for _slot, ql, kl in plan.ragged:
        qi = q.index_select(0, plan.q_rows[q_pos : q_pos + ql]).transpose(0, 1)[None]
        ki = k.index_select(0, plan.k_rows[k_pos : k_pos + kl]).transpose(0, 1)[None]
        vi = v.index_select(0, plan.k_rows[k_pos : k_pos + kl]).transpose(0, 1)[None]
        mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(diagonal=kl - ql)
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(oi[0].transpose(0, 1))
        q_pos += ql
        k_pos += kl
    out_pad = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    return out_pad.index_select(0, plan.out_index)


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
