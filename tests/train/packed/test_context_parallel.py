"""Context parallel inside the slot executor: CP=2 gloo ranks train like one rank.

The packed stream of every micro-batch is split over the CP ranks load-balanced (chunks ``r`` and
``2C-1-r``, :func:`mizzen_plugins.context_parallel.shard_packed_stream`); keys and values are
all-gathered, the loss is summed over the ranks' tokens and the LoRA gradients reduce over
data-parallel x context-parallel.  10 fp32 steps at CP=2 against the single-rank run on the same
batch: per-step losses within 1e-4 relative, the final adapters close, and forward_logprobs
(gathered over the CP ranks) the same.  A micro-batch mixing slots runs under CP too (the
routing is built on each rank's share of the stream): its losses and log-probs are the single
rank's, and ``forward_backward_logprobs`` gathers its log-probs over the CP ranks like
``forward_logprobs``.
"""

from __future__ import annotations

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=15, labels=["lora", "megatron", "distributed"])

STEPS = 10
# samples per row: segments cross the CP chunk boundaries (seq 24 per row, 2 rows per slot)
ROW_SAMPLES = [[7, 9, 5], [11, 10], [6, 6, 6, 4], [23]]


def _batch(step: int, row_slots=(0, 0, 1, 1)):
    from mizzen_train.batch import SlotBatch

    generator = torch.Generator().manual_seed(100 + step)
    rows, seq = len(ROW_SAMPLES), 24
    input_ids = torch.randint(0, 128, (rows, seq), generator=generator)
    target_ids = (input_ids * 3 + 1) % 128  # learnable: the loss falls
    segment_ids = torch.full((rows, seq), -1)
    for row, lengths in enumerate(ROW_SAMPLES):
        start = 0
        for index, length in enumerate(lengths):
            segment_ids[row, start : start + length] = index
            start += length
    loss_mask = segment_ids >= 0
    slot_ids = torch.tensor(row_slots).unsqueeze(1).expand(rows, seq).clone()
    return SlotBatch(input_ids, target_ids, loss_mask, slot_ids, segment_ids=segment_ids)


def _train_scenario(kit) -> dict:
    from megatron.core import parallel_state

    from mizzen_train.gpt import GPTSpec
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    spec = GPTSpec.llama(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=128,
        max_sequence_length=64,
    )
    executor = kit.tiny_executor(num_slots=2, max_rank=8, micro_batch_size=2, gpt=spec)
    executor.load_slot(0, 4, 8.0, seed=1)
    executor.load_slot(1, 8, 8.0, weights=kit.random_adapter(executor, 8, seed=2))
    before = executor.forward_logprobs(_batch(1))
    losses = []
    batch = _batch(0)
    for _ in range(STEPS):
        reports = executor.forward_backward(batch, CrossEntropyLoss())
        losses.append({slot: r.loss for slot, r in reports.items()})
        executor.optim_step({0: AdamParams(lr=3e-2), 1: AdamParams(lr=1e-2)})
    # micro-batches of rows [0, 1] and [1, 1]: the first holds both slots (runs of each slot in
    # every CP rank's share of the stream)
    mixed_batch = _batch(0, row_slots=[0, 1, 1, 1])
    # the fused call: its log-probs come from the CP ranks' shares of its own forward
    mixed, mixed_fused = executor.forward_backward_logprobs(mixed_batch, CrossEntropyLoss())
    return {
        "mixed_losses": {slot: r.loss for slot, r in mixed.items()},
        "mixed_fused_logprobs": mixed_fused,
        "mixed_logprobs": executor.forward_logprobs(mixed_batch),
        "usable_after": executor.failed is None,
        "cp": parallel_state.get_context_parallel_world_size(),
        "losses": losses,
        "weights": {slot: executor.adapter_weights(slot) for slot in (0, 1)},
        "logprobs_before": before,
        "logprobs_after": executor.forward_logprobs(_batch(1)),
    }


def test_context_parallel_two_ranks_train_like_one(kit):
    (single,) = kit.run_ranks(_train_scenario, args=(kit,))
    split = kit.run_ranks(_train_scenario, world_size=2, cp=2, args=(kit,))
    assert single["cp"] == 1 and all(rank["cp"] == 2 for rank in split)
    for rank in split:
        assert rank["usable_after"]
        for slot, loss in single["mixed_losses"].items():
            assert abs(rank["mixed_losses"][slot] - loss) / abs(loss) < 1e-3, (slot, loss)
        torch.testing.assert_close(
            rank["mixed_logprobs"], single["mixed_logprobs"], rtol=1e-3, atol=1e-3
        )
        # no step between them: the fused forward's log-probs are the later forward's
        torch.testing.assert_close(
            rank["mixed_fused_logprobs"], rank["mixed_logprobs"], rtol=0, atol=1e-5
        )
    first, last = single["losses"][0], single["losses"][-1]
    assert all(last[s] < first[s] for s in first), f"loss did not fall: {first} -> {last}"
    worst = worst_weight = 0.0
    for rank in split:
        for step, (one, two) in enumerate(zip(single["losses"], rank["losses"], strict=True)):
            for slot in one:
                error = abs(two[slot] - one[slot]) / abs(one[slot])
                worst = max(worst, error)
                assert error < 1e-4, f"step {step} slot {slot}: {two[slot]} vs {one[slot]}"
        for slot, factors in single["weights"].items():
            for name, value in factors.items():
                # Adam's first steps divide by sqrt(v): float noise in the gradient (a CP
                # rank's share of a slot is several runs of its stream, their gradients summed
                # in another order than one rank's) moves a weight by up to ~lr * 1e-2; the
                # factors themselves are ~1e-1
                drift = (rank["weights"][slot][name] - value).abs().max().item()
                worst_weight = max(worst_weight, drift / value.abs().max().item())
                torch.testing.assert_close(rank["weights"][slot][name], value, rtol=1e-3, atol=3e-4)
        # the same weights give the same log-probs; after training, the weights' float drift
        torch.testing.assert_close(rank["logprobs_before"], single["logprobs_before"])
        torch.testing.assert_close(
            rank["logprobs_after"], single["logprobs_after"], rtol=1e-3, atol=1e-3
        )
    print(
        f"CP=2 vs one rank over {STEPS} steps: worst per-step loss relative error {worst:.3g}, "
        f"worst final weight difference / factor max {worst_weight:.3g}"
    )


def _share_without_slot_tokens_scenario(kit, real_tokens: int, base_only_row: bool) -> dict:
    """A micro-batch one CP rank's share of which holds no slot token: a short slot row beside a
    base-only row, or one real token (the other rank's share is padding)."""
    from mizzen_train.batch import SlotBatch
    from mizzen_train.losses import CrossEntropyLoss

    rows = 2 if base_only_row else 1
    executor = kit.tiny_executor(num_slots=1, max_rank=8, micro_batch_size=rows)
    executor.load_slot(0, 4, 8.0, seed=1)
    input_ids = torch.randint(0, 128, (rows, 16), generator=torch.Generator().manual_seed(0))
    segment_ids = torch.full((rows, 16), -1)
    segment_ids[0, :real_tokens] = 0
    slot_ids = torch.zeros(rows, 16, dtype=torch.long)
    if base_only_row:
        segment_ids[1, :12] = 0
        slot_ids[1] = -1
    batch = SlotBatch(input_ids, input_ids, segment_ids >= 0, slot_ids, segment_ids=segment_ids)
    report = executor.forward_backward(batch, CrossEntropyLoss())[0]
    return {"loss": report.loss, "grad": executor.inspect_slot(0)["grad"]}


@pytest.mark.parametrize(
    "real_tokens, base_only_row", [(4, True), (1, False)], ids=["base_only_row", "one_token"]
)
def test_a_cp_rank_without_slot_tokens_runs_the_step_with_its_peers(
    kit, real_tokens, base_only_row
):
    """Each rank used to decide from its own share whether the micro-batch trains: one skipped
    it while its peer waited in the key/value all-gather (a hang)."""
    args = (kit, real_tokens, base_only_row)
    (single,) = kit.run_ranks(_share_without_slot_tokens_scenario, args=args)
    split = kit.run_ranks(
        _share_without_slot_tokens_scenario, world_size=2, cp=2, args=args, timeout=60
    )
    for rank in split:
        assert abs(rank["loss"] - single["loss"]) <= 1e-5 * abs(single["loss"])
    # before the optimizer step each CP rank holds the gradient of its share's tokens
    assert any(g.abs().max() > 0 for g in single["grad"].values()), "vacuous: no gradient"
    for name, grad in single["grad"].items():
        summed = split[0]["grad"][name] + split[1]["grad"][name]
        torch.testing.assert_close(summed, grad, rtol=1e-4, atol=1e-6)
