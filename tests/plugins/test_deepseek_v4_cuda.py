"""GPU: DeepSeek-V4-style attention fast and flex paths equal the reference within bf16 tolerance."""

from __future__ import annotations

import os

import pytest
import torch

from mizzen_ci import register_cuda_ci
from mizzen_plugins.deepseek_v4 import DeepSeekV4Attention, DeepSeekV4AttentionConfig
from mizzen_plugins.thd import PackedLayout

register_cuda_ci(
    est_time=75,
    hardware=["hopper"],
    num_gpus=1,
    labels=["attention", "thd", "plugins"],
    shares_gpu=True,
)

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def make(dtype, ratio=4):
    cfg = DeepSeekV4AttentionConfig(
        hidden_size=256,
        num_heads=8,
        q_lora_rank=128,
        nope_head_dim=48,
        rope_head_dim=16,
        window=64,
        compress_ratio=ratio,
        index_heads=4,
        index_head_dim=32,
        index_topk=16,
    )
    torch.manual_seed(SEED)
    module = DeepSeekV4Attention(cfg)
    with torch.no_grad():
        module.sink.normal_()
        if ratio:
            module.pool_position_bias.normal_()
    return module.to("cuda", dtype)


TOTAL_TOKENS = 5000  # fixed: random lengths, stable shapes, so compiled kernels are reused


def lengths_for(gen):
    out = [1, 3, 4, 5]
    while sum(out) < TOTAL_TOKENS:
        n = int(torch.empty(1).log_normal_(5.5, 1.0, generator=gen).clamp(8, 1500))
        out.append(min(n, TOTAL_TOKENS - sum(out)))
    return out


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def run(module, x, layout, impl, w, topk=None):
    module.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    res = module(xx, layout, impl=impl, topk=topk)
    (res.output.float() * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return res, xx.grad, grads


@pytest.mark.parametrize("impl", ["fast", "flex"])
@pytest.mark.parametrize("ratio", [0, 4])
def test_matches_reference_bf16(impl, ratio):
    gen = torch.Generator().manual_seed(SEED)
    module = make(torch.bfloat16, ratio)
    layout = PackedLayout(lengths_for(gen), "cuda")
    x = torch.randn(layout.num_tokens, 256, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(layout.num_tokens, 256, generator=gen).cuda()
    ref, ref_gx, ref_gp = run(module, x, layout, "reference", w)
    # replay the reference's choices so both paths attend to the same entries
    got, gx, gp = run(module, x, layout, impl, w, topk=ref.topk)
    assert rel_err(got.output, ref.output) < 2e-2, f"output (seed {SEED})"
    assert rel_err(gx, ref_gx) < 3e-2, f"grad x (seed {SEED})"
    for name, g in ref_gp.items():
        assert rel_err(gp[name], g) < 3e-2, f"grad {name} (seed {SEED})"
    if ratio:
        # the indexers themselves agree on nearly every choice (bf16 near-ties may differ)
        own = module(x, layout, impl=impl).topk
        agree = float((own == ref.topk).float().mean())
        assert agree > 0.98, f"indexer agreement {agree:.3f} (seed {SEED})"


def test_fast_float32_equals_reference_tightly():
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(SEED)
    module = make(torch.float32)
    layout = PackedLayout(lengths_for(gen), "cuda")
    x = torch.randn(layout.num_tokens, 256, generator=gen).cuda()
    ref = module(x, layout, impl="reference")
    fast = module(x, layout, impl="fast", topk=ref.topk)
    torch.testing.assert_close(fast.output, ref.output, rtol=1e-4, atol=1e-4, msg=f"seed {SEED}")


@pytest.mark.parametrize(("cp", "split"), [(1, None), (2, "load_balanced"), (3, "contiguous")])
def test_flash_window_kernel_equals_blocked_kernel(cp, split):
    # the varlen flash window (bf16) against the blocked float32 window, forward and the backward
    # contract (dO, O) -> dq, dk, dv, over a plan with halo rows when cp > 1
    from mizzen_plugins.context_parallel import shard_packed_stream
    from mizzen_plugins.deepseek_v4 import kernels
    from mizzen_plugins.deepseek_v4.stream import build_stream_plan

    gen = torch.Generator().manual_seed(SEED)
    layout = PackedLayout(lengths_for(gen), "cuda")
    target = layout if cp == 1 else shard_packed_stream(layout, cp, cp - 1, split)
    plan = build_stream_plan(target, 64, 4, torch.device("cuda"))
    te, h, d = plan.num_ext, 8, 64
    q, do, o = (torch.randn(te, h, d, generator=gen).cuda() for _ in range(3))
    k, v = (torch.randn(te, d, generator=gen).cuda() for _ in range(2))
    bf = [x.to(torch.bfloat16) for x in (q, k, v, do, o)]
    flash = kernels._FlashWindow(plan, d**-0.5)
    got_o, got_lse = flash.forward(*bf[:3])
    blocked = kernels._BlockedWindow(plan, d**-0.5)
    want_o, want_lse = blocked.forward(*(x.float() for x in bf[:3]))
    rows = plan.q_in_ext
    assert rel_err(got_o[rows], want_o[rows]) < 1e-2, f"window out (seed {SEED})"
    assert float((got_lse[rows] - want_lse[rows]).abs().max()) < 2e-2, f"lse (seed {SEED})"
    got = flash.backward(bf[3], *bf[:3], bf[4], got_lse)
    want = blocked.backward(bf[3].float(), *(x.float() for x in bf[:3]), bf[4].float(), want_lse)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert rel_err(a, b) < 2e-2, f"window {name} (seed {SEED})"


def test_fast_path_used_the_flash_window_kernel():
    from mizzen_plugins.deepseek_v4 import kernels

    gen = torch.Generator().manual_seed(SEED)
    module = make(torch.bfloat16)
    layout = PackedLayout(lengths_for(gen), "cuda")
    x = torch.randn(layout.num_tokens, 256, generator=gen).to("cuda", torch.bfloat16)
    out = module(x.requires_grad_(True), layout, impl="fast").output
    out.float().sum().backward()
    assert not kernels._FLASH_FAILED, kernels._FLASH_FAILED
    assert torch.isfinite(x.grad).all()
