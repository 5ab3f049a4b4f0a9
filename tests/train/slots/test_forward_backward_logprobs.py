"""``forward_backward_logprobs`` is ``forward_logprobs`` then ``forward_backward`` in one forward.

Two executors with the same base and adapters: one runs ``forward_logprobs`` and then
``forward_backward`` (what the training service did per request), the other
``forward_backward_logprobs``.  Same loss reports, same accumulated gradients, and the fused call's
log-probabilities equal the separate forward's — for a batch mixing two slots with two losses in
one micro-batch and a micro-batch of base-only rows (it trains nothing, so it gets a forward of
its own), and at DP=2, where each rank's rows are gathered back into batch order on every rank.
"""

from __future__ import annotations

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=12, labels=["lora", "megatron", "distributed"])

# micro-batches of 2: [0, 0], [0, 1] (two slots, two losses in one stream), [1, 1], [base, base];
# at DP=2 rank 1 holds the last two (its base-only micro-batch runs a forward rank 0 does not)
ROW_SLOTS = [0, 0, 0, 1, 1, 1, -1, -1]


def _executor(kit):
    executor = kit.tiny_executor(num_slots=2, max_rank=8, micro_batch_size=2)
    executor.load_slot(0, 4, 8.0, weights=kit.random_adapter(executor, 4, seed=5))
    executor.load_slot(1, 8, 16.0, weights=kit.random_adapter(executor, 8, seed=6))
    return executor


def _scenario(kit) -> dict:
    from mizzen_train.losses import ClippedPolicyGradientLoss, CrossEntropyLoss

    batch = kit.tiny_batch(ROW_SLOTS, seed=4, with_policy_fields=True)
    losses = {0: CrossEntropyLoss(), 1: ClippedPolicyGradientLoss(0.2, 0.3)}
    separate, fused = _executor(kit), _executor(kit)
    out = {"separate_logprobs": separate.forward_logprobs(batch)}
    out["separate_reports"] = separate.forward_backward(batch, losses)
    out["fused_reports"], out["fused_logprobs"] = fused.forward_backward_logprobs(batch, losses)
    for name, executor in (("separate", separate), ("fused", fused)):
        out[f"{name}_grads"] = {slot: executor.inspect_slot(slot)["grad"] for slot in (0, 1)}
    # gradients accumulated, nothing stepped: a forward now gives what the fused call returned
    out["after"] = fused.forward_logprobs(batch)
    return out


@pytest.mark.parametrize("world_size", [1, 2], ids=["dp1", "dp2"])
def test_fused_logprobs_are_the_separate_forward(kit, world_size):
    results = kit.run_ranks(_scenario, world_size=world_size, args=(kit,))
    for rank in results:
        lp = rank["fused_logprobs"]
        assert lp.shape == (len(ROW_SLOTS), 16) and lp.dtype == torch.float32
        assert lp.device.type == "cpu"
        torch.testing.assert_close(lp, rank["separate_logprobs"], rtol=0, atol=1e-6)
        assert lp[6:].abs().min() > 0, "the base-only micro-batch was not computed"
        for slot, report in rank["separate_reports"].items():
            twin = rank["fused_reports"][slot]
            assert twin.num_tokens == report.num_tokens
            assert abs(twin.loss - report.loss) <= 1e-6 * abs(report.loss), (slot, twin, report)
            assert twin.metrics == pytest.approx(report.metrics, rel=1e-6, abs=1e-7)
        for slot in (0, 1):  # this rank's local gradients (DP reduces them at the step)
            for name, grad in rank["separate_grads"][slot].items():
                torch.testing.assert_close(rank["fused_grads"][slot][name], grad)
        # forward_backward only accumulates gradients: the weights, and so the logprobs, stay
        torch.testing.assert_close(rank["after"], lp, rtol=0, atol=1e-6)
    for slot in (0, 1):
        for name in results[0]["separate_grads"][slot]:
            largest = max(rank["separate_grads"][slot][name].abs().max() for rank in results)
            assert largest > 0, f"slot {slot} {name}: no gradient on any rank (vacuous)"
    # every DP rank answers the whole batch in batch order
    for rank in results[1:]:
        torch.testing.assert_close(rank["fused_logprobs"], results[0]["fused_logprobs"])
