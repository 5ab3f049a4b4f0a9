"""Context parallelism over packed streams: shard layout, ownership, and CP=2 over gloo == CP=1."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_plugins.attention import causal_thd_attention
from mizzen_plugins.context_parallel import (
    SPLITS,
    all_gather_groups,
    all_gather_rows,
    context_parallel_causal_attention,
    exchange_left_halo,
    halo_rows,
    owned_groups,
    shard_packed_stream,
)
from mizzen_plugins.thd import PackedLayout, compressed_groups

register_cpu_ci(est_time=40, labels=["context-parallel", "thd", "plugins"])

LAYOUTS = [[7, 33, 1, 20, 3], [64], [1, 1, 1], [5, 0, 9, 30, 2, 2, 11]]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_shards_partition_the_padded_stream(lengths, cp, split):
    layout = PackedLayout(lengths)
    shards = [shard_packed_stream(layout, cp, r, split) for r in range(cp)]
    padded = shards[0].layout
    multiple = cp if split == "contiguous" else 2 * cp
    assert padded.num_tokens % multiple == 0
    assert padded.num_tokens - layout.num_tokens < multiple
    # the pad is its own segment appended after the real ones (never merged into one)
    if padded.num_tokens > layout.num_tokens:
        assert padded.lengths == (*lengths, padded.num_tokens - layout.num_tokens)
    else:
        assert padded.lengths == tuple(lengths)
    rows = torch.cat([s.local_token_index for s in shards])
    assert sorted(rows.tolist()) == list(range(padded.num_tokens))
    for r, s in enumerate(shards):
        assert s.num_local_tokens == padded.num_tokens // cp
        if split == "load_balanced":
            assert s.chunks == (r, 2 * cp - 1 - r)
        assert torch.equal(s.local_real_mask, s.local_token_index < layout.num_tokens)
        # the causal pieces cover the local queries once, each inside one segment
        covered = torch.zeros(s.num_local_tokens, dtype=torch.int64)
        for qs, ks, ql, kl in zip(
            *(getattr(s.causal_pieces, f) for f in ("q_start", "k_start", "q_len", "k_len")),
            strict=True,
        ):
            covered[qs : qs + ql] += 1
            g = s.local_token_index[qs : qs + ql]
            assert ks in padded.starts and int(g[-1]) == ks + kl - 1
            assert len(set(padded.segment_ids[g].tolist())) == 1
        assert bool((covered == 1).all())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=6),
    st.integers(1, 4),
    st.sampled_from(SPLITS),
    st.integers(1, 5),
    st.integers(0, 9),
)
def test_each_group_owned_by_exactly_one_rank_and_halo_reaches_it(lengths, cp, split, ratio, halo):
    layout = PackedLayout(lengths)
    shards = [shard_packed_stream(layout, cp, r, split) for r in range(cp)]
    groups = compressed_groups(shards[0].layout, ratio)
    owned = [owned_groups(s, groups) for s in shards]
    everything = sorted(torch.cat(owned).tolist())
    assert everything == list(range(groups.num_groups))  # once each, none missing
    for s, mine in zip(shards, owned, strict=True):
        local = set(s.local_token_index.tolist())
        assert all(int(groups.end_token[g]) in local for g in mine.tolist())  # owner: last token
        ext, local_in_ext = halo_rows(s, halo, torch.device("cpu"))
        assert bool((ext[1:] > ext[:-1]).all())  # unique, ascending
        assert torch.equal(ext[local_in_ext], s.local_token_index)
        for c in s.chunks:  # each chunk can see `halo` rows before it
            start = s.chunk_range(c)[0]
            assert set(range(max(0, start - halo), start)) <= set(ext.tolist())
        if halo >= ratio - 1:  # then the owner has every row of its groups
            assert set(groups.token_indices[mine].flatten().tolist()) <= set(ext.tolist())


def test_errors_name_the_fix():
    layout = PackedLayout([5, 6])
    with pytest.raises(ValueError, match="choose one of"):
        shard_packed_stream(layout, 2, 0, "striped")
    with pytest.raises(ValueError, match="need 0 <= rank < cp_size"):
        shard_packed_stream(layout, 2, 2)
    s = shard_packed_stream(layout, 2, 0)
    with pytest.raises(ValueError, match=r"pass shard\.take"):
        all_gather_rows(torch.zeros(3, 1), s)
    with pytest.raises(ValueError, match="expected the global stream"):
        s.take(torch.zeros(4, 1))


def test_single_rank_needs_no_process_group():
    layout = PackedLayout([5, 9])
    s = shard_packed_stream(layout, 1, 0, "load_balanced")
    q = torch.randn(14, 2, 4, dtype=torch.float64)
    out = context_parallel_causal_attention(s.take(q), s.take(q), s.take(q), s)
    want = causal_thd_attention(q, q, q, layout)
    torch.testing.assert_close(out[:14], want)


# -- two ranks over gloo -------------------------------------------------------------------------
def check_cp_matches_single_rank():
    """Runs in each rank of a 2-rank gloo group."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = [7, 33, 1, 20, 3, 1]
    layout = PackedLayout(lengths)
    t = layout.num_tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(t, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(t, 2, 6, generator=g, dtype=torch.float64)
    w = torch.randn(t, 4, 6, generator=g, dtype=torch.float64)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = causal_thd_attention(qq, kk, vv, layout, impl="reference")
    (ref * w).sum().backward()
    for split in SPLITS:
        for impl in ("reference", "fast"):
            s = shard_packed_stream(layout, world, rank, split)
            ql, kl, vl = (s.take(x).clone().requires_grad_(True) for x in (q, k, v))
            out = context_parallel_causal_attention(ql, kl, vl, s, impl=impl)
            (out * s.take(w)).sum().backward()
            real = s.local_real_mask
            torch.testing.assert_close(
                out[real], s.take(ref.detach())[real], rtol=1e-10, atol=1e-10
            )
            for mine, full in ((ql, qq), (kl, kk), (vl, vv)):
                torch.testing.assert_close(
                    mine.grad[real],
                    s.take(full.grad)[real],
                    rtol=1e-10,
                    atol=1e-10,
                    msg=f"{split}/{impl}",
                )

            # halo exchange: right rows forward, gradient returned to the owner backward
            stream = torch.randn(
                t, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64
            )
            xl = s.take(stream).clone().requires_grad_(True)
            ext = exchange_left_halo(xl, s, 6)
            full = torch.cat([stream, stream.new_zeros(s.num_pad_tokens, 3)])
            assert torch.equal(ext.rows.detach(), full[ext.global_index])
            weight = torch.arange(1, ext.rows.shape[0] + 1, dtype=torch.float64)[:, None]
            (ext.rows * weight).sum().backward()
            # expected grad of global row r: sum over ranks of the weights of ext rows holding r
            grad_full = torch.zeros(full.shape[0], dtype=torch.float64)
            grad_full.index_add_(0, ext.global_index, weight[:, 0])
            dist.all_reduce(grad_full)
            torch.testing.assert_close(xl.grad[:, 0], grad_full[s.local_token_index])

            # compressed groups: each owner's entries land at their global ids everywhere
            groups = compressed_groups(s.layout, 3)
            mine = owned_groups(s, groups)
            entries = (mine.to(torch.float64)[:, None] * 10).requires_grad_(True)
            gathered = all_gather_groups(entries, s, groups)
            assert torch.equal(gathered[:, 0], torch.arange(groups.num_groups) * 10.0)
            gathered.sum().backward()  # every rank uses every entry once -> grad = world
            assert bool((entries.grad == world).all())


def test_cp2_gloo_equals_cp1_forward_backward_both_splits(run_ranks):
    run_ranks(check_cp_matches_single_rank, world_size=2)
