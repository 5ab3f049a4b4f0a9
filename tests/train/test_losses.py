"""The target log-probabilities both losses start from: the fused path's body equals megatron's
``vocab_parallel_cross_entropy`` in values and gradients (bf16 and fp32 logits, ``[1, T, V]`` and
``[b, s, V]``, ids outside the vocabulary included), also against megatron's vocabulary shards at
TP 2; CPU logits take megatron's path and never reach the compiler; bad targets are clear errors.

The compiled path itself runs on CUDA only: ``test_losses_gpu.py`` checks it.
"""

from __future__ import annotations

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=20, labels=["train"])

# [1, T, V] (one packed stream) and [b, s, V]; V not a power of two, one of them wide.
SHAPES = [(1, 37, 101), (3, 16, 257), (2, 9, 4096)]


def _case(shape, dtype, seed):
    """Logits far from 0 (the max shift matters in fp32), ids with some outside ``[0, V)``, and
    a random upstream gradient (so the gradient's scaling by it is checked too)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = shape[-1]
    logits = (4 * torch.randn(shape, generator=gen) + 30).to(dtype)
    targets = torch.randint(0, vocab, shape[:-1], generator=gen)
    flat = targets.view(-1)
    flat[::5] = -1  # the usual "ignore" id
    flat[1::7] = vocab  # one past the end
    flat[2::11] = -100
    upstream = torch.randn(shape[:-1], generator=gen)
    return logits, targets, upstream


def _value_and_grad(fn, logits, targets, upstream):
    """``fn(logits, targets)`` and the gradient of ``sum(value * upstream)`` wrt a fresh leaf
    (megatron works in place on fp32 logits, so each path gets its own copy)."""
    leaf = logits.detach().clone().requires_grad_()
    value = fn(leaf, targets)
    (value * upstream).sum().backward()
    return value.detach(), leaf.grad


def _megatron(logits, targets):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float(), targets)


def _compare_with_megatron(dtype_name: str) -> list[str]:
    """On a TP-1 rank: the fused body against megatron, for every shape; what was checked."""
    from mizzen_train.losses import fused_target_logprobs

    dtype = getattr(torch, dtype_name)
    checked = []
    for seed, shape in enumerate(SHAPES):
        logits, targets, upstream = _case(shape, dtype, seed)
        got, got_grad = _value_and_grad(fused_target_logprobs, logits, targets, upstream)
        want, want_grad = _value_and_grad(_megatron, logits, targets, upstream)
        assert got.dtype == torch.float32 and got.shape == shape[:-1]
        assert got_grad.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_grad, want_grad)
        outside = (targets < 0) | (targets >= shape[-1])
        assert outside.any() and (~outside).any()
        # megatron's value for an id outside the vocabulary: that of an argmax token.
        x = logits.float()
        expected = x.amax(-1) - torch.logsumexp(x, -1)
        torch.testing.assert_close(got[outside], expected[outside], rtol=1e-5, atol=1e-5)
        checked.append(shape)
    return checked


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_fused_body_equals_megatron_in_values_and_gradients(kit, dtype_name):
    (checked,) = kit.run_ranks(_compare_with_megatron, tp=1, args=(dtype_name,))
    assert checked == SHAPES


def _tp2_shard(dtype_name: str) -> None:
    """This rank's half of the vocabulary through ``target_logprobs`` (megatron's path at TP 2)
    against the fused body on the whole vocabulary: the values and this shard's gradient."""
    from megatron.core import parallel_state

    from mizzen_train.losses import fused_target_logprobs, target_logprobs

    logits, targets, upstream = _case((2, 9, 512), getattr(torch, dtype_name), seed=7)
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = logits.chunk(2, dim=-1)[rank]
    got, got_grad = _value_and_grad(fused_target_logprobs, logits, targets, upstream)
    want, want_grad = _value_and_grad(target_logprobs, shard, targets, upstream)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.chunk(2, dim=-1)[rank], want_grad)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_fused_body_equals_megatron_on_vocabulary_shards(kit, dtype_name):
    kit.run_ranks(_tp2_shard, world_size=2, tp=2, args=(dtype_name,))


def _cpu_dispatch() -> dict:
    """``target_logprobs`` on CPU logits at TP 1: megatron's result, bitwise, no compiled
    function made."""
    from mizzen_train import losses

    logits, targets, upstream = _case((2, 9, 300), torch.bfloat16, seed=3)
    got, got_grad = _value_and_grad(losses.target_logprobs, logits, targets, upstream)
    want, want_grad = _value_and_grad(_megatron, logits, targets, upstream)
    return {
        "equal": torch.equal(got, want) and torch.equal(got_grad, want_grad),
        "compiled": losses._compiled_fused_target_logprobs.cache_info().currsize,
    }


def test_cpu_logits_take_megatrons_path_and_never_compile(kit):
    (result,) = kit.run_ranks(_cpu_dispatch, tp=1)
    assert result == {"equal": True, "compiled": 0}


@pytest.mark.parametrize(
    ("targets", "error", "message"),
    [
        (torch.zeros(2, 5), TypeError, "integer token ids, got dtype torch.float32"),
        (torch.zeros(2, 5, dtype=torch.bool), TypeError, "got dtype torch.bool"),
        (torch.zeros(2, 4, dtype=torch.long), ValueError, r"shape \[2, 5\].*got \[2, 4\]"),
        (torch.zeros(10, dtype=torch.long), ValueError, r"shape \[2, 5\].*got \[10\]"),
        (torch.zeros(2, 5, dtype=torch.long, device="meta"), ValueError, "are on meta"),
    ],
)
def test_bad_targets_are_errors_naming_what_was_given(targets, error, message):
    from mizzen_train.losses import target_logprobs

    with pytest.raises(error, match=message):
        target_logprobs(torch.zeros(2, 5, 11), targets)


def test_an_empty_vocabulary_is_an_error():
    from mizzen_train.losses import target_logprobs

    with pytest.raises(ValueError, match="non-empty vocabulary"):
        target_logprobs(torch.zeros(2, 5, 0), torch.zeros(2, 5, dtype=torch.long))
