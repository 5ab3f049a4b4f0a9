"""Packed-sequence (THD) layout and the index helpers every position-dependent piece needs.

A packed batch is one token stream ``[tokens, ...]`` holding ``B`` sequences (segments) back to
back; ``cu_seqlens = [0, L0, L0+L1, ...]`` marks where each starts.  Everything that depends on a
position is derived here, once, from the segment lengths.

Invariants:
- The host-side ``lengths`` of a :class:`PackedLayout` are authoritative; its device tensors
  (``cu_seqlens``, ``segment_ids``, ``positions``) are derived from them and cached, so building a
  layout syncs with the device at most once and reusing it for every layer syncs never.
- Positions restart at 0 at every segment start; segments may be empty (length 0) and a stream may
  hold no tokens at all.
- Sliding-window key indices never reach before the start of the query's segment: an index that
  would is clamped to the segment start and reported invalid.
- Compression groups (``ratio`` consecutive tokens) never cross a segment boundary; a segment's
  tail shorter than ``ratio`` forms no group.  A group becomes visible to a query once it is
  complete: group ``g`` of a segment ends at position ``(g + 1) * ratio - 1``, so a query at
  position ``p`` may select the first ``(p + 1) // ratio`` groups of its own segment.
- Padded (BSHD) batches are right-padded: row ``b`` holds its ``lengths[b]`` real tokens first.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CompressedGroups",
    "LengthBucket",
    "PackedLayout",
    "compressed_groups",
    "indexer_key_ranges",
    "lengths_from_attention_mask",
    "pack_padded",
    "pack_sequences",
    "plan_length_buckets",
    "positions_from_cu_seqlens",
    "segment_ids_from_cu_seqlens",
    "sliding_window_key_indices",
    "unpack_sequences",
    "unpack_to_padded",
]


def _check_lengths(lengths: Sequence[int], what: str) -> tuple[int, ...]:
    out = []
    for i, n in enumerate(lengths):
        n_int = int(n)
        if n_int != n or n_int < 0:
            raise ValueError(
                f"{what}[{i}] = {n!r}: segment lengths must be non-negative integers; "
                "drop or fix that entry"
            )
        out.append(n_int)
    return tuple(out)


class PackedLayout:
    """Where each segment of a packed token stream starts and how long it is.

    Build it with :meth:`from_lengths`, :meth:`from_cu_seqlens`, :func:`pack_sequences` or
    :func:`pack_padded`.  Device tensors are created lazily on ``device`` and cached.
    """

    def __init__(self, lengths: Sequence[int], device: torch.device | str | None = None):
        self._lengths = _check_lengths(lengths, "lengths")
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
    ) -> PackedLayout:
        if isinstance(lengths, torch.Tensor):
            device = lengths.device if device is None else device
            lengths = lengths.tolist()
        return cls(lengths, device)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | Sequence[int]) -> PackedLayout:
        """From ``[0, L0, L0+L1, ...]`` (one host sync when it is a device tensor)."""
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if len(cu) == 0 or cu[0] != 0:
            raise ValueError(
                f"cu_seqlens = {cu[:8]}...: must start with 0 and hold one more entry than there "
                "are segments; build it as [0, *cumsum(lengths)]"
            )
        lengths = [b - a for a, b in itertools.pairwise(cu)]
        if any(n < 0 for n in lengths):
            i = next(i for i, n in enumerate(lengths) if n < 0)
            raise ValueError(
                f"cu_seqlens[{i + 1}] = {cu[i + 1]} < cu_seqlens[{i}] = {cu[i]}: cu_seqlens must "
                "be non-decreasing"
            )
        return cls(lengths, device)

    @classmethod
    def of_input_ids(
        cls, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | PackedLayout | None = None
    ) -> PackedLayout:
        """The layout of a model's ``input_ids`` on their device: ``[B, L]`` rows (no
        ``cu_seqlens``: B segments of L), or a packed ``[T]`` stream with its ``cu_seqlens`` (a
        tensor or a layout; none: one segment).  Built once per forward, shared by every layer."""
        device = input_ids.device
        if input_ids.dim() == 2:
            if cu_seqlens is not None:
                raise ValueError(
                    "pass either [B, L] input_ids or packed [T] input_ids with cu_seqlens, not both"
                )
            return cls.from_lengths([input_ids.shape[1]] * input_ids.shape[0], device)
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [T] or [B, L], got {tuple(input_ids.shape)}")
        if cu_seqlens is None:
            return cls.from_lengths([input_ids.shape[0]], device)
        layout = (
            cu_seqlens if isinstance(cu_seqlens, PackedLayout) else cls.from_cu_seqlens(cu_seqlens)
        )
        if layout.num_tokens != input_ids.shape[0]:
            raise ValueError(
                f"cu_seqlens describes {layout.num_tokens} tokens but input_ids has "
                f"{input_ids.shape[0]}; pass the cu_seqlens of this packed batch"
            )
        return layout.to(device)

    def cached(self, key: object, build):
        """Memoise ``build()`` on this layout under ``key`` (plans reused by every layer)."""
        cache = self.__dict__.setdefault("_plan_cache", {})
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def to(self, device: torch.device | str) -> PackedLayout:
        device = torch.device(device)
        return self if device == self.device else PackedLayout(self._lengths, device)

    # -- host-side facts ------------------------------------------------------------------------
    @property
    def lengths(self) -> tuple[int, ...]:
        return self._lengths

    @property
    def num_segments(self) -> int:
        return len(self._lengths)

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(self._lengths)

    @functools.cached_property
    def max_seqlen(self) -> int:
        return max(self._lengths, default=0)

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self._lengths:
            out.append(acc)
            acc += n
        return tuple(out)

    # -- device tensors (cached) ----------------------------------------------------------------
    @functools.cached_property
    def lengths_tensor(self) -> torch.Tensor:
        return torch.tensor(self._lengths, dtype=torch.long, device=self.device)

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``[num_segments + 1]``; ``.to(torch.int32)`` for flash-style kernels."""
        cu = [0, *(s + n for s, n in zip(self.starts, self._lengths, strict=True))]
        return torch.tensor(cu, dtype=torch.long, device=self.device)

    @functools.cached_property
    def segment_ids(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: which segment each token belongs to."""
        return segment_ids_from_cu_seqlens(self.cu_seqlens, self.num_tokens)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: position of each token inside its segment (restarts at 0)."""
        return self.token_index - self.cu_seqlens.index_select(0, self.segment_ids)

    @functools.cached_property
    def token_index(self) -> torch.Tensor:
        return torch.arange(self.num_tokens, dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        shown = ", ".join(map(str, self._lengths[:8])) + (", ..." if self.num_segments > 8 else "")
        return (
            f"PackedLayout(num_segments={self.num_segments}, num_tokens={self.num_tokens}, "
            f"lengths=[{shown}], device={self.device})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedLayout) and other._lengths == self._lengths

    def __hash__(self) -> int:
        return hash(self._lengths)


# -- tensor-level helpers ------------------------------------------------------------------------
def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Segment id of every token, ``[num_tokens]`` int64 (no host sync)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seg = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(seg, lengths, output_size=num_tokens)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position of every token inside its segment, restarting at 0 (no host sync)."""
    seg = segment_ids_from_cu_seqlens(cu_seqlens, num_tokens)
    return torch.arange(num_tokens, device=cu_seqlens.device) - cu_seqlens[seg]


def sliding_window_key_indices(
    layout: PackedLayout, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key indices of each query's causal sliding window, oldest first.

    Returns ``(indices, valid)``, both ``[num_tokens, window]``: column ``j`` of query ``t`` is key
    ``t - window + 1 + j`` (the last column is ``t`` itself).  Keys before the start of ``t``'s
    segment are clamped to that start and marked ``valid = False``.
    """
    if window < 1:
        raise ValueError(f"window = {window}: a sliding window holds at least the query itself")
    t = layout.token_index[:, None]
    raw = t - (window - 1) + torch.arange(window, device=layout.device)[None, :]
    start = layout.cu_seqlens[layout.segment_ids][:, None]
    valid = raw >= start
    return torch.maximum(raw, start), valid


@dataclass(frozen=True, eq=False)
class CompressedGroups:
    """Compression groups of a packed stream: ``ratio`` consecutive tokens of one segment each.

    Groups are numbered globally in stream order; ``cu_groups[s]`` is the first group of segment
    ``s``.  ``counts[s] = lengths[s] // ratio`` (the tail forms no group).
    """

    ratio: int
    counts: tuple[int, ...]
    cu_groups: torch.Tensor  # [num_segments + 1] int64
    segment: torch.Tensor  # [num_groups] segment of each group
    index_in_segment: torch.Tensor  # [num_groups] g within its segment
    start_token: torch.Tensor  # [num_groups] stream index of the group's first token
    end_position: torch.Tensor  # [num_groups] in-segment position of the group's last token

    @property
    def num_groups(self) -> int:
        return int(self.segment.numel())

    @functools.cached_property
    def token_indices(self) -> torch.Tensor:
        """``[num_groups, ratio]`` stream indices of each group's tokens."""
        offs = torch.arange(self.ratio, device=self.start_token.device)
        return self.start_token[:, None] + offs[None, :]

    @functools.cached_property
    def end_token(self) -> torch.Tensor:
        """``[num_groups]`` stream index of each group's last token."""
        return self.start_token + (self.ratio - 1)


def compressed_groups(layout: PackedLayout, ratio: int) -> CompressedGroups:
    """The compression groups of ``layout`` for ``ratio`` (>= 1), never crossing a segment."""
    if ratio < 1:
        raise ValueError(
            f"ratio = {ratio}: compression groups need ratio >= 1 (ratio 0 means the layer has no "
            "compressed branch; do not build groups for it)"
        )
    dev = layout.device
    counts = tuple(n // ratio for n in layout.lengths)
    counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
    cu = torch.zeros(len(counts) + 1, dtype=torch.long, device=dev)
    cu[1:] = torch.cumsum(counts_t, 0)
    total = sum(counts)
    segment = torch.repeat_interleave(
        torch.arange(len(counts), device=dev), counts_t, output_size=total
    )
    index_in_segment = torch.arange(total, device=dev) - cu[:-1][segment]
    seg_starts = layout.cu_seqlens[:-1]
    start_token = seg_starts[segment] + index_in_segment * ratio
    end_position = (index_in_segment + 1) * ratio - 1
    return CompressedGroups(
        ratio=ratio,
        counts=counts,
        cu_groups=cu,
        segment=segment,
        index_in_segment=index_in_segment,
        start_token=start_token,
        end_position=end_position,
    )


def indexer_key_ranges(
    layout: PackedLayout, ratio: int, groups: CompressedGroups | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query range ``[lo, hi)`` of global compressed-group indices a top-k indexer may pick.

    ``lo`` is the first group of the query's segment, ``hi - lo = (position + 1) // ratio`` (only
    complete groups of the same segment).  Both ``[num_tokens]`` int64.
    """
    groups = compressed_groups(layout, ratio) if groups is None else groups
    lo = groups.cu_groups[:-1][layout.segment_ids]
    hi = lo + (layout.positions + 1) // ratio
    return lo, hi


# -- THD <-> BSHD --------------------------------------------------------------------------------
def pack_sequences(sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, PackedLayout]:
    """Concatenate ``[L_i, ...]`` tensors into one ``[sum L_i, ...]`` stream and its layout."""
    if len(sequences) == 0:
        raise ValueError(
            "pack_sequences got no sequences: it cannot infer the feature shape; build an empty "
            "stream as torch.empty(0, ...) with PackedLayout.from_lengths([])"
        )
    tail = sequences[0].shape[1:]
    for i, s in enumerate(sequences):
        if s.shape[1:] != tail:
            raise ValueError(
                f"sequences[{i}].shape = {tuple(s.shape)}: every sequence must be [L, "
                f"{', '.join(map(str, tail))}] like sequences[0]"
            )
    layout = PackedLayout([s.shape[0] for s in sequences], sequences[0].device)
    return torch.cat(list(sequences), dim=0), layout


def unpack_sequences(x: torch.Tensor, layout: PackedLayout) -> list[torch.Tensor]:
    """Split a packed stream back into one tensor per segment (views)."""
    _check_stream(x, layout, "x")
    return list(torch.split(x, list(layout.lengths), dim=0))


def lengths_from_attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """Lengths of a right-padded ``[B, S]`` 0/1 mask; raises when a row is not right-padded."""
    if mask.dim() != 2:
        raise ValueError(f"attention_mask.shape = {tuple(mask.shape)}: expected [batch, seq]")
    m = mask.to(torch.bool)
    lengths = m.sum(dim=1)
    expect = torch.arange(m.shape[1], device=m.device)[None, :] < lengths[:, None]
    if not torch.equal(m, expect):
        bad = int((m != expect).any(dim=1).nonzero()[0])
        raise ValueError(
            f"attention_mask row {bad} is not right-padded (real tokens first, then padding); "
            "left-padded batches must be shifted left before packing"
        )
    return lengths


def _padded_flat_index(layout: PackedLayout, seq_len: int) -> torch.Tensor:
    """For every packed token, its row in the flattened ``[B * seq_len]`` padded batch."""
    return layout.segment_ids * seq_len + layout.positions


def pack_padded(
    x: torch.Tensor, lengths: Sequence[int] | torch.Tensor
) -> tuple[torch.Tensor, PackedLayout]:
    """Right-padded ``[B, S, ...]`` -> packed ``[sum(lengths), ...]`` and its layout."""
    if x.dim() < 2:
        raise ValueError(f"x.shape = {tuple(x.shape)}: expected [batch, seq, ...]")
    layout = PackedLayout.from_lengths(lengths, x.device)
    b, s = x.shape[:2]
    if layout.num_segments != b:
        raise ValueError(f"len(lengths) = {layout.num_segments} but x has batch size {b}")
    if layout.max_seqlen > s:
        raise ValueError(
            f"max(lengths) = {layout.max_seqlen} exceeds the padded length {s} of x; lengths "
            "count real tokens per row"
        )
    flat = x.reshape(b * s, *x.shape[2:])
    return flat.index_select(0, _padded_flat_index(layout, s)), layout


def unpack_to_padded(
    x: torch.Tensor,
    layout: PackedLayout,
    *,
    seq_len: int | None = None,
    fill_value: float = 0.0,
) -> torch.Tensor:
    """Packed ``[T, ...]`` -> right-padded ``[B, seq_len or max_seqlen, ...]`` (differentiable)."""
    _check_stream(x, layout, "x")
    s = layout.max_seqlen if seq_len is None else seq_len
    if s < layout.max_seqlen:
        raise ValueError(f"seq_len = {s} < max segment length {layout.max_seqlen}")
    b = layout.num_segments
    out = x.new_full((b * s, *x.shape[1:]), fill_value)
    out = out.index_copy(0, _padded_flat_index(layout, s), x)
    return out.reshape(b, s, *x.shape[1:])


def _check_stream(x: torch.Tensor, layout: PackedLayout, name: str) -> None:
    if x.shape[0] != layout.num_tokens:
        raise ValueError(
            f"{name}.shape[0] = {x.shape[0]} but the layout holds {layout.num_tokens} tokens; "
            "pass the packed stream that belongs to this layout"
        )


# -- batching segments by length -----------------------------------------------------------------
@dataclass(frozen=True)
class LengthBucket:
    """Segments ``members`` (indices into the lengths) padded to ``padded_length`` together."""

    padded_length: int
    members: tuple[int, ...]


def plan_length_buckets(
    lengths: Sequence[int], *, align: int = 64, call_cost: float = 0.0
) -> list[LengthBucket]:
    """Group segments into buckets padded to a common length, minimising quadratic work.

    The cost of a bucket is ``len(members) * padded_length**2 + call_cost`` (``call_cost`` is the
    fixed price of one more kernel call, in the same token-squared units); lengths are first rounded
    up to ``align``.  Solved exactly by dynamic programming over the distinct rounded lengths, so a
    bucket always holds a contiguous range of lengths.  Empty segments are left out.
    """
    if align < 1:
        raise ValueError(f"align = {align}: must be >= 1")
    rounded: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            rounded.setdefault(math.ceil(n / align) * align, []).append(i)
    keys = sorted(rounded)
    m = len(keys)
    if m == 0:
        return []
    counts = [len(rounded[k]) for k in keys]
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    best = [0.0] + [math.inf] * m
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        p2 = float(keys[j - 1]) ** 2
        for i in range(j):
            cost = best[i] + (prefix[j] - prefix[i]) * p2 + call_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets: list[LengthBucket] = []
    j = m
    while j > 0:
        i = cut[j]
        members = tuple(x for k in keys[i:j] for x in rounded[k])
        buckets.append(LengthBucket(keys[j - 1], members))
        j = i
    return buckets[::-1]
