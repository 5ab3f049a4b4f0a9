"""GPU: at tensor-parallel size 1, ``target_logprobs`` on CUDA bf16 logits takes the compiled
fused path; it equals megatron's ``vocab_parallel_cross_entropy`` in values (fp32 rounding) and
bf16 gradients, ids outside the vocabulary included, and its forward+backward peaks lower (no
fp32 copy of the logits)."""

from __future__ import annotations

import torch

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=15,
    hardware=["hopper", "blackwell"],
    num_gpus=1,
    labels=["train"],
    shares_gpu=True,
)

SHAPE = (1, 4096, 32000)


def _megatron(logits, targets):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float(), targets)


def _run(fn, logits, targets, upstream):
    """Value, gradient and the peak bytes that forward+backward allocated above what was live
    before it (the logits themselves, ids and upstream gradient)."""
    leaf = logits.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    value = fn(leaf, targets)
    (value * upstream).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return value.detach(), leaf.grad, peak


def test_compiled_path_equals_megatron_and_peaks_lower(nccl_rank):
    from mizzen_train import losses

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(SHAPE, device="cuda", generator=gen) + 30).to(torch.bfloat16)
    targets = torch.randint(0, SHAPE[-1], SHAPE[:-1], device="cuda", generator=gen)
    targets.view(-1)[::5] = -1
    targets.view(-1)[1::7] = SHAPE[-1]
    upstream = torch.randn(SHAPE[:-1], device="cuda", generator=gen)

    _run(losses.target_logprobs, logits, targets, upstream)  # compiles: not measured
    assert losses._compiled_fused_target_logprobs.cache_info().currsize == 1
    got, got_grad, fused_peak = _run(losses.target_logprobs, logits, targets, upstream)
    want, want_grad, megatron_peak = _run(_megatron, logits, targets, upstream)

    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad)
    logits_bytes = logits.numel() * logits.element_size()
    print(
        f"peak above the inputs: fused {fused_peak / 2**20:.0f} MiB, megatron "
        f"{megatron_peak / 2**20:.0f} MiB (bf16 logits {logits_bytes / 2**20:.0f} MiB)"
    )
    assert fused_peak < megatron_peak
    assert fused_peak < 2 * logits_bytes  # the size of an fp32 copy of the logits
