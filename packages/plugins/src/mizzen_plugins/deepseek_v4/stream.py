"""Index plan of one DeepSeek-V4-style attention call over a packed stream (with or without CP).

The attention of a rank's *query rows* reads three things: the raw key/value rows of its sliding
window, the compressed entries its indexer picked, and the per-head sink.  This module derives,
from the global layout (and the CP shard, if any), every index those reads need:

- query rows: global stream index, segment and in-segment position of each local row;
- *extended rows*: the local rows plus the left halo each CP chunk receives
  (:func:`mizzen_plugins.context_parallel.exchange_left_halo`), ascending in global index with no
  row twice, so a query's window is the run of extended rows just before it;
- compression: the global groups, the ones this rank owns (their last token is local) with the
  extended rows they pool, and each query's selectable range ``[lo, hi)`` of global group ids.

Invariants: without CP the extended rows are exactly the stream and every group is owned; window
validity is decided by global index and segment only (``0 <= t - s < window`` and same segment),
never by row distance in the extended tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mizzen_plugins.context_parallel import CPShard, halo_rows, owned_groups
from mizzen_plugins.thd import CompressedGroups, PackedLayout, compressed_groups


@dataclass(frozen=True, eq=False)
class StreamPlan:
    layout: PackedLayout  # global (padded under CP)
    shard: CPShard | None
    window: int
    ratio: int
    q_gidx: torch.Tensor
    q_seg: torch.Tensor
    q_pos: torch.Tensor
    ext_gidx: torch.Tensor
    ext_seg: torch.Tensor
    ext_pos: torch.Tensor
    q_in_ext: torch.Tensor
    groups: CompressedGroups | None
    own_groups: torch.Tensor | None  # [Go] global group ids this rank computes
    own_group_rows: torch.Tensor | None  # [Go, ratio] extended rows each owned group pools
    lo: torch.Tensor | None  # [Tq] first selectable global group id
    hi: torch.Tensor | None  # [Tq] one past the last

    @property
    def num_queries(self) -> int:
        return int(self.q_gidx.numel())

    @property
    def num_ext(self) -> int:
        return int(self.ext_gidx.numel())

    @functools.cached_property
    def block_window_mask(self) -> torch.Tensor:
        """``[ceil(Te / W) * W, 2W]``: ext row ``t`` may see ext row ``(t // W - 1) * W + j``.

        Rows past ``Te`` (block padding) see nothing.
        """
        w, te = self.window, self.num_ext
        rows = max(1, -(-te // w)) * w
        t = torch.arange(rows, device=self.ext_gidx.device)
        r = (t // w - 1)[:, None] * w + torch.arange(2 * w, device=t.device)[None, :]
        inside = (r >= 0) & (r < te) & (t < te)[:, None]
        last = max(te - 1, 0)
        tc, rc = t.clamp(max=last), r.clamp(0, last)
        if te == 0:
            return inside
        dist = self.ext_gidx[tc][:, None] - self.ext_gidx[rc]
        same = self.ext_seg[tc][:, None] == self.ext_seg[rc]
        return inside & same & (dist >= 0) & (dist < w)

    @functools.cached_property
    def ext_runs(self) -> tuple[torch.Tensor, int]:
        """Runs of extended rows that are one segment *and* consecutive in global index.

        ``(cu_seqlens int32 [R + 1], longest run)``, for kernels that restart at each run
        (flash-style varlen).  A query's whole window lies in its own run: the halo gives every
        chunk the ``window - 1`` rows before it, so a gap in global index is wider than a window.
        One host sync, cached.
        """
        te = self.num_ext
        if te == 0:
            return torch.zeros(1, dtype=torch.int32, device=self.ext_gidx.device), 0
        brk = torch.ones(te, dtype=torch.bool, device=self.ext_gidx.device)
        brk[1:] = (self.ext_seg[1:] != self.ext_seg[:-1]) | (
            self.ext_gidx[1:] != self.ext_gidx[:-1] + 1
        )
        starts = brk.nonzero().flatten()
        cu = torch.cat([starts, starts.new_full((1,), te)])
        return cu.to(torch.int32), int((cu[1:] - cu[:-1]).max())

    @functools.cached_property
    def segment_runs(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """``(segment, q0, q1, e0, e1)``: query rows ``q0:q1`` and ext rows ``e0:e1`` of a segment."""

        def runs(seg: torch.Tensor) -> dict[int, tuple[int, int]]:
            vals, counts = torch.unique_consecutive(seg.cpu(), return_counts=True)
            out, acc = {}, 0
            for v, c in zip(vals.tolist(), counts.tolist(), strict=True):
                out[v] = (acc, acc + c)
                acc += c
            return out

        q_runs, e_runs = runs(self.q_seg), runs(self.ext_seg)
        return tuple((s, *q_runs[s], *e_runs[s]) for s in q_runs)


def build_stream_plan(
    layout: PackedLayout | CPShard, window: int, ratio: int, device: torch.device
) -> StreamPlan:
    """Plan for ``layout`` (or a CP shard), cached on the global layout."""
    shard = layout if isinstance(layout, CPShard) else None
    glayout = (shard.layout if shard is not None else layout).to(device)
    key = (
        "dsv4_stream_plan",
        None if shard is None else (shard.cp_size, shard.rank, shard.split),
        window,
        ratio,
        torch.device(device),
    )
    return glayout.cached(key, lambda: _build(glayout, shard, window, ratio, device))


def _build(glayout: PackedLayout, shard: CPShard | None, window: int, ratio: int, device):
    if shard is not None:
        shard = CPShard(glayout, shard.num_real_tokens, shard.cp_size, shard.rank, shard.split)
        q_gidx = shard.local_token_index
        halo = max(window - 1, ratio - 1, 0)
        ext_gidx, q_in_ext = halo_rows(shard, halo, device)
    else:
        q_gidx = glayout.token_index
        ext_gidx, q_in_ext = q_gidx, torch.arange(q_gidx.numel(), device=device)
    seg, pos = glayout.segment_ids, glayout.positions
    groups = own = own_rows = lo = hi = None
    if ratio > 0:
        groups = compressed_groups(glayout, ratio)
        own = (
            owned_groups(shard, groups)
            if shard is not None
            else torch.arange(groups.num_groups, device=device)
        )
        ext_of_global = torch.full((glayout.num_tokens,), -1, dtype=torch.long, device=device)
        ext_of_global[ext_gidx] = torch.arange(ext_gidx.numel(), device=device)
        own_rows = ext_of_global[groups.token_indices[own]]
        if bool((own_rows < 0).any()):
            raise AssertionError("an owned compression group reaches past the exchanged halo")
        lo = groups.cu_groups[:-1][seg[q_gidx]]
        hi = lo + (pos[q_gidx] + 1) // ratio
    return StreamPlan(
        layout=glayout,
        shard=shard,
        window=window,
        ratio=ratio,
        q_gidx=q_gidx,
        q_seg=seg[q_gidx],
        q_pos=pos[q_gidx],
        ext_gidx=ext_gidx,
        ext_seg=seg[ext_gidx],
        ext_pos=pos[ext_gidx],
        q_in_ext=q_in_ext,
        groups=groups,
        own_groups=own,
        own_group_rows=own_rows,
        lo=lo,
        hi=hi,
    )
