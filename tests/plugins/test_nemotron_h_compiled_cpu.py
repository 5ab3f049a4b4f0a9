"""The torch.compile fast path of the selective scan, run on CPU (inductor's C++ backend).

Nightly only: compiling the chunked scan with dynamic shapes takes minutes on a 2-core CPU runner.
The same compiled function is the CUDA default without mamba_ssm (checked on GPU by
test_nemotron_h_gpu.py).
"""

import pytest
import torch

from mizzen_ci import register_cpu_ci
from mizzen_plugins.nemotron_h import scan_backend as backend_module
from mizzen_plugins.nemotron_h.ssd import ssd_chunked

register_cpu_ci(est_time=240, labels=["ssm", "plugins"], nightly=True)
# A compiled backward starts autograd's device threads in its process: a rank forked from that
# process afterwards refuses to run backward ("autograd's threading in combination with
# fork-based multiprocessing"; seen in a clean .ci/run on the worker's next file).  The body runs
# in a child of the pytest process instead (tests/conftest.py).
pytestmark = pytest.mark.in_child


def test_compiled_scan_equals_the_eager_scan_forward_and_backward(monkeypatch):
    monkeypatch.setenv(backend_module.ENV_VAR, "compiled")
    backend_module.scan_backend.cache_clear()
    try:
        backend = backend_module.scan_backend("cpu")
        assert backend.name == "compiled"
        g = torch.Generator().manual_seed(0)
        for T in (19, 33):  # two lengths: the dynamic-shape graph serves both
            H, P, N = 2, 4, 4
            x = torch.randn(1, T, H, P, generator=g, requires_grad=True)
            dt = (torch.rand(1, T, H, generator=g) * 0.5 + 0.01).requires_grad_()
            A = -(torch.rand(H, generator=g) + 0.1)
            B = torch.randn(1, T, 1, N, generator=g, requires_grad=True)
            C = torch.randn(1, T, 1, N, generator=g, requires_grad=True)
            seq = torch.tensor([[0] * (T // 3) + [1] * (T - T // 3)])
            inputs = (x, dt, A, B, C)

            got = backend.run(*inputs, chunk_size=8, seq_idx=seq)
            grads_got = torch.autograd.grad(got.square().sum(), (x, dt, B, C))
            expected = ssd_chunked(*inputs, chunk_size=8, seq_idx=seq)
            grads_expected = torch.autograd.grad(expected.square().sum(), (x, dt, B, C))

            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            for a, b in zip(grads_got, grads_expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        backend_module.scan_backend.cache_clear()
