"""DeepSeek-V4-style attention under context parallelism: CP=2 over gloo equals CP=1."""

from __future__ import annotations

import torch

from mizzen_ci import register_cpu_ci
from mizzen_plugins.context_parallel import SPLITS, shard_packed_stream
from mizzen_plugins.deepseek_v4 import DeepSeekV4Attention, DeepSeekV4AttentionConfig
from mizzen_plugins.thd import PackedLayout

register_cpu_ci(est_time=40, labels=["context-parallel", "attention", "plugins"])

# (lengths, window, ratio): segments crossing chunk boundaries; the second case has chunks (3
# tokens under the load-balanced split) shorter than the halo (4), so halos span several chunks.
CASES = [([7, 33, 1, 20, 3, 1], 4, 3), ([5, 6], 5, 2), ([40], 3, 4)]


def make_module(window, ratio):
    cfg = DeepSeekV4AttentionConfig(
        hidden_size=16,
        num_heads=2,
        q_lora_rank=8,
        nope_head_dim=6,
        rope_head_dim=4,
        window=window,
        compress_ratio=ratio,
        index_heads=2,
        index_head_dim=4,
        index_topk=2,
    )
    torch.manual_seed(0)
    module = DeepSeekV4Attention(cfg).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def run(module, x, layout, impl, w, topk=None):
    module.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    res = module(xx, layout, impl=impl, topk=topk)
    (res.output * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return res, xx.grad, grads


def check_module_cp():
    """Runs in each rank of a 2-rank gloo group."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    tol = {"rtol": 1e-10, "atol": 1e-10}
    for lengths, window, ratio in CASES:
        module = make_module(window, ratio)
        layout = PackedLayout(lengths)
        g = torch.Generator().manual_seed(sum(lengths))
        x = torch.randn(layout.num_tokens, 16, generator=g, dtype=torch.float64)
        w = torch.randn(layout.num_tokens, 16, generator=g, dtype=torch.float64)
        single, single_gx, single_gp = run(module, x, layout, "reference", w)
        for split in SPLITS:
            for impl in ("reference", "fast"):
                s = shard_packed_stream(layout, world, rank, split)
                res, gx, gp = run(module, s.take(x), s, impl, s.take(w))
                real = s.local_real_mask
                where = f"{lengths} {split} {impl}"
                torch.testing.assert_close(
                    res.output[real], s.take(single.output.detach())[real], **tol, msg=where
                )
                assert torch.equal(res.topk[real], s.take(single.topk)[real]), where
                torch.testing.assert_close(gx[real], s.take(single_gx)[real], **tol, msg=where)
                for name, grad in gp.items():  # parameter grads are partial per rank: sum them
                    dist.all_reduce(grad)
                    torch.testing.assert_close(grad, single_gp[name], **tol, msg=f"{where} {name}")
                # the single-rank record, sliced to this rank, replays under CP
                replay = module(s.take(x), s, impl=impl, topk=s.take(single.topk, pad_value=-1))
                torch.testing.assert_close(
                    replay.output.detach()[real], s.take(single.output.detach())[real], **tol
                )


def test_module_cp2_gloo_equals_cp1_both_splits(run_ranks):
    run_ranks(check_module_cp, world_size=2)
