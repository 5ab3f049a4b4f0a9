"""GPU: every fast causal THD path (bucketed SDPA, flex, varlen, cuDNN ragged) equals the reference
in bf16, forward and backward."""

from __future__ import annotations

import os

import pytest
import torch

from mizzen_ci import register_cuda_ci
from mizzen_plugins.attention import causal_thd_attention
from mizzen_plugins.thd import PackedLayout

register_cuda_ci(
    est_time=100,
    hardware=["hopper"],
    num_gpus=1,
    labels=["attention", "thd", "plugins"],
    shares_gpu=True,
)

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def lognormal_lengths(total, lo, hi, gen):
    out = []
    while sum(out) < total:
        n = int(torch.empty(1).log_normal_(6.0, 1.2, generator=gen).clamp(lo, hi))
        out.append(min(n, total - sum(out)))
    return [n for n in out if n > 0]


def forward_backward(attend, q, k, v, w, impls) -> dict[str, tuple[torch.Tensor, ...]]:
    """``(out, dq, dk, dv)`` per implementation of ``attend(q, k, v, impl)`` for the loss
    ``sum(out * w)``, each from fresh leaf copies of the inputs."""
    results = {}
    for which in impls:
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = attend(qq, kk, vv, impl=which)
        (out.float() * w.float()).sum().backward()
        results[which] = (out.detach(), qq.grad, kk.grad, vv.grad)
    return results


def thd(layout):
    """``attend`` of :func:`forward_backward` for the THD path over ``layout`` (a
    :class:`PackedLayout` or its ``cu_seqlens``)."""
    return lambda *qkv, impl: causal_thd_attention(*qkv, layout, impl=impl)


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("impl", ["fast", "flex", "varlen", "cudnn"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 8, 128), (8, 2, 64)])
def test_matches_reference_bf16_forward_backward(impl, hq, hkv, d):
    gen = torch.Generator().manual_seed(SEED)
    lengths = [1, 7, *lognormal_lengths(6000, 16, 2048, gen), 129]
    layout = PackedLayout(lengths, "cuda")
    t = layout.num_tokens
    dev = torch.device("cuda")
    q = torch.randn(t, hq, d, generator=gen).to(dev, torch.bfloat16)
    k = torch.randn(t, hkv, d, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(t, hkv, d, generator=gen).to(dev, torch.bfloat16)
    w = torch.randn(t, hq, d, generator=gen).to(dev, torch.bfloat16)
    assert q.abs().sum() > 0 and v.abs().sum() > 0
    results = forward_backward(thd(layout.cu_seqlens), q, k, v, w, ("reference", impl))
    ref, got = results["reference"], results[impl]
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (t, hq, d)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        err = rel_err(a, b)
        assert err < 2e-2, (
            f"{impl} {name}: relative error {err:.3g} (seed {SEED}, lengths {lengths[:6]}...)"
        )


def test_fast_float32_matches_reference_closely():
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(SEED)
    lengths = lognormal_lengths(3000, 1, 1500, gen)
    layout = PackedLayout(lengths, "cuda")
    q, k, v = (torch.randn(layout.num_tokens, 4, 64, generator=gen).cuda() for _ in range(3))
    fast = causal_thd_attention(q, k, v, layout, impl="fast")
    ref = causal_thd_attention(q, k, v, layout, impl="reference")
    torch.testing.assert_close(fast, ref, rtol=2e-4, atol=2e-4, msg=f"seed {SEED}")


def test_fast_bottom_right_pieces_sharing_keys_bf16():
    # context-parallel shaped pieces (a rank holding two chunks of one long segment, and tails
    # of segments) through the padded-bucket kernel, against the float32 reference
    from mizzen_plugins.attention import AttentionPieces, causal_attention_pieces

    gen = torch.Generator().manual_seed(SEED)
    lengths = [3000, 700, 1500, 9, 20]  # the last segment has no queries here
    chunks = [(500, 1000), (2500, 3000), (3000, 3700), (4900, 5200), (5200, 5209)]
    seg_of = [0, 0, 3000, 3700, 5200]
    q_len = [b - a for a, b in chunks]
    k_len = [b - s for (_, b), s in zip(chunks, seg_of, strict=True)]
    q_start = [sum(q_len[:i]) for i in range(len(chunks))]
    pieces = AttentionPieces(tuple(q_start), tuple(seg_of), tuple(q_len), tuple(k_len))
    t, tq = sum(lengths), sum(q_len)
    dev = torch.device("cuda")
    q = torch.randn(tq, 8, 128, generator=gen).to(dev, torch.bfloat16)
    k, v = (torch.randn(t, 8, 128, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    w = torch.randn(tq, 8, 128, generator=gen).to(dev)
    results = forward_backward(
        lambda *qkv, impl: causal_attention_pieces(*qkv, pieces, impl=impl),
        q, k, v, w, ("reference", "fast"),
    )  # fmt: skip
    pairs = zip(("out", "dq", "dk", "dv"), results["fast"], results["reference"], strict=True)
    for name, a, b in pairs:
        assert rel_err(a, b) < 2e-2, f"pieces {name}: {rel_err(a, b):.3g} (seed {SEED})"
    untouched = torch.arange(t, device=dev) >= 5209
    assert bool((results["fast"][2][untouched] == 0).all())


def test_auto_takes_cudnn_ragged_on_hopper():
    from mizzen_plugins.attention import cudnn_ragged

    gen = torch.Generator().manual_seed(SEED)
    layout = PackedLayout([5, *lognormal_lengths(3000, 16, 1024, gen)], "cuda")
    q, k, v = (
        torch.randn(layout.num_tokens, 4, 64, generator=gen).to("cuda", torch.bfloat16)
        for _ in range(3)
    )
    assert cudnn_ragged.usable(q, k, v), (
        "cuDNN ragged attention is not usable on this Hopper machine: the GPU image needs the "
        "nvidia-cudnn-frontend package (README, GPU lanes)"
    )
    auto = causal_thd_attention(q, k, v, layout, impl="auto")
    ragged = causal_thd_attention(q, k, v, layout, impl="cudnn")
    assert torch.equal(auto, ragged)


def test_auto_without_cudnn_ragged_runs_varlen_then_buckets(monkeypatch):
    from mizzen_plugins.attention import causal, cudnn_ragged

    monkeypatch.setattr(cudnn_ragged, "usable", lambda *tensors: False)

    gen = torch.Generator().manual_seed(SEED)
    lengths = [3, *lognormal_lengths(5000, 16, 2048, gen), 64]
    layout = PackedLayout(lengths, "cuda")
    t = layout.num_tokens
    q, k, v, w = (torch.randn(t, 4, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    with torch.no_grad():
        ref = causal_thd_attention(q, k, v, layout, impl="reference")
    causal._BUILT_SHAPES.clear()  # every bucket shape unbuilt: the first call goes varlen
    outs = []
    for _ in range(3):
        qq = q.clone().requires_grad_(True)
        out = causal_thd_attention(qq, k, v, layout, impl="auto")
        (out.float() * w.float()).sum().backward()
        outs.append((out.detach(), qq.grad))
        assert rel_err(out, ref) < 2e-2, f"auto call {len(outs)} (seed {SEED})"
    plan = next(
        p for key, p in layout.__dict__["_plan_cache"].items() if key[0] == "causal_bucket_plan"
    )
    assert plan.calls[0] == 3  # one varlen call, then two bucketed calls
    assert {s[:4] for s in causal._BUILT_SHAPES} == {(n, 4, p, 64) for _, n, p in plan.buckets}
    for name, a, b in (("out", outs[1][0], outs[0][0]), ("dq", outs[1][1], outs[0][1])):
        assert rel_err(a, b) < 2e-2, f"varlen vs buckets {name} (seed {SEED})"


def test_cudnn_ragged_reuses_a_graph_across_layouts_and_skips_empty_segments():
    """Two layouts of one shape class (same rounded sizes) share built graphs and both match the
    reference; length-0 segments anywhere in the stream contribute nothing; a stream holding
    segments on both sides of a group bound (2,048) runs one launch per group, each writing its
    own segments' rows."""
    from mizzen_plugins.attention import cudnn_ragged

    gen = torch.Generator().manual_seed(SEED)
    dev = torch.device("cuda")
    layouts = [[0, 300, 5, 0, 700, 24], [650, 0, 1, 333, 45, 0]]
    built = []
    for lengths in [*layouts, [0, 300, 2500, 5, 0, 700], [2100, 7, 0]]:
        layout = PackedLayout(lengths, "cuda")
        t = layout.num_tokens
        q, k, v, w = (torch.randn(t, 4, 64, generator=gen).to(dev, torch.bfloat16) for _ in "qkvw")
        results = forward_backward(thd(layout), q, k, v, w, ("reference", "cudnn"))
        for name, a, b in zip(
            ("out", "dq", "dk", "dv"), results["cudnn"], results["reference"], strict=True
        ):
            err = rel_err(a, b)
            assert err < 2e-2, f"{lengths}: cudnn {name} relative error {err:.3g} (seed {SEED})"
        built.append(len(cudnn_ragged._GRAPHS))
    assert built[0] == built[1] >= 1, f"graphs built: {built} (the second layout rebuilt)"
    assert built[2] > built[1], f"graphs built: {built} (the two-group layout built none)"


@pytest.mark.parametrize("heads_kv", [4, 2])  # plain and grouped-query attention
def test_cudnn_ragged_groups_interleaved_in_the_stream_match_per_segment(heads_kv):
    """The common real mix: long documents separated by short ones, so each launch's ragged
    offsets skip over rows another launch writes.  Every segment's output and gradients are
    compared on their own (a global norm would hide one short segment gone wrong)."""
    from mizzen_plugins.attention import cudnn_ragged

    gen = torch.Generator().manual_seed(SEED)
    dev = torch.device("cuda")
    for lengths in ([3000, 100, 2500, 40, 2049], [0, 3000, 0, 100, 2500, 7]):
        groups = cudnn_ragged.segment_groups(lengths, cudnn_ragged.group_bounds())
        assert len(groups) == 2, groups
        layout = PackedLayout(lengths, "cuda")
        t = layout.num_tokens
        q, w = (torch.randn(t, 4, 64, generator=gen).to(dev, torch.bfloat16) for _ in "qw")
        k, v = (torch.randn(t, heads_kv, 64, generator=gen).to(dev, torch.bfloat16) for _ in "kv")
        results = forward_backward(thd(layout), q, k, v, w, ("reference", "cudnn"))
        for start, n in zip(layout.starts, layout.lengths, strict=True):
            if n == 0:
                continue
            rows = slice(start, start + n)
            for name, a, b in zip(
                ("out", "dq", "dk", "dv"), results["cudnn"], results["reference"], strict=True
            ):
                err = rel_err(a[rows], b[rows])
                assert err < 2e-2, (
                    f"{lengths}, kv heads {heads_kv}: segment at {start} (+{n}) {name} relative "
                    f"error {err:.3g} (seed {SEED})"
                )
