"""Generic document-causal THD attention: every implementation equals each sequence run alone."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_plugins.attention import (
    AttentionPieces,
    causal_attention_pieces,
    causal_thd_attention,
    useful_causal_flops,
)
from mizzen_plugins.thd import PackedLayout

register_cpu_ci(est_time=25, labels=["attention", "thd", "plugins"])

EDGE_LAYOUTS = {
    "uniform": [16, 16, 16],
    "short_tail": [40, 33, 3],
    "one_token_segments": [1, 1, 1, 1],
    "empty_segments": [0, 7, 0, 70, 0],
    "single_long": [300],
    "mixed": [5, 64, 1, 130, 77],
}


def make_qkv(n, hq=4, hkv=2, d=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g, dtype=dtype)
    k = torch.randn(n, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(n, hkv, dv, generator=g, dtype=dtype)
    w = torch.randn(n, hq, dv, generator=g, dtype=dtype)  # a fixed upstream gradient
    return q, k, v, w


def alone(q, k, v, lengths, scale=None):
    """Each sequence on its own through torch's dense causal SDPA (GQA by expanding kv)."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        if n:
            qi = q[start : start + n].transpose(0, 1)
            ki = k[start : start + n].repeat_interleave(group, 1).transpose(0, 1)
            vi = v[start : start + n].repeat_interleave(group, 1).transpose(0, 1)
            outs.append(
                F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(
                    0, 1
                )
            )
        start += n
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


def out_and_grads(fn, q, k, v, w):
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(qq, kk, vv)
    if out.numel():
        (out * w).sum().backward()
        return out.detach(), (qq.grad, kk.grad, vv.grad)
    return out.detach(), None


def assert_same_as_alone(lengths, impl, hq=4, hkv=2, seed=0, scale=None):
    layout = PackedLayout(lengths)
    q, k, v, w = make_qkv(layout.num_tokens, hq=hq, hkv=hkv, seed=seed)
    got, got_g = out_and_grads(
        lambda a, b, c: causal_thd_attention(a, b, c, layout.cu_seqlens, impl=impl, scale=scale),
        q,
        k,
        v,
        w,
    )
    want, want_g = out_and_grads(lambda a, b, c: alone(a, b, c, lengths, scale), q, k, v, w)
    assert got.shape == (layout.num_tokens, hq, v.shape[-1])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if want_g is not None:
        for a, b in zip(got_g, want_g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("name", list(EDGE_LAYOUTS))
def test_equals_each_sequence_alone(name, impl):
    assert_same_as_alone(EDGE_LAYOUTS[name], impl)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_plain_multihead_and_custom_scale(impl):
    assert_same_as_alone([33, 9, 70], impl, hq=3, hkv=3, scale=0.3)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 90), max_size=6), st.integers(0, 10_000))
def test_random_layouts_fast_equals_alone(lengths, seed):
    assert_same_as_alone(lengths, "fast", seed=seed)


def test_empty_stream():
    q, k, v, _ = make_qkv(0)
    for impl in ("reference", "fast"):
        out = causal_thd_attention(q, k, v, torch.tensor([0]), impl=impl)
        assert out.shape == (0, 4, 6)


def test_flex_forward_matches_reference_on_cpu():
    # FlexAttention runs eagerly (forward only) on CPU: checks the block-mask logic at tiny size.
    lengths = [5, 64, 1, 130, 0, 77]
    layout = PackedLayout(lengths)
    q, k, v, _ = make_qkv(layout.num_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = causal_thd_attention(q, k, v, layout, impl="flex")
    torch.testing.assert_close(got, alone(q, k, v, lengths), rtol=1e-10, atol=1e-10)


def test_layout_reuses_its_plan_and_float32_inputs():
    layout = PackedLayout([100, 3, 250])
    q, k, v, _ = make_qkv(layout.num_tokens, dtype=torch.float32)
    a = causal_thd_attention(q, k, v, layout)
    n_cached = len(layout.__dict__["_plan_cache"])
    b = causal_thd_attention(q, k, v, layout)
    assert len(layout.__dict__["_plan_cache"]) == n_cached  # second call built nothing
    assert a.dtype == torch.float32 and torch.equal(a, b)
    torch.testing.assert_close(a, alone(q, k, v, [100, 3, 250]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_bottom_right_pieces(impl):
    # queries are the tails of segments (what a CP rank holds when a chunk starts mid-segment)
    lengths = [50, 20, 90]
    layout = PackedLayout(lengths)
    q, k, v, _ = make_qkv(layout.num_tokens, seed=3)
    tails = [(0, 30), (50, 20), (70, 1)]  # (segment start, first query position)
    starts = [s + p for s, p in tails]
    q_len = [n - p for n, (_, p) in zip(lengths, tails, strict=True)]
    q_rows = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, q_len, strict=True)])
    offs = [0, q_len[0], q_len[0] + q_len[1]]
    w = torch.randn(len(q_rows), 4, 6, dtype=torch.float64)
    pieces = AttentionPieces(tuple(offs), tuple(s for s, _ in tails), tuple(q_len), tuple(lengths))
    got, got_g = out_and_grads(
        lambda a, b, c: causal_attention_pieces(a[q_rows], b, c, pieces, impl=impl), q, k, v, w
    )
    want, want_g = out_and_grads(lambda a, b, c: alone(a, b, c, lengths)[q_rows], q, k, v, w)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_useful_flops_counts_the_causal_half():
    assert useful_causal_flops([1], 1, 1) == 4
    assert useful_causal_flops([4, 2], 2, 8) == 4 * 2 * 8 * (10 + 3)


def test_errors_name_the_fix():
    layout = PackedLayout([3, 4])
    q, k, v, _ = make_qkv(7)
    with pytest.raises(ValueError, match="describes 7 tokens"):
        causal_thd_attention(q[:6], k[:6], v[:6], layout)
    with pytest.raises(ValueError, match="not a multiple"):
        causal_thd_attention(q[:, :3], k, v, layout)
    with pytest.raises(ValueError, match="longest segment has 4"):
        causal_thd_attention(q, k, v, layout, max_seqlen=3)
    with pytest.raises(ValueError, match="choose one of"):
        causal_thd_attention(q, k, v, layout, impl="triton")
    with pytest.raises(ValueError, match="expected \\[tokens, heads, dim\\]"):
        causal_thd_attention(q[None], k, v, layout)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_packed_agrees_with_padded_bshd_sdpa(impl):
    from mizzen_plugins.thd import pack_padded, unpack_to_padded

    lengths = [9, 40, 1, 23]
    layout = PackedLayout(lengths)
    q, k, v, _ = make_qkv(layout.num_tokens, hq=2, hkv=2)
    padded = [unpack_to_padded(x, layout).transpose(1, 2) for x in (q, k, v)]  # [B, H, S, D]
    bshd = F.scaled_dot_product_attention(*padded, is_causal=True).transpose(1, 2)
    thd = causal_thd_attention(q, k, v, layout, impl=impl)
    torch.testing.assert_close(thd, pack_padded(bshd, lengths)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_pieces_sharing_keys_like_load_balanced_cp(impl):
    # one rank holding two query chunks of the same segment (load-balanced split): both pieces
    # read the segment's first keys, whose gradients must be summed over the pieces; the last
    # segment has no local queries, so its keys get exactly zero gradient
    lengths = [50, 90, 7, 3]
    q, k, v, _ = make_qkv(sum(lengths), seed=5)
    chunks = [(10, 20), (40, 50), (50, 140), (140, 147)]  # global query rows [a, b)
    q_rows = torch.cat([torch.arange(a, b) for a, b in chunks])
    seg_start = [0, 0, 50, 140]
    q_len = [b - a for a, b in chunks]
    k_len = [b - s for (_, b), s in zip(chunks, seg_start, strict=True)]
    q_start = [0, 10, 20, 110]
    pieces = AttentionPieces(tuple(q_start), tuple(seg_start), tuple(q_len), tuple(k_len))
    w = torch.randn(len(q_rows), 4, 6, dtype=torch.float64)
    got, got_g = out_and_grads(
        lambda a, b, c: causal_attention_pieces(a[q_rows], b, c, pieces, impl=impl), q, k, v, w
    )
    want, want_g = out_and_grads(lambda a, b, c: alone(a, b, c, lengths)[q_rows], q, k, v, w)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fast_forward_without_grad_builds_no_graph():
    layout = PackedLayout([30, 5, 64])
    q, k, v, _ = make_qkv(layout.num_tokens, seed=9)
    q.requires_grad_(True)
    with torch.no_grad():
        out = causal_thd_attention(q, k, v, layout, impl="fast")
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, alone(q.detach(), k, v, layout.lengths), rtol=1e-10, atol=1e-10)


def test_varlen_is_cuda_half_only_and_auto_stays_on_fast_on_cpu():
    layout = PackedLayout([5, 9])
    q, k, v, _ = make_qkv(14, dtype=torch.float32)
    with pytest.raises(ValueError, match='use impl="fast"'):
        causal_thd_attention(q, k, v, layout, impl="varlen")
    pieces = AttentionPieces((0,), (0,), (14,), (14,))
    with pytest.raises(ValueError, match="whole segments only"):
        causal_attention_pieces(q, k, v, pieces, impl="varlen")
    out = causal_thd_attention(q, k, v, layout, impl="auto")
    torch.testing.assert_close(out, alone(q, k, v, [5, 9]), rtol=1e-5, atol=1e-5)


def test_auto_prefers_cudnn_ragged_unless_its_padded_statistics_outweigh_the_queries(monkeypatch):
    from mizzen_plugins.attention import causal, cudnn_ragged

    monkeypatch.setattr(cudnn_ragged, "usable", lambda *tensors: True)  # as on a Hopper GPU
    heads, dim = 16, 128
    balanced = PackedLayout([8192, 4096, 711, 300, 64] * 8)
    skewed = PackedLayout([8192] + [64] * 1000)  # one group: 1,001 entries x 8,192 rows
    cases = (
        # one launch over every segment: the skewed mix's statistics outweigh its queries
        ("none", balanced, 4 * heads * 64 * 8192, True),
        ("none", skewed, 4 * heads * 1024 * 8192, False),
        # the default groups (<= 2048, longer): the short segments get their own short grid
        (None, balanced, 4 * heads * (32 * 1024 + 16 * 8192), True),
        (None, skewed, 4 * heads * (1024 * 64 + 1 * 8192), True),
    )
    for groups, layout, expected, preferred in cases:
        if groups is None:
            monkeypatch.delenv(cudnn_ragged.GROUPS_ENV, raising=False)
        else:
            monkeypatch.setenv(cudnn_ragged.GROUPS_ENV, groups)
        q = torch.empty(layout.num_tokens, heads, dim, dtype=torch.bfloat16)
        stats = cudnn_ragged.stats_bytes(layout, heads)
        assert stats == expected, (groups, layout)
        assert causal._cudnn_preferred(q, q, q, layout) is preferred, (groups, stats, q.nbytes)


def test_segments_are_grouped_by_length_in_stream_order(monkeypatch):
    from mizzen_plugins.attention import cudnn_ragged

    lengths = [3000, 5, 2048, 2049, 0, 700]
    assert cudnn_ragged.segment_groups(lengths, (2048,)) == [[1, 2, 5], [0, 3]]
    assert cudnn_ragged.segment_groups(lengths, (4, 2048)) == [[1, 2, 5], [0, 3]]
    assert cudnn_ragged.segment_groups([5, 9], (2048,)) == [[0, 1]]  # empty groups dropped
    assert cudnn_ragged.segment_groups(lengths, ()) == [[0, 1, 2, 3, 5]]
    # length-0 segments compute and write nothing: never a launch of padding entries only
    assert cudnn_ragged.segment_groups([3000, 0], (2048,)) == [[0]]
    assert cudnn_ragged.segment_groups([0, 0, 5000, 4100], (2048,)) == [[2, 3]]
    monkeypatch.delenv(cudnn_ragged.GROUPS_ENV, raising=False)
    assert cudnn_ragged.group_bounds() == cudnn_ragged.DEFAULT_GROUP_BOUNDS == (2048,)
    for raw, bounds in (("none", ()), ("", ()), (" 2048, 512 ,512", (512, 2048))):
        monkeypatch.setenv(cudnn_ragged.GROUPS_ENV, raw)
        assert cudnn_ragged.group_bounds() == bounds
    for raw in ("0", "-5,100", "big", "1e3"):
        monkeypatch.setenv(cudnn_ragged.GROUPS_ENV, raw)
        with pytest.raises(ValueError, match=r"MIZZEN_RAGGED_GROUPS=.*positive segment lengths"):
            cudnn_ragged.group_bounds()


def test_cudnn_is_refused_with_the_fix_where_it_cannot_run():
    layout = PackedLayout([5, 9])
    q, k, v, _ = make_qkv(14, dtype=torch.float32)
    with pytest.raises(ValueError, match=r'ragged fused attention.*use impl="fast"'):
        causal_thd_attention(q, k, v, layout, impl="cudnn")
    pieces = AttentionPieces((0,), (0,), (14,), (14,))
    with pytest.raises(ValueError, match="whole segments only"):
        causal_attention_pieces(q, k, v, pieces, impl="cudnn")
