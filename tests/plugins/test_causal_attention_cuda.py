"""GPU: the fast (length-bucketed SDPA) and flex causal THD paths equal the reference in bf16."""

from __future__ import annotations

import os

import pytest
import torch

from mizzen_ci import register_cuda_ci
from mizzen_plugins.attention import causal_thd_attention
from mizzen_plugins.thd import PackedLayout

register_cuda_ci(
    est_time=120, hardware=["hopper"], num_gpus=1, labels=["attention", "thd", "plugins"]
)

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def lognormal_lengths(total, lo, hi, gen):
    out = []
    while sum(out) < total:
        n = int(torch.empty(1).log_normal_(6.0, 1.2, generator=gen).clamp(lo, hi))
        out.append(min(n, total - sum(out)))
    return [n for n in out if n > 0]


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("impl", ["fast", "flex"])
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
    results = {}
    for which in ("reference", impl):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = causal_thd_attention(qq, kk, vv, layout.cu_seqlens, impl=which)
        (out.float() * w.float()).sum().backward()
        results[which] = (out.detach(), qq.grad, kk.grad, vv.grad)
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
