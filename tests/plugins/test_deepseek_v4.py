"""DeepSeek-V4-style attention: brute force, reference vs fast, THD vs alone vs BSHD, replay."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from mizzen_ci import register_cpu_ci
from mizzen_plugins.deepseek_v4 import (
    DeepSeekV4Attention,
    DeepSeekV4AttentionConfig,
    DeepSeekV4AttentionStack,
)
from mizzen_plugins.deepseek_v4.indexer import select_fast, select_reference
from mizzen_plugins.deepseek_v4.stream import build_stream_plan
from mizzen_plugins.thd import PackedLayout, pack_padded, unpack_to_padded

register_cpu_ci(est_time=45, labels=["attention", "thd", "plugins"])

EDGE_LAYOUTS = {
    "uniform": [12, 12, 12],
    "short_tail": [13, 10, 2],
    "below_ratio": [1, 2, 3],
    "exactly_ratio": [4, 4],
    "one_token_segments": [1, 1, 1],
    "empty_stream": [],
    "single_long": [150],
}


def make_module(ratio=4, window=5, topk=3, seed=0, **kw):
    cfg = DeepSeekV4AttentionConfig(
        hidden_size=24,
        num_heads=2,
        q_lora_rank=12,
        nope_head_dim=6,
        rope_head_dim=4,
        window=window,
        compress_ratio=ratio,
        index_heads=2,
        index_head_dim=4,
        index_topk=topk,
        **kw,
    )
    torch.manual_seed(seed)
    module = DeepSeekV4Attention(cfg).double()
    with torch.no_grad():
        for p in module.parameters():  # fresh, non-trivial values (sink and pooling bias too)
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def stream(n, seed=1, hidden=24):
    return torch.randn(
        n, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )


# -- brute force: one token at a time, straight from the definition -------------------------------
def rope(x, pos, rope_dim, theta):
    half = rope_dim // 2
    out = x.clone()
    for i in range(half):
        ang = pos * theta ** (-i / half)
        a, b = x[..., -rope_dim + i], x[..., -rope_dim + half + i]
        out[..., -rope_dim + i] = a * math.cos(ang) - b * math.sin(ang)
        out[..., -rope_dim + half + i] = a * math.sin(ang) + b * math.cos(ang)
    return out


def brute_force_sequence(module, x):
    """Output ``[L, hidden]`` and chosen groups (list per token) of one sequence alone."""
    c = module.config
    n, h, d, m, w = x.shape[0], c.num_heads, c.head_dim, c.compress_ratio, c.window
    with torch.no_grad():
        cq = module.q_norm(module.wq_a(x))
        q_raw = module.wq_b(cq).view(n, h, d)
        kv = module.kv_norm(module.wkv(x))
        outs, chosen_all = [], []
        entries = []
        if m:
            gate = module.pool_gate(x)[:, 0]
            ik_tok = module.index_k(x)
            iq = module.index_q(cq).view(n, c.index_heads, c.index_head_dim)
            iw = module.index_weight(x) * c.index_heads**-0.5
            for g in range(n // m):
                rows = range(g * m, (g + 1) * m)
                alpha = torch.softmax(
                    torch.stack(
                        [gate[r] + module.pool_position_bias[j] for j, r in enumerate(rows)]
                    ),
                    0,
                )
                ckv = sum(alpha[j] * kv[r] for j, r in enumerate(rows))
                ik = sum(alpha[j] * ik_tok[r] for j, r in enumerate(rows))
                entries.append((rope(ckv, (g + 1) * m - 1, c.rope_head_dim, c.rope_theta), ckv, ik))
        for t in range(n):
            q = rope(q_raw[t], t, c.rope_head_dim, c.rope_theta)  # [h, d]
            keys = [
                (rope(kv[s], s, c.rope_head_dim, c.rope_theta), kv[s])
                for s in range(max(0, t - w + 1), t + 1)
            ]
            chosen = []
            if m:
                visible = range((t + 1) // m)
                scores = []
                for g in visible:
                    sc = sum(
                        iw[t, hh]
                        * torch.relu(iq[t, hh] @ entries[g][2] / math.sqrt(c.index_head_dim))
                        for hh in range(c.index_heads)
                    )
                    scores.append((-float(torch.tensor(float(sc), dtype=torch.float32)), g))
                chosen = [g for _, g in sorted(scores)[: c.index_topk]]
                keys += [(entries[g][0], entries[g][1]) for g in chosen]
            chosen_all.append(chosen)
            head_out = []
            for hh in range(h):
                logits = torch.stack([q[hh] @ k for k, _ in keys]) / math.sqrt(d)
                logits = torch.cat([logits, module.sink[hh : hh + 1]])
                p = torch.softmax(logits, 0)[:-1]
                head_out.append(sum(p[i] * keys[i][1] for i in range(len(keys))))
            outs.append(torch.cat(head_out))
        o = torch.stack(outs) if outs else x.new_zeros(0, h * d)
        return module.wo(o), chosen_all


def record_lists(record):
    return [[g for g in row if g >= 0] for row in record.tolist()]


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("ratio", [0, 1, 3])
@pytest.mark.parametrize("lengths", [[7, 1, 11], [4, 2, 9]])
def test_matches_brute_force(impl, ratio, lengths):
    module = make_module(ratio=ratio, window=4, topk=2)
    layout = PackedLayout(lengths)
    x = stream(layout.num_tokens)
    res = module(x, layout, impl=impl)
    start = 0
    for n in lengths:
        want, chosen = brute_force_sequence(module, x[start : start + n])
        torch.testing.assert_close(res.output[start : start + n], want, rtol=1e-10, atol=1e-10)
        if ratio:
            assert record_lists(res.topk[start : start + n]) == chosen
        start += n
    if ratio == 0:
        assert res.topk is None


def run(module, x, layout, impl, topk=None, seed=7):
    """Output, record, grad of x and of every parameter for a fixed upstream gradient."""
    module.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    res = module(xx, layout, impl=impl, topk=topk)
    w = torch.randn(
        res.output.shape, dtype=res.output.dtype, generator=torch.Generator().manual_seed(seed)
    )
    if res.output.numel():
        (res.output * w).sum().backward()
    grads = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in module.named_parameters()
    }
    return res.output.detach(), res.topk, xx.grad, grads


def assert_runs_close(a, b, tol=1e-10):
    torch.testing.assert_close(a[0], b[0], rtol=tol, atol=tol)
    if a[1] is None:
        assert b[1] is None
    else:
        assert torch.equal(a[1], b[1])
    if a[2] is not None:
        torch.testing.assert_close(a[2], b[2], rtol=tol, atol=tol)
    for name in a[3]:
        torch.testing.assert_close(a[3][name], b[3][name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("name", list(EDGE_LAYOUTS))
@pytest.mark.parametrize("ratio", [0, 4])
def test_fast_equals_reference_forward_backward(name, ratio):
    module = make_module(ratio=ratio)
    layout = PackedLayout(EDGE_LAYOUTS[name])
    x = stream(layout.num_tokens)
    assert_runs_close(run(module, x, layout, "fast"), run(module, x, layout, "reference"))


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("name", ["uniform", "short_tail", "below_ratio", "single_long"])
def test_thd_equals_each_sequence_alone(impl, name):
    lengths = EDGE_LAYOUTS[name]
    module = make_module(ratio=4)
    layout = PackedLayout(lengths)
    x = stream(layout.num_tokens)
    packed = run(module, x, layout, impl)
    w = torch.randn(
        packed[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7)
    )
    start = 0
    param_sum = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    for n in lengths:
        module.zero_grad(set_to_none=True)
        xs = x[start : start + n].clone().requires_grad_(True)
        res = module(xs, PackedLayout([n]), impl=impl)
        (res.output * w[start : start + n]).sum().backward()
        torch.testing.assert_close(
            packed[0][start : start + n], res.output.detach(), rtol=1e-10, atol=1e-10
        )
        assert torch.equal(packed[1][start : start + n], res.topk)
        torch.testing.assert_close(packed[2][start : start + n], xs.grad, rtol=1e-10, atol=1e-10)
        for pname, p in module.named_parameters():
            if p.grad is not None:
                param_sum[pname] += p.grad
        start += n
    for pname, g in param_sum.items():
        torch.testing.assert_close(packed[3][pname], g, rtol=1e-9, atol=1e-10, msg=pname)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_bshd_and_thd_agree(impl):
    module = make_module(ratio=3, window=4)
    lengths = [9, 2, 14, 0]
    x_pad = torch.randn(4, 16, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    xp = x_pad.clone().requires_grad_(True)
    bshd = module.forward_padded(xp, lengths, impl=impl)
    w = torch.randn(
        bshd.output.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    (bshd.output * w).sum().backward()
    x_thd, layout = pack_padded(x_pad, lengths)
    xt = x_thd.clone().requires_grad_(True)
    thd = module(xt, layout, impl=impl)
    (thd.output * pack_padded(w, lengths)[0]).sum().backward()
    torch.testing.assert_close(
        bshd.output,
        unpack_to_padded(thd.output.detach(), layout, seq_len=16),
        rtol=1e-10,
        atol=1e-10,
    )
    assert torch.equal(bshd.topk, unpack_to_padded(thd.topk, layout, seq_len=16, fill_value=-1))
    torch.testing.assert_close(pack_padded(xp.grad, lengths)[0], xt.grad, rtol=1e-10, atol=1e-10)
    # pad rows get no gradient: padding never leaks into real outputs
    mask = torch.arange(16)[None, :] >= torch.tensor(lengths)[:, None]
    assert bool((xp.grad[mask] == 0).all())


def test_replay_reproduces_output_and_is_really_used():
    module = make_module(ratio=2, topk=2)
    lengths = [20, 7, 15]
    layout = PackedLayout(lengths)
    x = stream(layout.num_tokens)
    first = run(module, x, layout, "fast")
    replayed = run(module, x, layout, "fast", topk=first[1])
    assert_runs_close(first, replayed, tol=0)
    # a different (valid) record changes the output: the record, not the indexer, decides
    other = first[1].clone()
    t = 19  # position 19 of the first segment: groups 0..9 selectable
    other[t] = torch.tensor([0, 1])
    assert not torch.equal(other[t], first[1][t])
    changed = module(x, layout, topk=other).output.detach()
    assert not torch.allclose(changed[t], first[0][t])
    torch.testing.assert_close(changed[:t], first[0][:t], rtol=0, atol=0)


def test_records_from_single_sequences_replay_in_a_packed_batch():
    # a rollout engine runs each sequence alone and records its choices; training packs them
    module = make_module(ratio=3, topk=2)
    lengths = [17, 5, 26]
    layout = PackedLayout(lengths)
    x = stream(layout.num_tokens)
    records, outs, start = [], [], 0
    for n in lengths:
        res = module(x[start : start + n], PackedLayout([n]))
        records.append(res.topk)
        outs.append(res.output.detach())
        start += n
    packed = module(x, layout, topk=torch.cat(records), impl="reference")
    torch.testing.assert_close(packed.output.detach(), torch.cat(outs), rtol=1e-10, atol=1e-10)


def test_replay_rejects_invalid_records():
    module = make_module(ratio=4, topk=2)
    layout = PackedLayout([8, 8])
    x = stream(16)
    rec = module(x, layout).topk.clone()
    bad = rec.clone()
    bad[5] = torch.tensor([1, -1])  # position 5 sees only group 0
    with pytest.raises(ValueError, match=r"topk\[5\].*groups 0..0"):
        module(x, layout, topk=bad)
    dup = rec.clone()
    dup[7] = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="twice"):
        module(x, layout, topk=dup)
    with pytest.raises(ValueError, match="expected \\[16, k\\]"):
        module(x, layout, topk=rec[:3])
    window_only = make_module(ratio=0)
    with pytest.raises(ValueError, match="compress_ratio = 0"):
        window_only(x, layout, topk=rec)


def test_flex_forward_matches_reference_on_cpu():
    module = make_module(ratio=3)
    for p in module.parameters():
        p.requires_grad_(False)
    layout = PackedLayout([13, 1, 40, 6])
    x = stream(layout.num_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = module(x, layout, impl="flex")
    ref = module(x, layout, impl="reference")
    torch.testing.assert_close(flex.output, ref.output, rtol=1e-10, atol=1e-10)
    assert torch.equal(flex.topk, ref.topk)


@pytest.mark.parametrize("seed", [0, 1])
def test_indexer_fast_equals_reference_with_ties(seed):
    # many exact ties: relu zeroes most scores; wide ranges exercise several buckets
    layout = PackedLayout([300, 5, 90, 1, 140])
    plan = build_stream_plan(layout, 4, 2, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    t, n_groups = layout.num_tokens, plan.groups.num_groups
    iq = torch.randn(t, 2, 4, generator=g, dtype=torch.float64) - 1.0
    iw = torch.randn(t, 2, generator=g, dtype=torch.float64)
    ik = torch.randn(n_groups, 4, generator=g, dtype=torch.float64)
    ref = select_reference(plan, iq, iw, ik, 5)
    fast = select_fast(plan, iq, iw, ik, 5)
    assert torch.equal(ref, fast)
    assert bool(((ref >= plan.lo[:, None]) | (ref < 0)).all())
    assert bool(((ref < plan.hi[:, None]) | (ref < 0)).all())


def test_stack_with_per_layer_ratios_and_replay():
    cfg = make_module().config
    torch.manual_seed(5)
    stack = DeepSeekV4AttentionStack(cfg, compress_ratios=[0, 4, 2]).double()
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    layout = PackedLayout([11, 30, 3])
    x = stream(layout.num_tokens)
    out, records = stack(x, layout)
    assert records[0] is None and records[1].shape == (44, 3) and records[2].shape == (44, 3)
    assert [layer.config.compress_ratio for layer in stack.layers] == [0, 4, 2]
    again, _ = stack(x, layout, topk=records, impl="reference")
    torch.testing.assert_close(again, out, rtol=1e-10, atol=1e-10)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rope_head_dim"):
        DeepSeekV4AttentionConfig(rope_head_dim=3)
    with pytest.raises(ValueError, match="compress_ratio"):
        DeepSeekV4AttentionConfig(compress_ratio=-1)
    with pytest.raises(ValueError, match="window"):
        DeepSeekV4AttentionConfig(window=0)
    module = make_module()
    with pytest.raises(ValueError, match="expected \\[5, 24\\]"):
        module(stream(4), PackedLayout([5]))
    with pytest.raises(ValueError, match="choose one of"):
        module(stream(5), PackedLayout([5]), impl="triton")


def test_plugin_builds_a_stack_from_an_hf_style_config():
    # the entry point itself is declared in packages/plugins/pyproject.toml by its owner; this
    # checks the object that entry point names
    from mizzen_plugins import ModelPlugin
    from mizzen_plugins.deepseek_v4.plugin import PLUGIN

    assert isinstance(PLUGIN, ModelPlugin) and PLUGIN.name == "deepseek_v4"
    hf = {
        "hidden_size": 32,
        "num_attention_heads": 2,
        "q_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "sliding_window": 6,
        "index_n_heads": 1,
        "index_head_dim": 8,
        "index_topk": 2,
        "compress_ratios": [0, 2, 4],
        "vocab_size": 1000,  # ignored
    }
    config = PLUGIN.config_from_hf(hf)
    assert config.compress_ratios == (0, 2, 4) and config.attention.window == 6
    stack = PLUGIN.build(config)
    layout = PackedLayout([9, 4])
    out, records = stack(torch.randn(13, 32), layout)
    assert out.shape == (13, 32) and records[0] is None and records[2].shape == (13, 2)
    with pytest.raises(ValueError, match="num_hidden_layers = 2 but compress_ratios has 3"):
        PLUGIN.config_from_hf({**hf, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="compress_ratios"):
        PLUGIN.config_from_hf({"hidden_size": 32})
    assert PLUGIN.config_from_hf({"num_hidden_layers": 3}).compress_ratios == (4, 4, 4)


def varlen_window_per_run(plan, q, k, v, scale):
    """What a flash-style varlen kernel computes: per ext run, causal with a left window."""
    cu, longest = plan.ext_runs
    cu = cu.tolist()
    assert longest == max((b - a for a, b in itertools.pairwise(cu)), default=0)
    outs, lses = [], []
    for a, b in itertools.pairwise(cu):
        i = torch.arange(b - a)
        allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < plan.window)
        logits = torch.einsum("thd,sd->hts", q[a:b], k[a:b]) * scale
        logits = logits.masked_fill(~allowed, float("-inf"))
        lses.append(torch.logsumexp(logits, -1).transpose(0, 1))
        outs.append(torch.einsum("hts,sd->thd", torch.softmax(logits, -1), v[a:b]))
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize(
    ("lengths", "window", "cp", "split"),
    [
        ([7, 33, 1, 20, 3, 1], 4, 1, None),
        ([7, 33, 1, 20, 3, 1], 4, 2, "contiguous"),
        ([7, 33, 1, 20, 3, 1], 4, 3, "load_balanced"),
        ([5, 6], 5, 2, "load_balanced"),  # chunks shorter than the halo
        ([40], 3, 4, "load_balanced"),
    ],
)
def test_ext_runs_give_every_query_its_whole_window(lengths, window, cp, split):
    # the flash varlen window kernel restarts at each ext run: every real query row must find its
    # whole window inside its run, i.e. per-run causal windows equal the blocked kernel's
    from mizzen_plugins.context_parallel import shard_packed_stream
    from mizzen_plugins.deepseek_v4.kernels import _BlockedWindow

    layout = PackedLayout(lengths)
    target = layout if cp == 1 else shard_packed_stream(layout, cp, cp - 1, split)
    plan = build_stream_plan(target, window, 2, torch.device("cpu"))
    g = torch.Generator().manual_seed(len(lengths) + cp)
    te = plan.num_ext
    q = torch.randn(te, 2, 6, generator=g, dtype=torch.float64)
    k = torch.randn(te, 6, generator=g, dtype=torch.float64)
    v = torch.randn(te, 5, generator=g, dtype=torch.float64)
    want_o, want_lse = _BlockedWindow(plan, 0.4).forward(q, k, v)
    got_o, got_lse = varlen_window_per_run(plan, q, k, v, 0.4)
    rows = plan.q_in_ext  # halo rows are not queries: their windows may be cut short
    torch.testing.assert_close(got_o[rows], want_o[rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse[rows], want_lse[rows], rtol=1e-12, atol=1e-12)
