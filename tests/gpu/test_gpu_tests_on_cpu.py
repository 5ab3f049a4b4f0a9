"""The numeric checks of the GPU test files, run on the CPU: the same functions, device="cpu".

Only the CUDA-specific parts (the device itself, CUDA graphs, the NCCL transport) are left to the
GPU lane; the bf16 error bound and the 2-process all-reduce workers are checked here, through the
``numerics`` and ``allreduce`` fixtures of ``tests/gpu/conftest.py`` that the GPU tests use too.
Registered for the CPU lane: the registry decides the lane, not the folder.
"""

from __future__ import annotations

import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=20, labels=["ci", "gpu-lane"])


def test_bf16_matmul_on_cpu_is_within_the_bound_the_gpu_test_uses(numerics):
    assert numerics.bf16_matmul_excess("cpu", m=128, k=512, n=96) <= 0.0


def test_the_bf16_bound_rejects_a_float32_result_passed_off_as_bf16(numerics):
    # A bound so loose that it accepts anything would make the GPU test useless: an fp32 result of
    # *unrounded* inputs differs from the bf16-input product by far more than the bound allows.
    gen = torch.Generator().manual_seed(3)
    a64 = torch.randn(64, 256, generator=gen, dtype=torch.float64)
    b64 = torch.randn(256, 32, generator=gen, dtype=torch.float64)
    a, b = a64.to(torch.bfloat16), b64.to(torch.bfloat16)
    exact = a.double() @ b.double()
    unrounded = a64 @ b64
    assert float(((unrounded - exact).abs() - numerics.bf16_matmul_bound(a, b)).max()) > 0.0


def test_the_all_reduce_worker_sums_across_two_processes_over_gloo(allreduce):
    results = allreduce.run_workers("gloo", "cpu")
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["ones_min"] == r["ones_max"] == 3.0
        assert r["max_error"] <= 1e-5
