"""GPU: CP=2 over NCCL (two spawned ranks, one GPU each) equals CP=1, causal and DeepSeek-V4.

The ranks are spawned by the root ``run_ranks`` launcher (``backend="nccl"``: fresh processes
that load this file by path, each on GPU ``rank``, NVLink SHARP off).
"""

from __future__ import annotations

import os

import torch

from mizzen_ci import register_cuda_ci
from mizzen_plugins.attention import causal_thd_attention
from mizzen_plugins.context_parallel import (
    SPLITS,
    context_parallel_causal_attention,
    shard_packed_stream,
)
from mizzen_plugins.deepseek_v4 import DeepSeekV4Attention, DeepSeekV4AttentionConfig
from mizzen_plugins.thd import PackedLayout

register_cuda_ci(
    est_time=120,
    hardware=["hopper"],
    num_gpus=2,
    labels=["context-parallel", "attention", "plugins"],
)


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_nccl_cp(seed):
    """Runs in each rank of a 2-rank NCCL group, on GPU ``rank``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 300, 57, 1000, 3, 640, 17]
    layout = PackedLayout(lengths, dev)
    t = layout.num_tokens
    q, k, v, w = (torch.randn(t, 4, 64, generator=gen).to(dev) for _ in range(4))
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = causal_thd_attention(qq, kk, vv, layout, impl="reference")
    (ref * w).sum().backward()
    for split in SPLITS:
        s = shard_packed_stream(layout, world, rank, split)
        ql, kl, vl = (s.take(x).clone().requires_grad_(True) for x in (q, k, v))
        out = context_parallel_causal_attention(ql, kl, vl, s, impl="fast")
        (out * s.take(w)).sum().backward()
        real = s.local_real_mask
        assert rel_err(out[real], s.take(ref.detach())[real]) < 1e-4, (split, seed)
        for mine, full in ((ql, qq), (kl, kk), (vl, vv)):
            assert rel_err(mine.grad[real], s.take(full.grad)[real]) < 1e-4, (split, seed)

    cfg = DeepSeekV4AttentionConfig(
        hidden_size=128,
        num_heads=4,
        q_lora_rank=64,
        nope_head_dim=48,
        rope_head_dim=16,
        window=32,
        compress_ratio=4,
        index_heads=2,
        index_head_dim=32,
        index_topk=8,
    )
    torch.manual_seed(seed)
    module = DeepSeekV4Attention(cfg).to(dev)
    with torch.no_grad():
        module.sink.normal_()
    x = torch.randn(t, 128, generator=gen).to(dev)
    wx = torch.randn(t, 128, generator=gen).to(dev)
    module.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    single = module(xx, layout, impl="reference")
    (single.output * wx).sum().backward()
    # the indexer's own weights get no gradient (its choice is discrete)
    single_gp = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    for split in SPLITS:
        s = shard_packed_stream(layout, world, rank, split)
        module.zero_grad(set_to_none=True)
        xl = s.take(x).clone().requires_grad_(True)
        res = module(xl, s, impl="fast", topk=s.take(single.topk, pad_value=-1))
        (res.output * s.take(wx)).sum().backward()
        real = s.local_real_mask
        assert rel_err(res.output[real], s.take(single.output.detach())[real]) < 1e-4, (split, seed)
        assert rel_err(xl.grad[real], s.take(xx.grad)[real]) < 1e-4, (split, seed)
        for name, p in module.named_parameters():
            assert (p.grad is not None) == (name in single_gp), name
            if p.grad is None:
                continue
            g = p.grad.clone()
            dist.all_reduce(g)
            assert rel_err(g, single_gp[name]) < 1e-4, (split, name, seed)


def test_cp2_nccl_equals_cp1(run_ranks):
    seed = int.from_bytes(os.urandom(4), "little")
    run_ranks(check_nccl_cp, world_size=2, args=(seed,), backend="nccl", timeout=300)
