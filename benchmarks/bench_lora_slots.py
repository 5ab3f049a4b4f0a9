"""Benchmark: K LoRA slots on one base model -- step time, memory per slot, memory after unload.

For K = 1, 2, 4, 8 slots (rank 16) on a ~300M-parameter megatron-core GPT in bf16, one training
step (``forward_backward`` over the batch + ``optim_step`` of every slot) at *equal total tokens*:
the same batch shape is split evenly over the K slots, so K=8 runs micro-batches that mix four
slots.  Reported per K:

- step time and its ratio to K=1 measured in the same run (target, issue 19: K=8 within 1.15x
  of K=1, in each of three consecutive runs);
- kernel launches of one profiled step and GPU-busy fraction (that step's kernel time over the
  median unprofiled step time), so a launch- or host-bound step is visible;
- for K=1, the model FLOP/s the frozen-base step really executes and its MFU against the GPU's
  dense bf16 peak (counted: every base linear forward and input-gradient, no weight gradient as
  the base is frozen; megatron's unfused core attention in full (QK^T and AV forward, four
  matmuls backward); the LoRA factors forward, input and weight gradient);
- bytes per trainable parameter per slot, from ``torch.cuda.memory_allocated()`` around
  ``load_slot`` (target <= 18 = bf16 weight 2 + fp32 grad 4 + fp32 master 4 + Adam 8);
- allocated memory after unloading every slot minus the pre-load baseline (target: 0 bytes).

Run on one GPU (about a minute on an H200)::

    uv run python benchmarks/bench_lora_slots.py

or, in the GPU image's own environment (no venv; nothing here edits ``sys.path``)::

    PYTHONPATH=packages/train/src python benchmarks/bench_lora_slots.py

``--profile`` also prints, for K=1 and K=8, the kernels that account for most of the profiled
step (where a K=8 step spends its extra time).

``--tiny`` runs the same protocol on the CPU with a tiny model (a check of the script, not a
measurement: memory then comes from the executor's own accounting, CUDA stats being absent).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

SLOT_COUNTS = (1, 2, 4, 8)
RANK = 16


@dataclass(frozen=True)
class Setup:
    device: str
    gpt: dict
    rows: int
    seq_len: int
    micro_batch_size: int
    warmup: int
    steps: int


FULL = Setup(
    device="cuda",
    gpt=dict(
        num_layers=20,
        hidden_size=1024,
        num_attention_heads=16,
        vocab_size=32768,
        max_sequence_length=1024,
        dtype="bf16",
    ),
    rows=16,
    seq_len=1024,
    micro_batch_size=8,
    warmup=2,
    steps=5,
)
TINY = Setup(
    device="cpu",
    gpt=dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        max_sequence_length=64,
        dtype="bf16",
    ),
    rows=16,
    seq_len=32,
    micro_batch_size=8,
    warmup=1,
    steps=3,
)


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


def _batch(setup: Setup, slots: int):
    from mizzen_train.batch import SlotBatch

    generator = torch.Generator().manual_seed(0)
    shape = (setup.rows, setup.seq_len)
    vocab = setup.gpt["vocab_size"]
    per_slot = setup.rows // slots
    row_slots = torch.arange(slots).repeat_interleave(per_slot)
    return SlotBatch(
        input_ids=torch.randint(0, vocab, shape, generator=generator),
        target_ids=torch.randint(0, vocab, shape, generator=generator),
        loss_mask=torch.ones(shape, dtype=torch.bool),
        slot_ids=row_slots.unsqueeze(1).expand(shape).clone(),
    )


def _allocated(device: str, expected: int | None = None) -> int | None:
    if device != "cuda":
        return None
    from mizzen_train.memory import settled_allocated_bytes

    return settled_allocated_bytes(expected)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profile_step(executor, batch, adam, slots: int, *, show: bool) -> tuple[int, float]:
    """One step under torch.profiler: (kernel launches, kernel ms); ``show`` prints the top
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    from mizzen_train.losses import CrossEntropyLoss

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        executor.forward_backward(batch, CrossEntropyLoss())
        executor.optim_step(adam)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels)
    if show:
        print(f"\n[profile K={slots}] wall {wall * 1e3:.1f} ms (profiled), kernels {total:.1f} ms, "
              f"{launches} launches")  # fmt: skip
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
            print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:90]}")
    return launches, total


def _step_flops(model, executor, setup: Setup) -> float:
    """FLOPs one frozen-base training step executes at K=1 (see the module docstring)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    tokens = setup.rows * setup.seq_len
    linear = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.weight is not None
    )
    if getattr(model, "share_embeddings_and_output_weights", False):
        linear += model.shared_embedding_or_output_weight().numel()  # the output matmul
    hidden, layers = setup.gpt["hidden_size"], setup.gpt["num_layers"]
    attention = 12 * setup.rows * setup.seq_len**2 * hidden * layers
    lora = sum(math.prod(f.local_shape) for f in executor.layout)  # at max rank, as executed
    return 4 * tokens * linear + attention + 6 * tokens * lora


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12}  # dense, SXM


def _round(executor, setup: Setup, slots: int, *, timed: bool, profile: bool = False) -> dict:
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    batch = _batch(setup, slots)
    adam = {slot: AdamParams(lr=1e-4) for slot in range(slots)}
    baseline = _allocated(setup.device)
    for slot in range(slots):
        executor.load_slot(slot, RANK, 2.0 * RANK, seed=slot)
    loaded = _allocated(setup.device)
    accounted = sum(sum(executor.slot_memory_bytes(slot).values()) for slot in range(slots))
    times, fb_times = [], []
    for step in range(setup.warmup + setup.steps if timed else 1):
        _sync(setup.device)
        start = time.perf_counter()
        executor.forward_backward(batch, CrossEntropyLoss())
        _sync(setup.device)
        middle = time.perf_counter()
        reports = executor.optim_step(adam)
        _sync(setup.device)
        if step >= setup.warmup:
            times.append(time.perf_counter() - start)
            fb_times.append(middle - start)
        assert all(r.stepped for r in reports.values()), reports
    launches = kernel_ms = None
    if setup.device == "cuda":
        launches, kernel_ms = _profile_step(executor, batch, adam, slots, show=profile)
    for slot in range(slots):
        executor.unload_slot(slot)
    after = _allocated(setup.device, expected=baseline)
    params = slots * executor.trainable_parameters_per_slot()
    return {
        "step_s": statistics.median(times) if times else None,
        "fb_s": statistics.median(fb_times) if fb_times else None,
        "bytes_per_param": None if loaded is None else (loaded - baseline) / params,
        "accounted_bytes_per_param": accounted / params,
        "unload_delta": None if after is None else after - baseline,
        "launches": launches,
        "kernel_ms": kernel_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU check of the script")
    parser.add_argument("--profile", action="store_true", help="profile one step at K=1, 8")
    args = parser.parse_args()
    setup = TINY if args.tiny else FULL
    if setup.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_lora_slots: no GPU; use --tiny to check the script on a CPU")
    if setup.device == "cpu":
        torch.set_num_threads(1)  # shared CI cores: one thread gives stable timings

    from mizzen_train.executor import SlotExecutor
    from mizzen_train.gpt import GPTSpec, build_gpt
    from mizzen_train.specs import ExecutorConfig

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        _init_distributed(setup.device, f"{tmp}/rendezvous")
        try:
            spec = GPTSpec(**setup.gpt)
            model = build_gpt(spec, device=setup.device)
            base_params = sum(p.numel() for p in model.parameters())
            executor = SlotExecutor(
                model,
                ExecutorConfig(
                    num_slots=max(SLOT_COUNTS),
                    max_rank=RANK,
                    micro_batch_size=setup.micro_batch_size,
                ),
            )
            tokens = setup.rows * setup.seq_len
            print(
                f"bench_lora_slots: GPT {base_params / 1e6:.0f}M params ({spec.num_layers} layers,"
                f" hidden {spec.hidden_size}, {spec.dtype}) on {setup.device}, rank {RANK}, "
                f"{executor.trainable_parameters_per_slot() / 1e6:.2f}M trainable params per "
                f"slot, {tokens} tokens per step ({setup.rows}x{setup.seq_len}, micro-batch "
                f"{setup.micro_batch_size} rows), median of {setup.steps} steps"
            )
            _round(executor, setup, max(SLOT_COUNTS), timed=False)  # one-time caches
            profiled = {1, max(SLOT_COUNTS)} if args.profile and setup.device == "cuda" else set()
            results = {
                k: _round(executor, setup, k, timed=True, profile=k in profiled)
                for k in SLOT_COUNTS
            }
            flops = _step_flops(model, executor, setup)
            gpu = torch.cuda.get_device_name() if setup.device == "cuda" else "cpu"
        finally:
            torch.distributed.destroy_process_group()

    base_time = results[1]["step_s"]
    print()
    print(f"{'K':>2} {'step ms':>9} {'fwd+bwd':>8} {'optim':>7} {'vs K=1':>7} {'tokens/s':>10} "
          f"{'launches':>8} {'GPU busy':>8} {'B/param/slot':>13} {'(accounted)':>11} "
          f"{'unload delta B':>15}")  # fmt: skip
    for k, r in results.items():
        measured = "n/a" if r["bytes_per_param"] is None else f"{r['bytes_per_param']:.2f}"
        delta = "n/a" if r["unload_delta"] is None else f"{r['unload_delta']:d}"
        launches = "n/a" if r["launches"] is None else f"{r['launches']:d}"
        busy = "n/a" if r["kernel_ms"] is None else f"{r['kernel_ms'] / (r['step_s'] * 1e3):.3f}"
        print(
            f"{k:>2} {r['step_s'] * 1e3:>9.1f} {r['fb_s'] * 1e3:>8.1f} "
            f"{(r['step_s'] - r['fb_s']) * 1e3:>7.1f} {r['step_s'] / base_time:>7.3f} "
            f"{tokens / r['step_s']:>10.0f} {launches:>8} {busy:>8} {measured:>13} "
            f"{r['accounted_bytes_per_param']:>11.2f} {delta:>15}"
        )
    achieved = flops / base_time
    peak = next((v for name, v in PEAK_BF16_FLOPS.items() if name in gpu), None)
    mfu = "n/a (unknown peak)" if peak is None else f"{achieved / peak:.3f} of {peak / 1e12:.0f}"
    print(
        f"\nK=1 step: {flops / 1e12:.2f} TFLOP executed, {achieved / 1e12:.1f} TFLOP/s on {gpu}, "
        f"MFU {mfu} TFLOP/s bf16 dense peak"
    )
    ratio = results[8]["step_s"] / base_time
    worst_bytes = max(
        (r["bytes_per_param"] for r in results.values() if r["bytes_per_param"] is not None),
        default=max(r["accounted_bytes_per_param"] for r in results.values()),
    )
    deltas = [r["unload_delta"] for r in results.values() if r["unload_delta"] is not None]
    print()
    print(f"step time K=8 / K=1: {ratio:.3f} (target <= 1.15)")
    print(f"bytes per trainable parameter per slot: {worst_bytes:.2f} (target <= 18)")
    if deltas:
        print(f"allocated after unload - pre-load baseline: {max(deltas, key=abs)} B (target 0)")
    else:
        print("allocated after unload: n/a on CPU (no CUDA memory stats)")
    if args.tiny:
        print("(--tiny: CPU check of the script; the figures are not measurements)")


if __name__ == "__main__":
    main()
