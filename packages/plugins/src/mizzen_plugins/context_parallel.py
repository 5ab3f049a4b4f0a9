"""Context parallelism (CP) over a packed (THD) token stream.

The global stream is first padded to a multiple of the split granularity with one extra *pad
segment* (never merged into a real segment, so no real token can attend to padding), then cut into
equal chunks:

- ``"contiguous"``: ``cp`` chunks, rank ``r`` holds chunk ``r``.
- ``"load_balanced"``: ``2 * cp`` chunks, rank ``r`` holds chunks ``r`` and ``2cp - 1 - r`` (for
  plain causal attention this evens out the quadratic work between ranks).

A rank's local tensor holds its chunks back to back in ascending chunk order.  Every rank derives
every other rank's share from the global layout alone, so the collectives below need no size
exchange.

Collectives (all differentiable, all work on gloo and NCCL; every rank of the group must call
them in the same order):

- :func:`all_gather_rows`: the whole stream from every rank's local rows (backward: the gradient
  of each row is summed over ranks and returned to its owner).
- :func:`exchange_left_halo`: each local chunk receives the ``halo`` rows just before it (which a
  sliding window or a compression group reaching across the chunk boundary needs), with the
  gradient of those rows returned to their owner in backward.
- :func:`all_gather_groups`: compressed groups computed by their owners, gathered in global group
  order.  A compression group is owned by exactly one rank: the one holding its last token.

Invariants: chunk sizes are equal on every rank; ``local_token_index`` lists the global stream
index of each local row; the pad segment is the last segment of ``shard.layout`` when
``num_pad_tokens > 0``.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mizzen_plugins.attention.causal import AttentionPieces, Impl, causal_attention_pieces
from mizzen_plugins.thd import CompressedGroups, PackedLayout

__all__ = [
    "SPLITS",
    "CPShard",
    "ExtendedRows",
    "all_gather_groups",
    "all_gather_rows",
    "context_parallel_causal_attention",
    "exchange_left_halo",
    "halo_rows",
    "owned_groups",
    "pad_layout",
    "shard_packed_stream",
]

SPLITS = ("contiguous", "load_balanced")


def pad_layout(layout: PackedLayout, multiple: int) -> tuple[PackedLayout, int]:
    """Append one pad segment so the token count is a multiple of ``multiple``."""
    if multiple < 1:
        raise ValueError(f"multiple = {multiple}: must be >= 1")
    n_pad = (-layout.num_tokens) % multiple
    if n_pad == 0:
        return layout, 0
    return PackedLayout((*layout.lengths, n_pad), layout.device), n_pad


@dataclass(frozen=True, eq=False)
class CPShard:
    """This rank's share of a padded packed stream.  Build with :func:`shard_packed_stream`."""

    layout: PackedLayout  # global, padded
    num_real_tokens: int
    cp_size: int
    rank: int
    split: str

    @property
    def num_pad_tokens(self) -> int:
        return self.layout.num_tokens - self.num_real_tokens

    @property
    def num_chunks(self) -> int:
        return self.cp_size if self.split == "contiguous" else 2 * self.cp_size

    @property
    def chunk_size(self) -> int:
        return self.layout.num_tokens // self.num_chunks

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        if self.split == "contiguous":
            return (rank,)
        return (rank, 2 * self.cp_size - 1 - rank)

    @property
    def chunks(self) -> tuple[int, ...]:
        return self.chunks_of(self.rank)

    def chunk_owner(self, chunk: int) -> int:
        if self.split == "contiguous":
            return chunk
        return chunk if chunk < self.cp_size else 2 * self.cp_size - 1 - chunk

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        return chunk * self.chunk_size, (chunk + 1) * self.chunk_size

    @property
    def num_local_tokens(self) -> int:
        return len(self.chunks) * self.chunk_size

    def global_rows_of(self, rank: int) -> torch.Tensor:
        return torch.cat(
            [torch.arange(*self.chunk_range(c), dtype=torch.long) for c in self.chunks_of(rank)]
        )

    @functools.cached_property
    def local_token_index(self) -> torch.Tensor:
        """``[num_local_tokens]`` global stream index of each local row."""
        return self.global_rows_of(self.rank).to(self.layout.device)

    @functools.cached_property
    def local_segment_ids(self) -> torch.Tensor:
        return self.layout.segment_ids[self.local_token_index]

    @functools.cached_property
    def local_positions(self) -> torch.Tensor:
        return self.layout.positions[self.local_token_index]

    @functools.cached_property
    def local_real_mask(self) -> torch.Tensor:
        """``[num_local_tokens]`` True for real tokens, False for the pad segment."""
        return self.local_token_index < self.num_real_tokens

    def take(self, x: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """This rank's rows of a global tensor (pad rows filled with ``pad_value`` if unpadded).

        Use ``pad_value=-1`` for a recorded top-k (pad tokens select nothing).
        """
        if x.shape[0] == self.num_real_tokens and self.num_pad_tokens:
            x = torch.cat([x, x.new_full((self.num_pad_tokens, *x.shape[1:]), pad_value)])
        if x.shape[0] != self.layout.num_tokens:
            raise ValueError(
                f"x.shape[0] = {x.shape[0]}: expected the global stream of "
                f"{self.num_real_tokens} real (or {self.layout.num_tokens} padded) tokens"
            )
        return x.index_select(0, self.local_token_index.to(x.device))

    @functools.cached_property
    def causal_pieces(self) -> AttentionPieces:
        """Local query runs vs global key runs, one per (local chunk, segment) overlap."""
        starts, lengths = self.layout.starts, self.layout.lengths
        q_start, k_start, q_len, k_len = [], [], [], []
        local_off = 0
        for c in self.chunks:
            cs, ce = self.chunk_range(c)
            s = max(bisect.bisect_right(starts, cs) - 1, 0)
            while s < len(starts) and starts[s] < ce:
                seg_start, seg_end = starts[s], starts[s] + lengths[s]
                a, b = max(cs, seg_start), min(ce, seg_end)
                if b > a:
                    q_start.append(local_off + a - cs)
                    k_start.append(seg_start)
                    q_len.append(b - a)
                    k_len.append(b - seg_start)
                s += 1
            local_off += ce - cs
        return AttentionPieces(tuple(q_start), tuple(k_start), tuple(q_len), tuple(k_len))


def shard_packed_stream(
    layout: PackedLayout, cp_size: int, rank: int, split: str = "contiguous"
) -> CPShard:
    """Pad ``layout`` for ``cp_size`` ranks and describe ``rank``'s share under ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split = {split!r}: choose one of {', '.join(map(repr, SPLITS))}")
    if cp_size < 1 or not 0 <= rank < cp_size:
        raise ValueError(f"rank = {rank}, cp_size = {cp_size}: need 0 <= rank < cp_size")
    multiple = cp_size if split == "contiguous" else 2 * cp_size
    padded, _ = pad_layout(layout, multiple)
    return CPShard(padded, layout.num_tokens, cp_size, rank, split)


def pad_rows(x: torch.Tensor, num_pad: int) -> torch.Tensor:
    if num_pad == 0:
        return x
    return torch.cat([x, x.new_zeros(num_pad, *x.shape[1:])], dim=0)


# -- the one collective primitive ----------------------------------------------------------------
def _group_rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _AllGatherStack(torch.autograd.Function):
    """``x [n, ...]`` on every rank -> ``[world, n, ...]``; backward sums grads back to owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        rank, world = _group_rank_size(group)
        ctx.group, ctx.rank, ctx.world = group, rank, world
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad.reshape(-1, *grad.shape[2:]), group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def _gather_flat(x: torch.Tensor, group) -> torch.Tensor:
    stacked = _AllGatherStack.apply(x, group)
    return stacked.reshape(-1, *x.shape[1:])


def _check_local(x: torch.Tensor, shard: CPShard, name: str) -> None:
    if x.shape[0] != shard.num_local_tokens:
        raise ValueError(
            f"{name}.shape[0] = {x.shape[0]} but rank {shard.rank} holds "
            f"{shard.num_local_tokens} rows of the stream; pass shard.take(global_tensor)"
        )


# -- all-gather of rows --------------------------------------------------------------------------
def _gather_permutation(shard: CPShard) -> torch.Tensor:
    """``perm[g]`` = slot of global row ``g`` in the flattened ``[world * n_local]`` gather."""
    flat = torch.cat([shard.global_rows_of(r) for r in range(shard.cp_size)])
    perm = torch.empty_like(flat)
    perm[flat] = torch.arange(flat.numel())
    return perm


def all_gather_rows(x_local: torch.Tensor, shard: CPShard, group=None) -> torch.Tensor:
    """The whole (padded) stream ``[T, ...]`` in global order from every rank's local rows."""
    _check_local(x_local, shard, "x_local")
    if shard.cp_size == 1:
        return x_local
    perm = shard.layout.cached(
        ("cp_gather_perm", shard.cp_size, shard.split, x_local.device),
        lambda: _gather_permutation(shard).to(x_local.device),
    )
    return _gather_flat(x_local, group).index_select(0, perm)


# -- left halo exchange --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ExtendedRows:
    """Local rows with the halo rows each chunk needs from before it.

    ``rows[i]`` is global stream row ``global_index[i]``; ``local_in_ext[j]`` is where local row
    ``j`` sits in ``rows``.  Global indices are strictly increasing inside each local chunk's
    ``[halo, chunk]`` run and no global row appears twice.
    """

    rows: torch.Tensor
    global_index: torch.Tensor
    local_in_ext: torch.Tensor


@dataclass(frozen=True)
class _HaloPlan:
    send_index: torch.Tensor  # local rows this rank contributes (its chunks' tails)
    ext_index: torch.Tensor  # into cat([x_local, gathered_flat])
    global_index: torch.Tensor
    local_in_ext: torch.Tensor


def _halo_plan(shard: CPShard, halo: int, device) -> _HaloPlan:
    cs = shard.chunk_size
    tail = min(halo, cs)
    n_lc = len(shard.chunks)
    send = torch.cat(
        [torch.arange(i * cs + cs - tail, (i + 1) * cs, dtype=torch.long) for i in range(n_lc)]
    )

    def slot_of(g: int) -> int:
        # global row g -> its slot in the flattened gather [world, n_lc * tail]
        c = g // cs
        owner = shard.chunk_owner(c)
        i = shard.chunks_of(owner).index(c)
        j = g - ((c + 1) * cs - tail)
        assert 0 <= j < tail, "a halo row outside its chunk's tail"
        return owner * n_lc * tail + i * tail + j

    tl = shard.num_local_tokens
    ext_parts, global_parts, local_parts = [], [], []
    n_ext = 0
    prev_end = 0  # never fetch a row this rank already holds: ext rows stay unique, ascending
    for i, c in enumerate(shard.chunks):
        start, end = shard.chunk_range(c)
        need = list(range(max(prev_end, start - halo), start))
        if need:
            ext_parts.append(torch.tensor([tl + slot_of(g) for g in need], dtype=torch.long))
            global_parts.append(torch.tensor(need, dtype=torch.long))
            n_ext += len(need)
        local_parts.append(torch.arange(n_ext, n_ext + cs))
        ext_parts.append(torch.arange(i * cs, (i + 1) * cs))
        global_parts.append(torch.arange(start, end))
        n_ext += cs
        prev_end = end
    return _HaloPlan(
        send.to(device),
        torch.cat(ext_parts).to(device),
        torch.cat(global_parts).to(device),
        torch.cat(local_parts).to(device),
    )


def halo_rows(shard: CPShard, halo: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(global_index, local_in_ext)`` of :func:`exchange_left_halo`'s result, without exchanging."""
    if shard.cp_size == 1 or halo == 0:
        idx = shard.local_token_index.to(device)
        return idx, torch.arange(idx.numel(), device=device)
    plan = shard.layout.cached(
        ("cp_halo_plan", shard.cp_size, shard.split, shard.rank, halo, torch.device(device)),
        lambda: _halo_plan(shard, halo, device),
    )
    return plan.global_index, plan.local_in_ext


def exchange_left_halo(
    x_local: torch.Tensor, shard: CPShard, halo: int, group=None
) -> ExtendedRows:
    """Give each local chunk the ``halo`` global rows just before it (clamped at the stream start).

    Rows this rank holds are never fetched, so the extended rows are unique and ascending in
    global index (a chunk's window reaches them through the chunk before it).  Differentiable: the
    gradient of a received row is returned to the rank that owns it.
    """
    _check_local(x_local, shard, "x_local")
    if halo < 0:
        raise ValueError(f"halo = {halo}: must be >= 0")
    if shard.cp_size == 1 or halo == 0:
        idx = shard.local_token_index.to(x_local.device)
        pos = torch.arange(x_local.shape[0], device=x_local.device)
        return ExtendedRows(x_local, idx, pos)
    plan = shard.layout.cached(
        (
            "cp_halo_plan",
            shard.cp_size,
            shard.split,
            shard.rank,
            halo,
            torch.device(x_local.device),
        ),
        lambda: _halo_plan(shard, halo, x_local.device),
    )
    gathered = _gather_flat(x_local.index_select(0, plan.send_index), group)
    rows = torch.cat([x_local, gathered], dim=0).index_select(0, plan.ext_index)
    return ExtendedRows(rows, plan.global_index, plan.local_in_ext)


# -- compressed groups ---------------------------------------------------------------------------
def _owned_by_rank(shard: CPShard, groups: CompressedGroups) -> list[torch.Tensor]:
    end_token = groups.end_token.cpu()
    chunk_of_group = torch.div(end_token, max(shard.chunk_size, 1), rounding_mode="floor")
    owners = torch.tensor(
        [shard.chunk_owner(int(c)) for c in chunk_of_group.tolist()], dtype=torch.long
    )
    return [torch.nonzero(owners == r).flatten() for r in range(shard.cp_size)]


def owned_groups(shard: CPShard, groups: CompressedGroups) -> torch.Tensor:
    """Global ids (ascending) of the groups this rank computes: those whose last token it holds.

    ``groups`` must be built on ``shard.layout`` (the padded global layout).
    """
    return shard.layout.cached(
        ("cp_owned_groups", shard.cp_size, shard.split, groups.ratio),
        lambda: _owned_by_rank(shard, groups),
    )[shard.rank].to(groups.segment.device)


def all_gather_groups(
    entries_local: torch.Tensor, shard: CPShard, groups: CompressedGroups, group=None
) -> torch.Tensor:
    """``[num_groups, ...]`` in global group order from each rank's owned entries."""
    owned = shard.layout.cached(
        ("cp_owned_groups", shard.cp_size, shard.split, groups.ratio),
        lambda: _owned_by_rank(shard, groups),
    )
    mine = owned[shard.rank]
    if entries_local.shape[0] != mine.numel():
        raise ValueError(
            f"entries_local.shape[0] = {entries_local.shape[0]} but rank {shard.rank} owns "
            f"{mine.numel()} groups; compute exactly the groups of owned_groups(shard, groups)"
        )
    if shard.cp_size == 1:
        return entries_local
    width = max((o.numel() for o in owned), default=0)

    def build_perm() -> torch.Tensor:
        perm = torch.empty(groups.num_groups, dtype=torch.long)
        for r, o in enumerate(owned):
            perm[o] = r * width + torch.arange(o.numel())
        return perm.to(entries_local.device)

    perm = shard.layout.cached(
        ("cp_group_perm", shard.cp_size, shard.split, groups.ratio, entries_local.device),
        build_perm,
    )
    padded = pad_rows(entries_local, width - mine.numel())
    return _gather_flat(padded, group).index_select(0, perm)


# -- plain causal attention under CP -------------------------------------------------------------
def context_parallel_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shard: CPShard,
    group=None,
    *,
    scale: float | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Document-causal attention of this rank's queries over the all-gathered keys and values.

    ``q, k, v`` are this rank's rows (``shard.take(global)``); the result is this rank's rows of
    ``causal_thd_attention`` over the padded global stream.  Works with either split.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_local(t, shard, name)
    k_all = all_gather_rows(k, shard, group)
    v_all = all_gather_rows(v, shard, group)
    return causal_attention_pieces(
        q, k_all, v_all, shard.causal_pieces, scale=scale, impl=impl, plan_owner=shard.layout
    )
