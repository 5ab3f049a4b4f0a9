"""Real CUDA work on the lane's GPU: a bf16 matmul checked against float64, a CUDA-graph replay.

The numeric checks are plain functions of a device in ``tests/gpu/numerics.py`` (the ``numerics``
fixture), so the CPU lane runs the same matmul check on ``device="cpu"``
(tests/gpu/test_gpu_tests_on_cpu.py); only the graph needs CUDA.
"""

from __future__ import annotations

import torch

from mizzen_ci import register_cuda_ci

register_cuda_ci(est_time=5, hardware=["hopper", "blackwell"], labels=["gpu-lane"], shares_gpu=True)


def test_the_gpu_is_of_a_declared_generation():
    assert torch.cuda.is_available()
    major, _minor = torch.cuda.get_device_capability(0)
    assert major in (9, 10), f"compute capability {major}.x is neither hopper nor blackwell"


def test_bf16_matmul_on_gpu_matches_float64_within_bf16_rounding(numerics):
    assert numerics.bf16_matmul_excess("cuda") <= 0.0


def test_bf16_matmul_error_bound_is_tight_enough_to_catch_a_wrong_result(numerics):
    # The same check must fail for a result off by one bf16 step in a single element.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=gen).to(torch.bfloat16).cuda()
    b = torch.randn(128, 32, generator=gen).to(torch.bfloat16).cuda()
    exact = a.double() @ b.double()
    wrong = (a @ b).double()
    wrong[3, 5] += 4 * numerics.BF16_EPS * exact[3, 5].abs() + 1e-3
    assert float(((wrong - exact).abs() - numerics.bf16_matmul_bound(a, b)).max()) > 0.0


def test_cuda_graph_replay_matches_eager_and_replays_side_effects(numerics):
    graph_excess, acc_excess = numerics.cuda_graph_replay_excess("cuda")
    assert graph_excess <= 0.0, "the replayed graph computed something else than eager mode"
    assert acc_excess <= 0.0, "the graph did not replay its in-place side effect 4 times"
