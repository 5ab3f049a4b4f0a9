"""The numeric checks of the GPU tests, as plain functions of a device.

A plain module (not a test file): ``tests/gpu/conftest.py`` loads it by path and hands it to
tests as the ``numerics`` fixture.  The GPU lane runs the checks on ``device="cuda"``
(``test_cuda_basics.py``), the CPU lane runs those that do not need CUDA on ``device="cpu"``
(``test_gpu_tests_on_cpu.py``), so both lanes check the same bound with the same code.

Invariants:
- An ``*_excess`` function returns how far a result strays beyond its admissible error bound:
  ``<= 0`` means within it.  Inputs come from fixed seeds, so the same call checks the same
  numbers on every machine.
- :func:`bf16_matmul_bound` is the one bound on a bf16 matmul, used by every check of one:
  ``2^-8·|exact| + k·2^-23·Σ|a||b|`` against the float64 product of the same bf16 inputs, i.e.
  twice the final rounding to bf16 (half a step, ``2^-9`` relative) plus twice an fp32
  accumulation (``k·2^-24`` relative to ``Σ|a||b|``).
- Importing this module touches no device; only :func:`cuda_graph_replay_excess` needs CUDA.
"""

from __future__ import annotations

import torch

BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits: a rounding step is at most 2^-8 relative


def bf16_matmul_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The admissible absolute error of each element of the bf16 product ``a @ b``, against the
    exact (float64) product of the same bf16 inputs."""
    exact = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    return BF16_EPS * exact.abs() + a.shape[1] * 2.0**-23 * magnitude + 1e-30


def bf16_matmul_excess(device: str, m: int = 512, k: int = 2048, n: int = 768) -> float:
    """How far a bf16 matmul on ``device`` strays beyond :func:`bf16_matmul_bound`.

    The reference multiplies the *same bf16-rounded inputs* in float64, so the only admissible
    error is the accumulation (fp32 or better) and the final rounding of each output to bf16.
    """
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(m, k, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    b = torch.randn(k, n, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    exact = a.double() @ b.double()
    # cuBLAS may otherwise reduce split-K partial sums in bf16, which no fp32 bound covers
    flags = torch.backends.cuda.matmul
    reduced = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        got = (a.to(device) @ b.to(device)).double().cpu()
    finally:
        flags.allow_bf16_reduced_precision_reduction = reduced
    assert got.dtype == torch.float64 and got.shape == (m, n)
    return float(((got - exact).abs() - bf16_matmul_bound(a, b)).max())


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
