"""GPU: DeepSeek-V4-style attention fast and flex paths equal the reference within bf16 tolerance."""

from __future__ import annotations

import os

import pytest
import torch

from mizzen_ci import register_cuda_ci
from mizzen_plugins.deepseek_v4 import DeepSeekV4Attention, DeepSeekV4AttentionConfig
from mizzen_plugins.thd import PackedLayout

register_cuda_ci(
    est_time=150, hardware=["hopper"], num_gpus=1, labels=["attention", "thd", "plugins"]
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


def lengths_for(gen):
    out = [1, 3, 4, 5]
    while sum(out) < 5000:
        out.append(int(torch.empty(1).log_normal_(5.5, 1.0, generator=gen).clamp(8, 1500)))
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
