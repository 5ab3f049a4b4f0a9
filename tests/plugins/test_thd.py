"""THD layout and index helpers against brute-force per-segment computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_plugins.thd import (
    PackedLayout,
    compressed_groups,
    indexer_key_ranges,
    lengths_from_attention_mask,
    pack_padded,
    pack_sequences,
    plan_length_buckets,
    positions_from_cu_seqlens,
    segment_ids_from_cu_seqlens,
    sliding_window_key_indices,
    unpack_sequences,
    unpack_to_padded,
)

register_cpu_ci(est_time=15, labels=["thd", "plugins"])

# Named edge shapes; ratio 4 is used for the group checks.
EDGE_LAYOUTS = {
    "uniform": [8, 8, 8],
    "short_tail": [9, 10, 3],
    "below_ratio": [1, 2, 3],
    "exactly_ratio": [4, 4],
    "one_token_segments": [1, 1, 1, 1, 1],
    "empty_stream": [],
    "empty_segments": [0, 5, 0, 0, 2],
    "single_long": [203],
}

lengths_strategy = st.lists(st.integers(0, 23), min_size=0, max_size=7)


def brute_tokens(lengths):
    """(segment, position, segment start) of every token, by walking the stream."""
    out = []
    start = 0
    for s, n in enumerate(lengths):
        for p in range(n):
            out.append((s, p, start))
        start += n
    return out


def check_layout(lengths):
    layout = PackedLayout.from_lengths(lengths)
    tokens = brute_tokens(lengths)
    assert layout.num_tokens == len(tokens)
    assert layout.max_seqlen == max(lengths, default=0)
    assert layout.cu_seqlens.tolist() == [0, *itertools.accumulate(lengths)]
    assert layout.segment_ids.tolist() == [s for s, _, _ in tokens]
    assert layout.positions.tolist() == [p for _, p, _ in tokens]
    assert (
        segment_ids_from_cu_seqlens(layout.cu_seqlens, layout.num_tokens).tolist()
        == layout.segment_ids.tolist()
    )
    assert (
        positions_from_cu_seqlens(layout.cu_seqlens, layout.num_tokens).tolist()
        == layout.positions.tolist()
    )
    again = PackedLayout.from_cu_seqlens(layout.cu_seqlens)
    assert again.lengths == tuple(lengths) and again == layout


def check_window(lengths, window):
    layout = PackedLayout(lengths)
    idx, valid = sliding_window_key_indices(layout, window)
    assert idx.shape == valid.shape == (layout.num_tokens, window)
    for t, (_, _, start) in enumerate(brute_tokens(lengths)):
        for j in range(window):
            key = t - window + 1 + j
            assert bool(valid[t, j]) == (key >= start)
            assert int(idx[t, j]) == max(key, start)


def check_groups(lengths, ratio):
    layout = PackedLayout(lengths)
    groups = compressed_groups(layout, ratio)
    expect = []  # (segment, g, first token, end position)
    start = 0
    for s, n in enumerate(lengths):
        for g in range(n // ratio):
            expect.append((s, g, start + g * ratio, (g + 1) * ratio - 1))
        start += n
    assert groups.num_groups == len(expect)
    assert groups.counts == tuple(n // ratio for n in lengths)
    assert groups.segment.tolist() == [e[0] for e in expect]
    assert groups.index_in_segment.tolist() == [e[1] for e in expect]
    assert groups.start_token.tolist() == [e[2] for e in expect]
    assert groups.end_position.tolist() == [e[3] for e in expect]
    seg = layout.segment_ids
    for row in groups.token_indices.tolist():  # never crosses a segment, consecutive tokens
        assert len({int(seg[t]) for t in row}) == 1
        assert row == list(range(row[0], row[0] + ratio))
    lo, hi = indexer_key_ranges(layout, ratio)
    first_group = list(itertools.accumulate([0, *groups.counts]))
    for t, (s, p, _) in enumerate(brute_tokens(lengths)):
        visible = [
            i for i, e in enumerate(expect) if e[0] == s and e[3] <= p
        ]  # complete groups of t's own segment
        assert int(lo[t]) == first_group[s]
        assert list(range(int(lo[t]), int(hi[t]))) == visible


@pytest.mark.parametrize("name", list(EDGE_LAYOUTS))
def test_layout_edges(name):
    check_layout(EDGE_LAYOUTS[name])


@pytest.mark.parametrize("name", list(EDGE_LAYOUTS))
@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_indices_edges(name, window):
    check_window(EDGE_LAYOUTS[name], window)


@pytest.mark.parametrize("name", list(EDGE_LAYOUTS))
@pytest.mark.parametrize("ratio", [1, 4])
def test_groups_and_indexer_ranges_edges(name, ratio):
    check_groups(EDGE_LAYOUTS[name], ratio)


@settings(max_examples=60, deadline=None)
@given(lengths_strategy, st.integers(1, 9), st.integers(1, 6))
def test_helpers_random_layouts(lengths, window, ratio):
    check_layout(lengths)
    check_window(lengths, window)
    check_groups(lengths, ratio)


def test_exactly_ratio_segment_has_one_group_visible_only_at_its_end():
    layout = PackedLayout([4])
    lo, hi = indexer_key_ranges(layout, 4)
    assert (hi - lo).tolist() == [0, 0, 0, 1]


@settings(max_examples=30, deadline=None)
@given(lengths_strategy)
def test_pack_sequences_roundtrip(lengths):
    seqs = [torch.randn(n, 3, 2) for n in lengths] or [torch.randn(0, 3, 2)]
    packed, layout = pack_sequences(seqs)
    assert packed.shape == (sum(lengths), 3, 2)
    for a, b in zip(unpack_sequences(packed, layout), seqs, strict=True):
        assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(lengths_strategy, st.integers(0, 3))
def test_padded_packed_roundtrip(lengths, extra):
    s = max(lengths, default=0) + extra
    x = torch.randn(len(lengths), s, 5)
    packed, layout = pack_padded(x, lengths)
    brute = torch.cat([x[b, :n] for b, n in enumerate(lengths)] or [x.new_zeros(0, 5)])
    assert torch.equal(packed, brute)
    back = unpack_to_padded(packed, layout, seq_len=s)
    mask = torch.arange(s)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
    assert torch.equal(back, x * mask[..., None])


def test_unpack_to_padded_is_differentiable_and_fills():
    packed, layout = pack_sequences([torch.randn(2, 3), torch.randn(4, 3)])
    packed.requires_grad_(True)
    padded = unpack_to_padded(packed, layout, fill_value=-7.0)
    assert padded.shape == (2, 4, 3) and bool((padded[0, 2:] == -7.0).all())
    (padded * 2).sum().backward()
    assert torch.equal(packed.grad, torch.full_like(packed, 2.0))


def test_attention_mask_lengths_and_left_padding_rejected():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert lengths_from_attention_mask(mask).tolist() == [2, 3, 0]
    with pytest.raises(ValueError, match="row 0 is not right-padded"):
        lengths_from_attention_mask(torch.tensor([[0, 1, 1]]))


def test_invalid_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        PackedLayout([3, -1])
    with pytest.raises(ValueError, match="must start with 0"):
        PackedLayout.from_cu_seqlens(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        PackedLayout.from_cu_seqlens([0, 5, 3])
    with pytest.raises(ValueError, match="ratio 0 means"):
        compressed_groups(PackedLayout([4]), 0)
    with pytest.raises(ValueError, match="layout holds 3 tokens"):
        unpack_sequences(torch.zeros(4), PackedLayout([3]))
    with pytest.raises(ValueError, match="exceeds the padded length"):
        pack_padded(torch.zeros(1, 2, 1), [3])


def bucket_cost(buckets, call_cost):
    return sum(len(b.members) * b.padded_length**2 + call_cost for b in buckets)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=6), st.sampled_from([0.0, 5000.0, 1e6]))
def test_length_buckets_cover_and_are_optimal(lengths, call_cost):
    align = 32
    buckets = plan_length_buckets(lengths, align=align, call_cost=call_cost)
    members = sorted(m for b in buckets for m in b.members)
    assert members == [i for i, n in enumerate(lengths) if n > 0]
    for b in buckets:
        assert b.padded_length % align == 0
        assert all(lengths[m] <= b.padded_length for m in b.members)
    # exhaustive: every partition of the distinct rounded lengths into contiguous runs
    rounded = sorted({math.ceil(n / align) * align for n in lengths if n > 0})
    counts = {
        r: sum(1 for n in lengths if n > 0 and math.ceil(n / align) * align == r) for r in rounded
    }
    best = math.inf
    for cuts in itertools.product([False, True], repeat=max(len(rounded) - 1, 0)):
        cost, run = 0.0, 0
        for i, r in enumerate(rounded):
            run += counts[r]
            if i == len(rounded) - 1 or cuts[i]:
                cost += run * r * r + call_cost
                run = 0
        best = min(best, cost)
    assert bucket_cost(buckets, call_cost) == (best if rounded else 0)


def test_layout_of_input_ids_rows_streams_and_mismatches():
    """Every model plugin takes its layout from here: [B, L] rows, a [T] stream with or without
    cu_seqlens (a tensor or a layout), and the refusals of shapes that do not fit."""
    rows = torch.zeros(3, 5, dtype=torch.long)
    assert PackedLayout.of_input_ids(rows).lengths == (5, 5, 5)
    stream = torch.zeros(9, dtype=torch.long)
    assert PackedLayout.of_input_ids(stream).lengths == (9,)
    cu = torch.tensor([0, 4, 4, 9])
    assert PackedLayout.of_input_ids(stream, cu).lengths == (4, 0, 5)
    layout = PackedLayout.from_lengths([2, 7])
    assert PackedLayout.of_input_ids(stream, layout) == layout
    with pytest.raises(ValueError, match="not both"):
        PackedLayout.of_input_ids(rows, cu)
    with pytest.raises(ValueError, match=r"must be \[T\] or \[B, L\], got \(1, 1, 9\)"):
        PackedLayout.of_input_ids(stream.view(1, 1, 9))
    with pytest.raises(ValueError, match="describes 9 tokens but input_ids has 8"):
        PackedLayout.of_input_ids(stream[:8], cu)
