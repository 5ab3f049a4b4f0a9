"""Nemotron-H hybrid on a GPU: the fast scan path and a bf16 training step.

Run on a CUDA machine with the workspace sources on the path, e.g.::

    PYTHONPATH=ci/src:packages/plugins/src python -m pytest tests/plugins/test_nemotron_h_gpu.py

The fast path is whatever :func:`scan_backend("cuda")` chooses (``mamba_ssm`` when it imports, else
the ``torch.compile`` chunked scan); the reference is the eager float32 chunked scan, itself
checked against the step-by-step recurrence on CPU.  Random data is fresh on every run; the seed is
in every failure message.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from mizzen_ci import register_cuda_ci
from mizzen_plugins.nemotron_h import NemotronHConfig, build_model
from mizzen_plugins.nemotron_h.scan_backend import scan_backend
from mizzen_plugins.nemotron_h.ssd import ssd_chunked

register_cuda_ci(
    est_time=185,
    hardware=["hopper", "blackwell"],
    num_gpus=1,
    labels=["ssm", "plugins"],
    shares_gpu=True,
)

CUDA = torch.device("cuda")


@pytest.fixture
def seed():
    value = random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    return value


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.double(), expected.double()
    return ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def seq_idx_from_lengths(lengths, device):
    return torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])


def test_fast_scan_matches_the_reference_in_bf16(seed):
    backend = scan_backend("cuda")
    try:
        import mamba_ssm  # noqa: F401

        expected_backend = "mamba_ssm"
    except ImportError:
        expected_backend = "compiled"
    assert backend.name == expected_backend, backend.reason

    lengths = [700, 1, 129, 64, 300, 854]  # boundaries inside and on chunk edges (chunk 64)
    T, H, P, G, N = sum(lengths), 8, 64, 2, 64
    x = torch.randn(1, T, H, P, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    dt = (torch.rand(1, T, H, device=CUDA) * 0.1 + 0.001).requires_grad_()
    # A as the mixer makes it (-exp(A_log), a trained parameter): the graph the training step and
    # the plugin runs compile too (an A without gradient was a second forward and backward, cold)
    A_log = torch.log(torch.rand(H, device=CUDA) * 4 + 0.5).requires_grad_()
    A = -torch.exp(A_log)
    B = torch.randn(1, T, G, N, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    C = torch.randn(1, T, G, N, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    seq_idx = seq_idx_from_lengths(lengths, CUDA)[None]
    upstream = torch.randn(1, T, H, P, device=CUDA)

    got = backend.run(x, dt, A, B, C, chunk_size=64, seq_idx=seq_idx)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    got_grads = torch.autograd.grad((got.float() * upstream).sum(), (x, dt, A_log, B, C))

    leaves = [t.detach().float().requires_grad_() for t in (x, dt, A_log, B, C)]
    xf, dtf, A_logf, Bf, Cf = leaves
    expected = ssd_chunked(xf, dtf, -torch.exp(A_logf), Bf, Cf, chunk_size=64, seq_idx=seq_idx)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves)

    error = relative_error(got, expected)
    assert error < 2e-2, f"forward relative error {error:.3g} (seed {seed}, {backend.name})"
    for name, a, b in zip(("x", "dt", "A_log", "B", "C"), got_grads, expected_grads, strict=True):
        assert torch.isfinite(a).all(), f"grad {name} not finite (seed {seed})"
        error = relative_error(a, b)
        assert error < 5e-2, f"grad {name} relative error {error:.3g} (seed {seed})"


SMALL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "hybrid_override_pattern": "M-M*-M-",
    "ssm_state_size": 32,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 64,  # the scan test's: one compiled scan serves both tests
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
}


def test_hybrid_training_step_in_bf16_on_cuda(seed):
    config = NemotronHConfig.from_hf_dict(SMALL)
    reference = build_model(config)  # float32 on CPU: eager reference scan
    model = build_model(config).to(CUDA, torch.bfloat16)
    model.load_state_dict(reference.state_dict())

    lengths = [100, 37, 1, 250, 64]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=CUDA)
    ids = torch.randint(0, config.vocab_size, (sum(lengths),), device=CUDA)
    labels = torch.randint(0, config.vocab_size, (sum(lengths),), device=CUDA)

    logits = model(ids, cu_seqlens)
    assert logits.dtype == torch.bfloat16 and logits.shape == (sum(lengths), config.vocab_size)
    with torch.no_grad():
        expected = reference(ids.cpu(), cu_seqlens.cpu())
    error = relative_error(logits.cpu(), expected)
    assert error < 3e-2, (
        f"bf16 CUDA logits vs float32 CPU: relative error {error:.3g} (seed {seed})"
    )

    loss = F.cross_entropy(logits.float(), labels)
    loss.backward()
    assert torch.isfinite(loss), f"loss {loss.item()} (seed {seed})"
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name} (seed {seed})"
        assert p.grad.abs().max() > 0, f"{name} got a zero gradient (seed {seed})"

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    optimizer.zero_grad()
    # Packing on the GPU: each sequence's logits do not depend on its neighbours — the same
    # sequences packed in the reverse order give the same slices.  Same total length as the
    # packed batch, so the compiled scan is reused, not recompiled for every sequence length.
    pieces = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True))
    reverse_ids = torch.cat([ids[start:end] for start, end in reversed(pieces)])
    reverse_cu = torch.tensor([0, *torch.tensor(lengths[::-1]).cumsum(0).tolist()], device=CUDA)
    with torch.no_grad():
        packed = model(ids, cu_seqlens).float()
        after = F.cross_entropy(packed, labels)
        reverse = model(reverse_ids, reverse_cu).float()
    assert after < loss, f"one step on the batch did not lower its loss (seed {seed})"
    reverse_pieces = zip(reverse_cu[:-1].tolist(), reverse_cu[1:].tolist(), strict=True)
    for (start, end), (r_start, r_end) in zip(pieces, reversed(list(reverse_pieces)), strict=True):
        error = relative_error(packed[start:end], reverse[r_start:r_end])
        assert error < 2e-2, f"sequence [{start}, {end}) moved: {error:.3g} (seed {seed})"
