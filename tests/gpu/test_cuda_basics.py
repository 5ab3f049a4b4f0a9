"""Real CUDA work on the lane's GPU: a bf16 matmul checked against float64, a CUDA-graph replay.

The numeric checks are plain functions taking a device, so the CPU lane runs the same matmul check
on ``device="cpu"`` (tests/ci/test_gpu_tests_on_cpu.py); only the graph needs CUDA.
"""

from __future__ import annotations

import torch

from mizzen_ci import register_cuda_ci

register_cuda_ci(est_time=60, hardware=["hopper", "blackwell"], labels=["gpu-lane"])

BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits: a rounding step is at most 2^-8 relative


def bf16_matmul_excess(device: str, m: int = 512, k: int = 2048, n: int = 768) -> float:
    """How far a bf16 matmul on ``device`` strays beyond its error bound; ≤ 0 means within it.

    The reference multiplies the *same bf16-rounded inputs* in float64, so the only admissible
    error is the accumulation (fp32 or better: at most k·2^-24 relative to Σ|a||b|) and the final
    rounding of each output to bf16 (half a step, 2^-9 relative).
    """
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(m, k, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    b = torch.randn(k, n, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    exact = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    # cuBLAS may otherwise reduce split-K partial sums in bf16, which no fp32 bound covers
    flags = torch.backends.cuda.matmul
    reduced = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        got = (a.to(device) @ b.to(device)).double().cpu()
    finally:
        flags.allow_bf16_reduced_precision_reduction = reduced
    assert got.dtype == torch.float64 and got.shape == (m, n)
    bound = BF16_EPS * exact.abs() + k * 2.0**-23 * magnitude + 1e-30
    return float(((got - exact).abs() - bound).max())


def cuda_graph_replay_excess(device: str = "cuda") -> tuple[float, float]:
    """Capture ``y = relu(x @ w) + b`` and an in-place accumulation ``acc += x`` in one CUDA
    graph, replay it on fresh input once and then three times more.  Returns how far
    (graph output vs eager) and (acc vs 4·x) stray beyond fp32 rounding bounds; ≤ 0 is within.
    """
    k = 256
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(k, k, generator=gen).to(device)
    bias = torch.randn(k, generator=gen).to(device)
    static_x = torch.zeros(64, k, device=device)
    acc = torch.zeros(64, k, device=device)

    def step():
        acc.add_(static_x)
        return torch.relu(static_x @ w) + bias

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (cuBLAS handles, allocator) outside the capture
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()

    x = torch.randn(64, k, generator=gen).to(device)
    static_x.copy_(x)
    acc.zero_()
    graph.replay()
    eager = torch.relu(x @ w) + bias
    fp32_bound = 2 * k * 2.0**-24 * (x.abs() @ w.abs()) + 2.0**-23 * bias.abs() + 1e-30
    graph_excess = float(((static_y - eager).abs() - fp32_bound).max())
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    acc_excess = float(((acc - 4 * x).abs() - 4 * 2.0**-23 * (4 * x).abs()).max())
    return graph_excess, acc_excess


def test_the_gpu_is_of_a_declared_generation():
    assert torch.cuda.is_available()
    major, _minor = torch.cuda.get_device_capability(0)
    assert major in (9, 10), f"compute capability {major}.x is neither hopper nor blackwell"


def test_bf16_matmul_on_gpu_matches_float64_within_bf16_rounding():
    assert bf16_matmul_excess("cuda") <= 0.0


def test_bf16_matmul_error_bound_is_tight_enough_to_catch_a_wrong_result():
    # The same check must fail for a result off by one bf16 step in a single element.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=gen).to(torch.bfloat16).cuda()
    b = torch.randn(128, 32, generator=gen).to(torch.bfloat16).cuda()
    exact = a.double() @ b.double()
    wrong = (a @ b).double()
    wrong[3, 5] += 4 * BF16_EPS * exact[3, 5].abs() + 1e-3
    bound = BF16_EPS * exact.abs() + 128 * 2.0**-23 * (a.double().abs() @ b.double().abs())
    assert float(((wrong - exact).abs() - bound).max()) > 0.0


def test_cuda_graph_replay_matches_eager_and_replays_side_effects():
    graph_excess, acc_excess = cuda_graph_replay_excess("cuda")
    assert graph_excess <= 0.0, "the replayed graph computed something else than eager mode"
    assert acc_excess <= 0.0, "the graph did not replay its in-place side effect 4 times"
