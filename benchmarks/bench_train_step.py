"""Benchmark: one training step of a Llama-1B-shaped model on a packed 16k-token batch.

Shape (on CUDA): hidden 2048, 16 layers, 32 heads, 8 KV groups (head dim 64), SwiGLU ffn 8192,
vocab 128256 (``--vocab 32000`` for the smaller one), tied embeddings, bf16 -- Llama-3.2-1B.  The
batch is 8 rows of 2048 token slots holding samples of mixed lengths (seeded; 16 to 2048 tokens),
packed first-fit; packing efficiency (real tokens / slots) is printed.

Steps measured, each a median over ``--steps`` timed steps after ``--warmup`` untimed ones
(``torch.cuda.synchronize`` around each):

- ``full SFT packed``: every parameter trainable, the packed ``[1, T]`` stream through
  :class:`~mizzen_train.packed_attention.PackedCoreAttention` (cuDNN ragged / the fast bucketed
  path), cross-entropy over the loss tokens, ``torch.optim.AdamW(fused=True)`` on the bf16
  parameters (no fp32 master copy);
- ``full SFT dense``: the same step on megatron's local spec (``build_gpt(attention="dense")``:
  unfused softmax over ``[b, h, s, s]`` scores) with the old block-diagonal ``[b, 1, s, s]`` mask
  over the same rows -- the baseline, measured in the same run; when it does not fit in memory,
  on fewer rows (its tokens/s then compared), or reported as not fitting;
- ``LoRA K=1`` / ``LoRA K=8``: the slot executor (rank 16 on every linear, fp32 masters and Adam)
  on the same rows, one slot or eight slots (one row each, one micro-batch: eight runs of one
  packed stream).  Both on one executor with eight slots loaded (the steps differ only in the
  batch's routing), their timed steps interleaved K=1, K=8, K=1, ... so that a drift of clocks or
  memory state falls on both sides of the ratio.

FLOPs counted (stated in the output): ``N`` = parameters of every matmul a token passes (the layers'
linears and the output layer; not the embedding lookup).  Full SFT: ``6 N T``; LoRA (frozen base:
forward and input gradients only): ``4 N T + 6 N_lora T``; plus attention
``3 x layers x useful_causal_flops(lengths, heads, head_dim)`` (forward + backward of the useful
causal work, nothing for padding or recompute).  MFU = achieved FLOP/s over the GPU's dense bf16
peak (H100/H200: 989.4 TFLOP/s; table by device name).

Run on one GPU::

    uv run python benchmarks/bench_train_step.py [--vocab 32000] [--profile]

or in the GPU image's own environment (no venv; nothing here edits ``sys.path``)::

    PYTHONPATH=packages/train/src:packages/plugins/src python benchmarks/bench_train_step.py

On a machine without CUDA it runs a tiny shape on the CPU (a check of the script, not a
measurement).  ``--profile`` prints torch.profiler's top CUDA kernels of one step of each kind,
in a pass of its own after every timed step (a profiler session never precedes a timing: one did,
and the K=8 step timed after the K=1 profile ran 1.2x slower than in unprofiled runs).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

#: Dense bf16 peak FLOP/s by device-name fragment (SXM parts).
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12}
LORA_RANK = 16


@dataclass(frozen=True)
class Shape:
    gpt: dict
    rows: int
    row_len: int
    min_sample: int
    warmup: int
    steps: int


def _shape(on_cuda: bool, vocab: int, steps: int | None) -> Shape:
    if on_cuda:
        gpt = dict(
            num_layers=16,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=8192,
            vocab_size=vocab,
            max_sequence_length=2048,
            tie_embeddings=True,
            rotary_base=500000.0,
            dtype="bf16",
        )
        return Shape(gpt, rows=8, row_len=2048, min_sample=16, warmup=2, steps=steps or 5)
    gpt = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=256,
        max_sequence_length=64,
        tie_embeddings=True,
        dtype="fp32",
    )
    return Shape(gpt, rows=8, row_len=64, min_sample=4, warmup=1, steps=steps or 2)


# -- the batch -----------------------------------------------------------------------------------


def _sample_lengths(shape: Shape, seed: int = 0) -> list[int]:
    """Mixed lengths, log-uniform between ``min_sample`` and a row, enough to fill the rows."""
    rng = random.Random(seed)
    lengths, total = [], 0
    while total < shape.rows * shape.row_len * 1.2:
        low, high = shape.min_sample, shape.row_len
        n = round(low * (high / low) ** rng.random())
        lengths.append(n)
        total += n
    return lengths


def _pack(shape: Shape, lengths: list[int]) -> list[list[int]]:
    """First-fit packing of ``lengths`` into the rows (samples that fit nowhere are dropped)."""
    rows: list[list[int]] = [[] for _ in range(shape.rows)]
    fill = [0] * shape.rows
    for n in lengths:
        row = next((r for r in range(shape.rows) if fill[r] + n <= shape.row_len), None)
        if row is not None:
            rows[row].append(n)
            fill[row] += n
    return rows


def _batch(shape: Shape, row_samples: list[list[int]], row_slots: list[int]):
    from mizzen_train.batch import SlotBatch

    generator = torch.Generator().manual_seed(1)
    size = (shape.rows, shape.row_len)
    vocab = shape.gpt["vocab_size"]
    segment_ids = torch.full(size, -1)
    for row, lengths in enumerate(row_samples):
        start = 0
        for index, n in enumerate(lengths):
            segment_ids[row, start : start + n] = index
            start += n
    return SlotBatch(
        input_ids=torch.randint(0, vocab, size, generator=generator),
        target_ids=torch.randint(0, vocab, size, generator=generator),
        loss_mask=segment_ids >= 0,
        slot_ids=torch.tensor(row_slots).unsqueeze(1).expand(size).clone(),
        segment_ids=segment_ids,
    )


# -- set-up --------------------------------------------------------------------------------------


def _init_distributed(device: str, rendezvous: str) -> None:
    from megatron.core import parallel_state

    if device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(0)
        backend = "nccl"
    else:
        from mizzen_train.megatron_on_cpu import install_megatron_cpu_shim

        install_megatron_cpu_shim()
        backend = "gloo"
    torch.distributed.init_process_group(
        backend, init_method=f"file://{rendezvous}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _measure(build, shape: Shape, device: str, *, profile: bool = False) -> dict[str, float]:
    """Median seconds of each step ``build()`` returns (name -> step), their timed calls
    interleaved step by step so that a drift of clock or memory state falls on every kind alike;
    with ``profile``, each step profiled instead (nothing returned).  What ``build`` made is freed
    before this returns, whatever happens."""
    steps = build()
    try:
        if profile:
            for name, step in steps.items():
                step()  # warm, then one profiled step
                _profile(step, name, device)
            return {}
        for step in steps.values():
            for _ in range(shape.warmup):
                step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(shape.steps):
            for name, step in steps.items():
                _sync(device)
                start = time.perf_counter()
                step()
                _sync(device)
                times[name].append(time.perf_counter() - start)
        return {name: statistics.median(ts) for name, ts in times.items()}
    finally:
        del steps
        _free(device)


def _profile(step, label: str, device: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    wall = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"\n[profile {label}] kernels {total:.1f} ms, {sum(e.count for e in kernels)} launches")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:90]}")
    # where the GPU waits on the host: the step's wall time under the profiler (which slows the
    # host), the host->device syncs and the host ops that cost most
    host = [e for e in events if e.device_type.name == "CPU"]
    syncs = sum(e.count for e in host if e.key in ("aten::_local_scalar_dense", "aten::item"))
    print(f"  host: profiled step {wall:.1f} ms wall, {syncs} device->host reads")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"  {e.self_cpu_time_total / 1e3:8.2f} ms {e.count:6d}x  host {e.key[:80]}")


# -- the steps -----------------------------------------------------------------------------------


def _full_step_packed(model, batch, optimizer, device: str):
    """One full-parameter step on the packed ``[1, T]`` stream of the batch's real tokens."""
    from mizzen_plugins.thd import PackedLayout
    from mizzen_train.executor import real_token_mask, stream_segments
    from mizzen_train.losses import target_logprobs
    from mizzen_train.packed_attention import packed_stream

    index, lengths = stream_segments(batch, real_token_mask(batch))
    layout = PackedLayout.from_lengths(lengths)
    ids = batch.input_ids.reshape(-1)[index].view(1, -1).to(device)
    targets = batch.target_ids.reshape(-1)[index].view(1, -1).to(device)
    mask = batch.loss_mask.reshape(-1)[index].view(1, -1).to(device)
    positions = layout.positions.view(1, -1).to(device)
    count = mask.sum()

    def step() -> None:
        params = packed_stream(layout, device=device)
        logits = model(ids, positions, None, packed_seq_params=params)
        loss = -(target_logprobs(logits, targets) * mask).sum() / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _full_step_dense(model, batch, optimizer, device: str, rows: int):
    """The same step on megatron's dense attention with the old block-diagonal mask."""
    from mizzen_train.executor import segment_positions
    from mizzen_train.losses import target_logprobs

    seg = batch.segment_ids[:rows]
    seq = seg.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    mask = (causal.unsqueeze(0) | (seg.unsqueeze(2) != seg.unsqueeze(1))).unsqueeze(1).to(device)
    ids = batch.input_ids[:rows].to(device)
    targets = batch.target_ids[:rows].to(device)
    weights = batch.loss_mask[:rows].to(device)
    positions = segment_positions(seg).to(device)
    count = weights.sum()

    def step() -> None:
        logits = model(ids, positions, mask)
        loss = -(target_logprobs(logits, targets) * weights).sum() / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _lora_step(executor, batch, slots: int):
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    adam = {slot: AdamParams(lr=1e-4) for slot in range(slots)}
    loss = CrossEntropyLoss()

    def step() -> None:
        executor.forward_backward(batch, loss)
        executor.optim_step(adam)

    return step


# -- FLOPs ---------------------------------------------------------------------------------------


def _matmul_params(spec) -> int:
    """``N``: parameters of every matmul a token passes (layers' linears + output layer)."""
    h, ffn, d = spec.hidden_size, spec.ffn_size, spec.head_dim
    q_out = spec.num_attention_heads * d
    qkv_out = q_out + 2 * spec.query_groups * d
    fc1_out = 2 * ffn if spec.activation == "swiglu" else ffn
    per_layer = h * qkv_out + q_out * h + h * fc1_out + ffn * h
    return spec.num_layers * per_layer + spec.vocab_size * h


def _attention_flops(spec, row_samples: list[list[int]]) -> float:
    from mizzen_plugins.attention import useful_causal_flops

    lengths = [n for row in row_samples for n in row]
    forward = useful_causal_flops(lengths, spec.num_attention_heads, spec.head_dim)
    return 3.0 * spec.num_layers * forward


def _lora_params(spec) -> int:
    h, ffn, d = spec.hidden_size, spec.ffn_size, spec.head_dim
    qkv_out = spec.num_attention_heads * d + 2 * spec.query_groups * d
    fc1_out = 2 * ffn if spec.activation == "swiglu" else ffn
    pairs = [(h, qkv_out), (spec.num_attention_heads * d, h), (h, fc1_out), (ffn, h)]
    return spec.num_layers * sum(LORA_RANK * (i + o) for i, o in pairs)


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, choices=(128256, 32000), default=128256)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (median)")
    parser.add_argument("--profile", action="store_true", help="top CUDA kernels per step kind")
    parser.add_argument("--skip-dense", action="store_true", help="no dense-mask baseline")
    args = parser.parse_args()

    from mizzen_train.executor import SlotExecutor
    from mizzen_train.gpt import GPTSpec, build_gpt
    from mizzen_train.specs import ExecutorConfig

    on_cuda = torch.cuda.is_available()
    device = "cuda" if on_cuda else "cpu"
    shape = _shape(on_cuda, args.vocab, args.steps)
    spec = GPTSpec.llama(**shape.gpt)
    row_samples = _pack(shape, _sample_lengths(shape))
    real = sum(map(sum, row_samples))
    slots_total = shape.rows * shape.row_len
    samples = sum(map(len, row_samples))
    n_matmul = _matmul_params(spec)
    attention = _attention_flops(spec, row_samples)
    lora_params = _lora_params(spec)
    gpu = torch.cuda.get_device_name(0) if on_cuda else "cpu"
    peak = next((v for name, v in PEAK_BF16_FLOPS.items() if name in gpu), None)

    print(
        f"device: {gpu}; model: hidden {spec.hidden_size}, {spec.num_layers} layers, "
        f"{spec.num_attention_heads} heads / {spec.query_groups} KV groups, ffn {spec.ffn_size}, "
        f"vocab {spec.vocab_size}, tied embeddings, {spec.dtype}; "
        f"{spec.parameter_count() / 1e6:.1f}M parameters, N = {n_matmul / 1e6:.1f}M in matmuls"
    )
    print(
        f"batch: {shape.rows} rows x {shape.row_len} slots, {samples} samples of mixed length, "
        f"{real} real tokens, packing efficiency {real / slots_total:.3f}"
    )
    print(
        "FLOPs: full SFT 6*N*T, LoRA 4*N*T + 6*N_lora*T (frozen base), plus attention "
        f"3 x layers x useful_causal_flops = {attention / 1e12:.3f} TFLOP; T = real tokens"
    )

    with tempfile.TemporaryDirectory(prefix="mizzen-bench-") as tmp:
        _init_distributed(device, os.path.join(tmp, "rendezvous"))
        results: dict[str, dict] = {}
        batch = _batch(shape, row_samples, [0] * shape.rows)
        lora_batches = {
            slots: _batch(
                shape, row_samples, [row * slots // shape.rows for row in range(shape.rows)]
            )
            for slots in (1, 8)
        }

        def full_packed():
            model = build_gpt(spec, device=device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=on_cuda)
            return {"full SFT packed": _full_step_packed(model, batch, optimizer, device)}

        def full_dense(rows: int):
            model = build_gpt(spec, device=device, attention="dense")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=on_cuda)
            return {
                "full SFT dense (baseline)": _full_step_dense(model, batch, optimizer, device, rows)
            }

        def lora():
            # one executor, eight slots loaded, for both K: K=1 routes every row to slot 0, K=8
            # one row to each slot; the two steps differ only in the batch's routing
            model = build_gpt(spec, device=device)
            executor = SlotExecutor(
                model,
                ExecutorConfig(num_slots=8, max_rank=LORA_RANK, micro_batch_size=shape.rows),
            )
            for slot in range(8):
                executor.load_slot(slot, LORA_RANK, 2.0 * LORA_RANK, seed=slot)
            return {f"LoRA K={k}": _lora_step(executor, b, k) for k, b in lora_batches.items()}

        # timing pass: nothing profiled before or between timed steps
        packed = _measure(full_packed, shape, device)
        results["full SFT packed"] = dict(
            s=packed["full SFT packed"], flops=6 * n_matmul * real + attention, tokens=real, note=""
        )
        dense_rows = 0
        if not args.skip_dense:  # the old dense-mask path, same rows (fewer when they do not fit)
            rows = shape.rows
            while rows >= 1 and not dense_rows:
                try:
                    dense = _measure(functools.partial(full_dense, rows), shape, device)
                    dense_rows = rows
                except torch.cuda.OutOfMemoryError:
                    rows //= 2
                _free(device)  # after the handler: its traceback held the failed step's tensors
            if dense_rows:
                part = row_samples[:dense_rows]
                tokens = sum(map(sum, part))
                note = (
                    ""
                    if dense_rows == shape.rows
                    else f"{dense_rows} of {shape.rows} rows (memory)"
                )
                flops = 6 * n_matmul * tokens + _attention_flops(spec, part)
                results["full SFT dense (baseline)"] = dict(
                    s=dense["full SFT dense (baseline)"], flops=flops, tokens=tokens, note=note
                )
            else:
                print("dense baseline: does not fit in memory even on one row")
        for name, seconds in _measure(lora, shape, device).items():  # K=1 and K=8 interleaved
            results[name] = dict(
                s=seconds,
                flops=4 * n_matmul * real + 6 * lora_params * real + attention,
                tokens=real,
                note="",
            )

        # profiling pass, after every timing (a profiler session must not touch a timed step)
        if args.profile and on_cuda:
            dense_builder = [functools.partial(full_dense, dense_rows)] if dense_rows else []
            builders = [full_packed, *dense_builder, lora]
            try:
                for build in builders:
                    _measure(build, shape, device, profile=True)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # the timings still print
                print(f"profile pass stopped: {type(e).__name__}: {str(e)[:300]}")
        torch.distributed.destroy_process_group()

    unit, scale = ("TFLOP/s", 1e12) if on_cuda else ("GFLOP/s", 1e9)
    print(f"\n{'step':28s} {'ms':>9s} {'tokens/s':>11s} {unit:>9s} {'MFU':>6s}  note")
    for name, r in results.items():
        achieved = r["flops"] / r["s"]
        mfu = f"{achieved / peak:.3f}" if peak else "n/a"
        print(
            f"{name:28s} {r['s'] * 1e3:9.1f} {r['tokens'] / r['s']:11.0f} "
            f"{achieved / scale:9.2f} {mfu:>6s}  {r['note']}"
        )
    if peak is None:
        print(f"MFU: n/a (no dense bf16 peak known for {gpu!r})")
    else:
        print(f"MFU against {peak / 1e12:.1f} TFLOP/s dense bf16 ({gpu})")
    packed, dense = results["full SFT packed"], results.get("full SFT dense (baseline)")
    if dense is not None:
        ratio = (packed["tokens"] / packed["s"]) / (dense["tokens"] / dense["s"])
        print(f"speed-up, full SFT packed vs dense-mask baseline (tokens/s): {ratio:.2f}x")
    ratio = results["LoRA K=8"]["s"] / results["LoRA K=1"]["s"]
    print(f"LoRA step time K=8 / K=1: {ratio:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
