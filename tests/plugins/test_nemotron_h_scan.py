"""The Mamba-2 selective scan and the causal conv: chunked == step by step, and THD restarts."""

import logging

import pytest
import torch

from mizzen_ci import register_cpu_ci
from mizzen_plugins.nemotron_h import scan_backend as backend_module
from mizzen_plugins.nemotron_h.conv import causal_depthwise_conv
from mizzen_plugins.nemotron_h.ssd import ssd_chunked, ssd_step_by_step
from mizzen_plugins.thd import PackedLayout

register_cpu_ci(est_time=10, labels=["ssm", "plugins", "thd"])


def random_scan_inputs(b, T, H, P, G, N, *, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, H, P, generator=g, dtype=dtype)
    dt = torch.rand(b, T, H, generator=g, dtype=dtype) * 0.5 + 0.01
    A = -(torch.rand(H, generator=g, dtype=dtype) * 3 + 0.05)
    B = torch.randn(b, T, G, N, generator=g, dtype=dtype)
    C = torch.randn(b, T, G, N, generator=g, dtype=dtype)
    return x, dt, A, B, C


def segment_bounds(layout):
    return [(s, s + n) for s, n in zip(layout.starts, layout.lengths, strict=True) if n]


def seq_idx_from_lengths(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 16, 64])
def test_chunked_scan_equals_the_step_by_step_recurrence(chunk_size):
    # 37 tokens: never a multiple of the chunk (except 1); several sequences per chunk, one-token
    # and chunk-straddling sequences, a boundary exactly on a chunk start (at 8 and 16).
    lengths = [5, 3, 8, 1, 15, 5]
    seq = torch.stack([seq_idx_from_lengths(lengths), torch.zeros(37, dtype=torch.int64)])
    x, dt, A, B, C = random_scan_inputs(2, 37, H=4, P=3, G=2, N=5, seed=chunk_size)
    expected = ssd_step_by_step(x, dt, A, B, C, seq)
    got = ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, seq_idx=seq)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # Without seq_idx: one sequence per batch row, state carried over the whole row.
    torch.testing.assert_close(
        ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size),
        ssd_step_by_step(x, dt, A, B, C),
        rtol=1e-10,
        atol=1e-10,
    )


def test_chunked_scan_gradients_equal_the_recurrence_gradients():
    lengths = [6, 1, 9, 4]
    seq = seq_idx_from_lengths(lengths)[None]
    inputs = [t.requires_grad_() for t in random_scan_inputs(1, 20, H=2, P=3, G=1, N=4, seed=7)]
    weights = torch.randn(1, 20, 2, 3, dtype=torch.float64)
    (ssd_step_by_step(*inputs, seq) * weights).sum().backward()
    expected = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    (ssd_chunked(*inputs, chunk_size=8, seq_idx=seq) * weights).sum().backward()
    for name, t, g in zip(["x", "dt", "A", "B", "C"], inputs, expected, strict=True):
        assert torch.isfinite(t.grad).all(), name
        torch.testing.assert_close(t.grad, g, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")


def test_packed_scan_equals_separate_runs_per_sequence():
    layout = PackedLayout.from_lengths([7, 12, 1, 0, 20])
    x, dt, A, B, C = random_scan_inputs(1, layout.num_tokens, H=4, P=2, G=2, N=3, seed=3)
    y = ssd_chunked(x, dt, A, B, C, chunk_size=8, seq_idx=layout.segment_ids[None])
    for start, end in segment_bounds(layout):
        alone = ssd_chunked(
            *(t[:, start:end] for t in (x, dt)), A, *(t[:, start:end] for t in (B, C)), chunk_size=8
        )
        torch.testing.assert_close(y[:, start:end], alone, rtol=1e-10, atol=1e-10)


def test_scan_keeps_the_input_dtype_and_computes_in_float32():
    x, dt, A, B, C = random_scan_inputs(1, 24, H=2, P=4, G=1, N=4, seed=11, dtype=torch.float32)
    reference = ssd_chunked(
        x.double(), dt.double(), A.double(), B.double(), C.double(), chunk_size=8
    )
    low = ssd_chunked(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), chunk_size=8)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), reference, rtol=2e-2, atol=5e-2)


def test_scan_rejects_mismatched_shapes():
    x, dt, A, B, C = random_scan_inputs(1, 10, H=4, P=2, G=3, N=3, seed=0)
    with pytest.raises(ValueError, match="3 groups must divide 4 heads"):
        ssd_chunked(x, dt, A, B, C, chunk_size=4)


def test_packed_conv_equals_per_sequence_conv_with_zero_history():
    layout = PackedLayout.from_lengths([1, 6, 0, 3, 9])
    T, channels, K = layout.num_tokens, 5, 4
    x = torch.randn(T, channels, dtype=torch.float64)
    weight = torch.randn(channels, K, dtype=torch.float64)
    bias = torch.randn(channels, dtype=torch.float64)
    out = causal_depthwise_conv(x, weight, bias, layout.positions)
    for start, end in segment_bounds(layout):
        # torch's own depthwise conv on the sequence alone (left zero padding, causal crop).
        alone = torch.nn.functional.conv1d(
            x[start:end].T[None], weight[:, None, :], bias, padding=K - 1, groups=channels
        )[0, :, : end - start].T
        torch.testing.assert_close(out[start:end], alone)


@pytest.fixture
def fresh_backend_choice(monkeypatch):
    monkeypatch.delenv(backend_module.ENV_VAR, raising=False)
    backend_module.scan_backend.cache_clear()
    yield monkeypatch
    backend_module.scan_backend.cache_clear()


def test_backend_is_chosen_once_per_device_type_and_logged(fresh_backend_choice, caplog):
    caplog.set_level(logging.INFO, logger=backend_module.__name__)
    first = backend_module.scan_backend("cpu")
    assert first.name == "reference" and first.run is ssd_chunked
    assert backend_module.scan_backend("cpu") is first
    logged = [r.getMessage() for r in caplog.records if r.name == backend_module.__name__]
    assert logged == ["selective scan on cpu: reference (cpu: eager pure-torch chunked scan)"]


def assert_no_mamba_ssm():
    try:
        import mamba_ssm  # noqa: F401
    except ImportError:
        return
    pytest.fail("this CPU test expects mamba_ssm to be absent, as on the CPU image")


def test_cuda_falls_back_to_the_compiled_scan_without_mamba_ssm(fresh_backend_choice, caplog):
    # Only the decision is made here (no CUDA call): the compiled scan is wrapped, not run.
    assert_no_mamba_ssm()
    caplog.set_level(logging.INFO, logger=backend_module.__name__)
    chosen = backend_module.scan_backend("cuda")
    assert chosen.name == "compiled"
    (message,) = [r.getMessage() for r in caplog.records if r.name == backend_module.__name__]
    assert message.startswith("selective scan on cuda: compiled (mamba_ssm unavailable (")
    assert "No module named 'mamba_ssm'" in message
    assert not torch.cuda.is_initialized()


def test_forced_backend_that_cannot_run_is_an_error(fresh_backend_choice):
    assert_no_mamba_ssm()
    fresh_backend_choice.setenv(backend_module.ENV_VAR, "mamba_ssm")
    with pytest.raises(
        RuntimeError, match=r"MIZZEN_SSM_SCAN=mamba_ssm but mamba_ssm cannot be used"
    ):
        backend_module.scan_backend("cpu")
    fresh_backend_choice.setenv(backend_module.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=r"'fastest' is not a scan backend"):
        backend_module.scan_backend("cpu")


def _counting_compiled_scan():
    """The compiled scan on a fresh dynamo with a backend that counts its traces (dynamo's eager
    backend traces exactly what inductor would compile, in milliseconds): ``(run, traced)``."""
    torch._dynamo.reset()
    traced = []

    def counting_backend(graph_module, example_inputs):
        traced.append(len(example_inputs))
        return graph_module.forward

    return backend_module._compiled_scan(counting_backend), traced


@pytest.mark.in_child  # dynamo's state stays in a child of the pytest process
def test_the_compiled_scan_is_traced_once_for_every_length():
    # The compiled scan pads the time axis outside the graph (whole chunks, at least two), so
    # lengths whose in-graph pad would be 0, 1, other, or a single chunk share one graph: the GPU
    # lane's plugin runs compiled it up to five times (forward and backward each) cold.
    # opt_einsum (a dev dependency, as on the GPU images) is on: with it, an einsum of three or
    # more operands specialises the graph to the sizes (the GPU lane recompiled the scan for
    # every packed length and state size).
    assert torch.backends.opt_einsum.is_available() and torch.backends.opt_einsum.enabled
    run, traced = _counting_compiled_scan()
    # views that are contiguous (segment ids made as `ids[None]`, inputs sliced from a larger
    # batch, `A` a slice), as the GPU scan test passes them, first: dynamo guarded a view on its
    # base's sizes, so views in the first call and tensors of their own later were two graphs
    xs, dts, As, Bs, Cs = random_scan_inputs(2, 24, 2, 3, 1, 4, seed=48, dtype=torch.float32)
    views = (xs[1:], dts[1:], torch.cat([As, As])[2:], Bs[1:], Cs[1:])
    seq_view = torch.tensor([0] * 10 + [1] * 14)[None]
    assert all(t._base is not None for t in (*views, seq_view))
    got = run(*views, chunk_size=8, seq_idx=seq_view)
    torch.testing.assert_close(got, ssd_chunked(*views, chunk_size=8, seq_idx=seq_view))
    for T in (5, 8, 9, 15, 16, 17, 33):  # chunk 8: in-graph pads 3, 0, 7, 1, 0, 7, 7; one chunk
        x, dt, A, B, C = random_scan_inputs(1, T, 2, 3, 1, 4, seed=T, dtype=torch.float32)
        seq = torch.tensor([[0] * (T // 2) + [1] * (T - T // 2)])
        got = run(x, dt, A, B, C, chunk_size=8, seq_idx=seq)
        torch.testing.assert_close(got, ssd_chunked(x, dt, A, B, C, chunk_size=8, seq_idx=seq))
        unsegmented = run(x, dt, A, B, C, chunk_size=8, seq_idx=None)
        expected = ssd_chunked(x, dt, A, B, C, chunk_size=8)
        torch.testing.assert_close(unsegmented, expected)
    # int32 segment ids (mamba's usual dtype) on a whole-chunk length: still the same graph
    x, dt, A, B, C = random_scan_inputs(1, 24, 2, 3, 1, 4, seed=24, dtype=torch.float32)
    seq32 = torch.tensor([[0] * 10 + [1] * 14], dtype=torch.int32)
    got = run(x, dt, A, B, C, chunk_size=8, seq_idx=seq32)
    torch.testing.assert_close(got, ssd_chunked(x, dt, A, B, C, chunk_size=8, seq_idx=seq32))
    # the mixer's inputs: x, B and C strided views of one projection (split, then reshaped), on a
    # whole-chunk length (no pad, so no copy made them contiguous): still the same graph
    xbc = torch.randn(24, 2 * 3 + 2 * 4, dtype=torch.float32)
    x, B, C = (
        t.reshape(1, 24, -1, n) for t, n in zip(xbc.split([6, 4, 4], -1), (3, 4, 4), strict=True)
    )
    assert not x.is_contiguous()
    got = run(x, dt, A, B, C, chunk_size=8, seq_idx=seq32)
    torch.testing.assert_close(got, ssd_chunked(x, dt, A, B, C, chunk_size=8, seq_idx=seq32))
    # another state size, head count and head dim (the GPU scan test has two shapes; one group:
    # a size of 1 is specialised by dynamo, and a model keeps its group count): the same graph
    x, dt, A, B, C = random_scan_inputs(1, 40, 4, 5, 1, 6, seed=40, dtype=torch.float32)
    got = run(x, dt, A, B, C, chunk_size=8, seq_idx=None)
    torch.testing.assert_close(got, ssd_chunked(x, dt, A, B, C, chunk_size=8))
    assert len(traced) == 1, f"the scan was traced {len(traced)} times for 11 inputs"
    # a shape error names the caller's sizes, not the padded ones
    with pytest.raises(
        ValueError, match=r"x is \(1, 15, 2, 3\)\): dt \(1, 14, 2\) != \(1, 15, 2\)"
    ):
        run(*random_scan_inputs(1, 15, 2, 3, 1, 4, seed=0)[:1], torch.rand(1, 14, 2),
            *random_scan_inputs(1, 15, 2, 3, 1, 4, seed=0)[2:], chunk_size=8)  # fmt: skip


@pytest.mark.in_child  # dynamo's state stays in a child of the pytest process
def test_the_compiled_scan_is_traced_once_in_inference_mode_for_offset_inputs():
    # inference mode tracks no views (a slice's _base is None), so a slice into a larger batch
    # reached the graph with a storage offset, which dynamo guards on: fresh tensors later were
    # a second graph (review of the view fix)
    run, traced = _counting_compiled_scan()
    with torch.inference_mode():
        xs, dts, As, Bs, Cs = random_scan_inputs(2, 24, 2, 3, 1, 4, seed=7, dtype=torch.float32)
        sliced = (xs[1:], dts[1:], As, Bs[1:], Cs[1:])
        assert sliced[0]._base is None and sliced[0].storage_offset() > 0
        got = run(*sliced, chunk_size=8, seq_idx=None)
        torch.testing.assert_close(got, ssd_chunked(*sliced, chunk_size=8))
        fresh = random_scan_inputs(1, 24, 2, 3, 1, 4, seed=8, dtype=torch.float32)
        torch.testing.assert_close(run(*fresh, chunk_size=8), ssd_chunked(*fresh, chunk_size=8))
    assert len(traced) == 1, f"the scan was traced {len(traced)} times for 2 inputs"
