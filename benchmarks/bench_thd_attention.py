"""Packed (THD) attention vs padded (BSHD) attention on an RL-like length mix, forward + backward.

One run measures, on the same data:

1. Generic document-causal attention (``mizzen_plugins.attention.causal_thd_attention``):
   - baseline: padded SDPA (every sequence right-padded to the longest, ``is_causal=True``);
   - FlexAttention with a document-causal block mask (compiled);
   - ours, ``impl="cudnn"``: cuDNN's ragged fused attention on the packed stream (one kernel per
     direction; first call with its graph builds timed apart), with its top kernels;
   - ours, ``impl="fast"``: length-bucketed dense causal SDPA (cuDNN on Hopper) in one autograd
     node, bucket plan cached on the layout;
   - ours, ``impl="auto"`` (``"cudnn"`` where usable): with the layout cached (the per-layer
     cost), a fresh layout object every call (the per-batch cost) and a new length mix every call
     (RL batches);
   - ours, ``impl="varlen"`` (torch's flash varlen kernel on the packed stream);
   - diagnostics: ours with only the flash SDPA backend, and dense causal SDPA at the longest
     length (a ceiling).
   Useful FLOPs count causal attention without padding: fwd ``4*H*D*sum(L*(L+1)/2)``, fwd+bwd
   3.5x that.  Printed: ms, useful TFLOP/s, ratio vs the baseline.
2. The DeepSeek-V4-style layer: THD tokens/s vs its own BSHD padded path (``forward_padded``) at
   the same length mix (both ``impl="fast"``; ``--module-flex`` adds the FlexAttention window).

Usage:
    python benchmarks/bench_thd_attention.py           # H200: 65,536 tokens, 16 heads, dim 128, bf16
    python benchmarks/bench_thd_attention.py --tiny    # CPU smoke run at toy size (minutes budget)

Prints one ``RESULT {json}`` line at the end for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import statistics
import time

import torch
import torch.nn.functional as F

from mizzen_plugins.attention import causal_thd_attention, useful_causal_flops
from mizzen_plugins.deepseek_v4 import DeepSeekV4Attention, DeepSeekV4AttentionConfig
from mizzen_plugins.thd import PackedLayout, unpack_to_padded


def lognormal_lengths(total: int, lo: int, hi: int, mu: float, sigma: float, seed: int):
    """Lognormal lengths clipped to [lo, hi] summing to exactly ``total``."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        n = float(torch.empty(1).log_normal_(mu, sigma, generator=gen))
        out.append(int(min(max(round(n), lo), hi)))
    last = out.pop()
    rest = total - sum(out)
    if rest >= lo or not out:
        out.append(rest)
    else:  # too short to stand alone: give it to the shortest sequence that has room
        i = min(range(len(out)), key=lambda j: out[j])
        out[i] += rest
    del last
    assert sum(out) == total and all(lo <= n <= hi for n in out), out
    return out


def timed(step, *, device, warmup: int, iters: int) -> float:
    """Median seconds of ``step()`` after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fwd_bwd(fn, inputs, grad_out, backward: bool = True):
    def step():
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        if backward:
            out.backward(grad_out)

    return step


def sdpa_backends(*names):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [getattr(SDPBackend, n) for n in names]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return sdpa_kernel(backends, set_priority=True)
    return sdpa_kernel(backends)


def print_top_kernels(step, label: str, top: int = 6) -> None:
    """Which GPU kernels one step runs (tells which SDPA backend torch picked)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
        events.sort(key=lambda e: getattr(e, attr), reverse=True)
        total = sum(getattr(e, attr) for e in events) or 1
        print(f"  {label}: top GPU kernels of one fwd+bwd step")
        for e in events[:top]:
            share = 100 * getattr(e, attr) / total
            print(f"    {share:5.1f}%  x{e.count:<4d} {e.key[:90]}")
    except Exception as exc:
        print(f"  ({label}: no kernel profile: {type(exc).__name__}: {exc})"[:200])


def run_causal(args, device, dtype, lengths, results):
    h, d = args.heads, args.head_dim
    layout = PackedLayout(lengths, device)
    t = layout.num_tokens
    gen = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v, g = (rnd(t, h, d) for _ in range(4))
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    useful = 3.5 * useful_causal_flops(lengths, h, d)
    on_cpu = device.type == "cpu"
    print(
        f"\n== causal THD attention: {t} tokens in {len(lengths)} sequences "
        f"(min {min(lengths)}, median {int(statistics.median(lengths))}, max {max(lengths)}), "
        f"{h} heads, dim {d}, {dtype}, fwd+bwd; useful {useful / 1e12:.3f} TFLOP"
    )
    rows = []

    unit, per = ("GFLOP/s", 1e9) if on_cpu else ("TFLOP/s", 1e12)

    def report(name, seconds, flops=useful, note=""):
        tf = flops / seconds / 1e12
        rows.append((name, seconds, tf))
        base = rows[0][1]
        print(
            f"  {name:<48} {seconds * 1e3:9.2f} ms  {flops / seconds / per:8.2f} {unit}  "
            f"x{base / seconds:6.2f} {note}"
        )
        results[name] = {"ms": round(seconds * 1e3, 3), "useful_tflops": round(tf, 4)}

    # baseline: padded SDPA
    qp, kp, vp, gp = (unpack_to_padded(x.detach(), layout).transpose(1, 2) for x in (q, k, v, g))
    padded = [x.contiguous().requires_grad_(True) for x in (qp, kp, vp)]
    gp = gp.contiguous()
    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    report(
        "baseline: padded SDPA",
        timed(fwd_bwd(sdpa, padded, gp), device=device, warmup=args.warmup, iters=args.iters),
    )
    del padded, qp, kp, vp, gp

    # FlexAttention document mask (compiled on CUDA; CPU: forward only)
    flex = lambda a, b, c: causal_thd_attention(a, b, c, layout, impl="flex")  # noqa: E731
    try:
        t0 = time.perf_counter()
        inputs = [x.detach() for x in leaves] if on_cpu else leaves
        step = fwd_bwd(flex, inputs, g, backward=not on_cpu)
        step()
        print(f"  (flex first call incl. compile: {time.perf_counter() - t0:.1f} s)")
        flops = useful / 3.5 if on_cpu else useful
        secs = timed(step, device=device, warmup=args.warmup, iters=args.iters)
        report(
            "FlexAttention document mask", secs, flops, "(forward only on CPU)" if on_cpu else ""
        )
    except Exception as exc:  # a diagnostic row must not hide the others
        print(f"  FlexAttention document mask: FAILED {type(exc).__name__}: {exc}"[:300])

    # ours
    from mizzen_plugins.attention import cudnn_ragged

    ours_key = "ours: auto"
    fast_key = "ours: fast = bucketed SDPA/cuDNN (plan cached)"
    auto = lambda a, b, c: causal_thd_attention(a, b, c, layout, impl="auto")  # noqa: E731
    fast = lambda a, b, c: causal_thd_attention(a, b, c, layout, impl="fast")  # noqa: E731
    ragged = lambda a, b, c: causal_thd_attention(a, b, c, layout, impl="cudnn")  # noqa: E731
    if cudnn_ragged.usable(q, k, v):
        try:
            t0 = time.perf_counter()
            fwd_bwd(ragged, leaves, g)()
            torch.cuda.synchronize()
            print(
                f"  (cudnn ragged first call incl. graph builds: {time.perf_counter() - t0:.2f} s)"
            )
            secs = timed(
                fwd_bwd(ragged, leaves, g), device=device, warmup=args.warmup, iters=args.iters
            )
            report("ours: cudnn = one ragged cuDNN kernel per direction", secs)
            with torch.no_grad():
                a = causal_thd_attention(*(x.detach() for x in leaves), layout, impl="cudnn")
                b = causal_thd_attention(*(x.detach() for x in leaves), layout, impl="fast")
            print(f"  max |cudnn - fast| = {float((a.float() - b.float()).abs().max()):.3g}")
            print_top_kernels(fwd_bwd(ragged, leaves, g), "ours (cudnn ragged)")
        except Exception as exc:  # a diagnostic row must not hide the others
            print(f"  cudnn ragged: FAILED {type(exc).__name__}: {exc}"[:600])
    else:
        print("  (cudnn ragged: not usable here: no nvidia-cudnn-frontend / GPU < sm90)")
    secs = timed(fwd_bwd(fast, leaves, g), device=device, warmup=args.warmup, iters=args.iters)
    report(fast_key, secs)
    secs = timed(fwd_bwd(auto, leaves, g), device=device, warmup=args.warmup, iters=args.iters)
    report(ours_key, secs)

    def fresh_layout(a, b, c):
        return causal_thd_attention(a, b, c, PackedLayout(lengths, device), impl="auto")

    secs = timed(fwd_bwd(fresh_layout, leaves, g), device=device, warmup=1, iters=args.iters)
    report("ours: auto, new layout object every call", secs)

    # a different length mix (same token count) every call, as in RL training: a layout's first
    # call runs on the varlen kernel when its bucket shapes are not built yet
    mixes = iter(
        [
            lognormal_lengths(t, min(lengths), max(lengths), args.mu, 1.2, 1000 + i)
            for i in range(args.iters + 2)
        ]
    )

    def new_mix(a, b, c):
        return causal_thd_attention(a, b, c, PackedLayout(next(mixes), device), impl="auto")

    secs = timed(fwd_bwd(new_mix, leaves, g), device=device, warmup=1, iters=args.iters)
    report("ours: auto, new length mix every call", secs, note="(flops: first mix)")

    if not on_cpu:
        varlen = lambda a, b, c: causal_thd_attention(a, b, c, layout, impl="varlen")  # noqa: E731
        secs = timed(
            fwd_bwd(varlen, leaves, g), device=device, warmup=args.warmup, iters=args.iters
        )
        report("ours: varlen (torch flash varlen kernel)", secs)
        print_top_kernels(fwd_bwd(fast, leaves, g), "ours (bucketed)")

    with torch.no_grad():
        ref = causal_thd_attention(*(x.detach() for x in leaves), layout, impl="fast")
        try:
            other = causal_thd_attention(*(x.detach() for x in leaves), layout, impl="flex")
            print(f"  max |ours - flex| = {float((ref.float() - other.float()).abs().max()):.3g}")
        except Exception as exc:
            print(f"  (no flex cross-check: {type(exc).__name__})")

    if not on_cpu:
        try:
            with sdpa_backends("FLASH_ATTENTION"):
                secs = timed(
                    fwd_bwd(fast, leaves, g), device=device, warmup=args.warmup, iters=args.iters
                )
            report("ours: bucketed, SDPA flash only (diagnostic)", secs)
        except Exception as exc:
            print(f"  ours, SDPA flash only: FAILED {type(exc).__name__}: {exc}"[:300])
        # ceiling: dense causal SDPA on max-length rows holding the same number of tokens
        s = max(lengths)
        b = max(1, t // s)
        dense = [
            torch.randn(b, h, s, d, generator=gen).to(device, dtype).requires_grad_(True)
            for _ in range(3)
        ]
        gd = torch.randn(b, h, s, d, generator=gen).to(device, dtype)
        secs = timed(fwd_bwd(sdpa, dense, gd), device=device, warmup=args.warmup, iters=args.iters)
        report(
            f"(ceiling) dense causal SDPA {b}x{s}", secs, 3.5 * useful_causal_flops([s] * b, h, d)
        )
        del dense, gd
    return results[ours_key]["useful_tflops"]


def run_module(args, device, dtype, lengths, results):
    cfg = (
        DeepSeekV4AttentionConfig(
            hidden_size=64,
            num_heads=2,
            q_lora_rank=32,
            nope_head_dim=24,
            rope_head_dim=8,
            window=32,
            compress_ratio=4,
            index_heads=2,
            index_head_dim=16,
            index_topk=8,
        )
        if args.tiny
        else DeepSeekV4AttentionConfig(
            hidden_size=1024,
            num_heads=16,
            q_lora_rank=384,
            nope_head_dim=96,
            rope_head_dim=32,
            window=128,
            compress_ratio=4,
            index_heads=4,
            index_head_dim=64,
            index_topk=32,
        )
    )
    torch.manual_seed(0)
    module = DeepSeekV4Attention(cfg).to(device, dtype)
    layout = PackedLayout(lengths, device)
    t, b, s = layout.num_tokens, len(lengths), max(lengths)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, cfg.hidden_size, generator=gen).to(device, dtype)
    gx = torch.randn(t, cfg.hidden_size, generator=gen).to(device, dtype)
    x_pad = unpack_to_padded(x, layout).contiguous()
    g_pad = unpack_to_padded(gx, layout).contiguous()
    print(
        f"\n== DeepSeek-V4-style layer: window {cfg.window}, ratio {cfg.compress_ratio}, top-k "
        f"{cfg.index_topk}, {cfg.num_heads} heads x {cfg.head_dim}, {dtype}, fwd+bwd; THD "
        f"{t} tokens vs BSHD {b}x{s} = {b * s} padded tokens"
    )

    def thd(impl):
        def fn(xx):
            return module(xx, layout, impl=impl).output

        return fn

    def bshd(xx):
        return module.forward_padded(xx, lengths, impl="fast").output

    x_leaf = x.clone().requires_grad_(True)
    xp_leaf = x_pad.clone().requires_grad_(True)
    try:
        secs_bshd = timed(
            fwd_bwd(bshd, [xp_leaf], g_pad), device=device, warmup=1, iters=args.iters
        )
    except torch.cuda.OutOfMemoryError as exc:
        print(f"  BSHD padded (baseline): out of memory at {b}x{s} ({exc})"[:300])
        results["dsv4 BSHD padded (baseline)"] = "out of memory"
        return None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    secs_thd = timed(
        fwd_bwd(thd("fast"), [x_leaf], gx), device=device, warmup=args.warmup, iters=args.iters
    )
    rows = [("BSHD padded (baseline)", secs_bshd), ("THD (ours, fast)", secs_thd)]
    if args.module_flex and device.type == "cuda":
        try:
            secs = timed(
                fwd_bwd(thd("flex"), [x_leaf], gx), device=device, warmup=2, iters=args.iters
            )
            rows.append(("THD (ours, flex window)", secs))
        except Exception as exc:
            print(f"  THD flex: FAILED {type(exc).__name__}: {exc}"[:300])
    for name, secs in rows:
        tps = t / secs
        print(
            f"  {name:<28} {secs * 1e3:9.2f} ms  {tps / 1e6:8.3f} M real tokens/s  "
            f"x{secs_bshd / secs:6.2f}"
        )
        results[f"dsv4 {name}"] = {"ms": round(secs * 1e3, 3), "tokens_per_s": round(tps)}
    return secs_bshd / secs_thd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at toy size")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--module-flex", action="store_true", help="also time the module's flex path")
    ap.add_argument("--skip-module", action="store_true")
    args = ap.parse_args()
    tiny = args.tiny
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    args.tokens = args.tokens or (2048 if tiny else 65536)
    args.heads = args.heads or (2 if tiny else 16)
    args.head_dim = args.head_dim or (32 if tiny else 128)
    args.iters = args.iters or (2 if tiny else 5)
    if tiny:
        args.warmup = 1
    lo, hi = (16, 512) if tiny else (64, 8192)
    args.mu = 4.6 if tiny else 6.6
    lengths = lognormal_lengths(args.tokens, lo, hi, args.mu, 1.2, args.seed)
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}")
    results: dict = {
        "device": name,
        "torch": torch.__version__,
        "tokens": args.tokens,
        "sequences": len(lengths),
        "heads": args.heads,
        "head_dim": args.head_dim,
    }
    ours_tflops = run_causal(args, device, dtype, lengths, results)
    ratio = None
    if not args.skip_module:
        ratio = run_module(args, device, dtype, lengths, results)
    with contextlib.suppress(Exception):
        results["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    elapsed = time.perf_counter() - started
    print(
        f"\nsummary: ours causal THD {ours_tflops:.1f} useful TFLOP/s (target >= 400 on H200); "
        + (f"DeepSeek-V4 THD vs BSHD padded x{ratio:.2f} (target >= 5); " if ratio else "")
        + f"total {elapsed:.0f} s"
    )
    results["dsv4_thd_over_bshd"] = None if ratio is None else round(ratio, 2)
    results["elapsed_s"] = round(elapsed, 1)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
