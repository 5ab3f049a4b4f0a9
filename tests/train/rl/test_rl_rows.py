"""RL's training rows (``mizzen_train.rl.rows``): a row and a segment per sample, so the
executor's packed (THD) path sees each sample as its own sequence.

- Segment ids: 0 over a sample's ``len(prompt + response) - 1`` positions, ``-1`` on the padding
  after it; a sample with nothing to predict is a row of padding; the loss mask and advantages
  lie on the response targets of usable samples only, inside the segment.
- The executor's stream of the rows holds one sequence per sample (``cu_seqlens`` = the samples'
  lengths, no padding), positions restart at 0 for every sample.
- On a real megatron-core executor (one gloo rank): the reported packing efficiency is the
  samples' tokens over the rows' slots (< 1: padding is not counted), and every sample's target
  log-probs in the padded rows equal those of the sample alone in a row of its own length
  (nothing attends to padding or to another sample).
"""

from __future__ import annotations

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=25, labels=["train", "rollout", "megatron"])

WIDTH = 12
# (prompt, response, usable): a response of two tokens, one of three, one that failed (no
# reward: no loss), and a sample with nothing to predict (a row of padding)
SAMPLES = [
    ([5, 6, 7], [8, 9], True),
    ([10, 11], [12, 13, 14], True),
    ([15, 16, 17, 18], [19], False),
    ([20], [], True),
]
SLOTS = {"a": 0, "b": 1}
ROW_TENANTS = ["a", "a", "b", "b"]


def step_rows():
    from mizzen_rollout.api import Sample
    from mizzen_train.rl.rows import tokenise_rows

    rows = []
    for tenant, (prompt, response, usable) in zip(ROW_TENANTS, SAMPLES, strict=True):
        sample = Sample(
            prompt="p", prompt_tokens=prompt, response_tokens=response, loss_mask=[1] * len(response),
            rollout_logprobs=[-0.5] * len(response),
        )  # fmt: skip
        rows.append((tenant, {"sample": sample, "advantage": 0.75, "usable": usable}))
    return tokenise_rows(rows, slot_of=SLOTS, width=WIDTH, pad_id=0, stats={"a": {}, "b": {}})


def test_each_sample_is_one_segment_and_padding_is_minus_one():
    shared = step_rows()
    batch = shared.batch
    assert batch.segment_ids is not None and batch.segment_ids.shape == (4, WIDTH)
    for row, (prompt, response, usable) in enumerate(SAMPLES):
        length = len(prompt) + len(response) - 1
        segments = batch.segment_ids[row].tolist()
        assert segments == [0] * length + [-1] * (WIDTH - length), row
        assert batch.input_ids[row, :length].tolist() == (prompt + response)[:-1]
        assert batch.target_ids[row, :length].tolist() == (prompt + response)[1:]
        trained = batch.loss_mask[row].nonzero().flatten().tolist()
        expected = list(range(len(prompt) - 1, length)) if usable and response else []
        assert trained == expected, row  # the response targets, inside the segment
        assert bool((batch.advantages[row, expected] == 0.75).all())
        assert bool((batch.advantages[row, length:] == 0).all())
        assert batch.slot_ids[row].unique().tolist() == [SLOTS[ROW_TENANTS[row]]]
    assert shared.row_tenant == tuple(ROW_TENANTS)
    assert shared.real_tokens().sum().item() == sum(len(p) + len(r) - 1 for p, r, _ in SAMPLES)
    assert shared.engine_known.sum().item() == 2 + 3  # the usable responses' log-probs


def test_the_executor_stream_holds_one_sequence_per_sample_with_positions_from_zero():
    from mizzen_train.executor import real_token_mask, segment_positions, stream_segments

    batch = step_rows().batch
    index, lengths = stream_segments(batch, real_token_mask(batch))
    expected = [len(p) + len(r) - 1 for p, r, _ in SAMPLES if len(p) + len(r) > 1]
    assert lengths == expected  # cu_seqlens: one sequence per sample, no padding
    assert index.numel() == sum(expected)
    positions = segment_positions(batch.segment_ids)
    for row, length in enumerate(expected):
        assert positions[row, :length].tolist() == list(range(length))


def _on_a_rank(kit, rows_batch, alone_batches):
    """Target log-probs of the padded rows and of each sample alone, and the packing
    efficiency a policy-gradient step reports per slot."""
    from dataclasses import replace

    from mizzen_train.losses import ClippedPolicyGradientLoss

    executor = kit.tiny_executor(num_slots=2, micro_batch_size=2)
    for slot in (0, 1):
        executor.load_slot(slot, 4, 8.0, weights=kit.random_adapter(executor, 4, seed=slot))
    padded = executor.forward_logprobs(rows_batch)
    alone = [executor.forward_logprobs(batch)[0] for batch in alone_batches]
    loss = ClippedPolicyGradientLoss(clip_low=0.2, clip_high=0.2, kl_coef=0.0)
    reports = executor.forward_backward(replace(rows_batch, old_logprobs=padded), loss)
    return padded, alone, {slot: report.packing_efficiency for slot, report in reports.items()}


def test_a_real_executor_counts_no_padding_and_no_sample_sees_another(kit):
    from dataclasses import replace

    import torch

    batch = step_rows().batch
    alone = []  # each sample alone, in rows of exactly its length (two: one micro-batch)
    for row, (prompt, response, _) in enumerate(SAMPLES):
        length = len(prompt) + len(response) - 1
        if length >= 1:
            one = batch.select_rows(row, row + 1)
            cut = {name: t[:, :length].repeat(2, 1) for name, t in one.token_fields().items()}
            alone.append((row, length, replace(one, **cut)))
    padded, alone_logprobs, efficiency = kit.run_ranks(
        _on_a_rank, args=(kit, batch, [b for _, _, b in alone])
    )[0]
    real = batch.segment_ids >= 0
    for slot, rows in ((0, slice(0, 2)), (1, slice(2, 4))):
        expected = real[rows].sum().item() / real[rows].numel()
        print(f"slot {slot}: packing efficiency {efficiency[slot]:.4f}")
        assert efficiency[slot] == pytest.approx(expected) and efficiency[slot] < 1
    for (row, length, _), mine in zip(alone, alone_logprobs, strict=True):
        worst = (padded[row, :length] - mine[:length]).abs().max().item()
        assert worst <= 1e-5, (row, worst)
        assert bool((padded[row, length:] == 0).all())  # padding: log-prob 0
    assert torch.isfinite(padded).all()


def test_an_empty_prompt_trains_the_response_after_its_first_token():
    """Position j predicts token j + 1: with no prompt, nothing predicts the first response
    token (this used to be a tensor-size error)."""
    from mizzen_rollout.api import Sample
    from mizzen_train.rl.rows import tokenise_rows

    sample = Sample(
        prompt="", prompt_tokens=[], response_tokens=[5, 6, 7], loss_mask=[1, 0, 1],
        rollout_logprobs=[-0.1, -0.2, -0.3],
    )  # fmt: skip
    rows = tokenise_rows(
        [("a", {"sample": sample, "advantage": 0.5, "usable": True})],
        slot_of={"a": 0}, width=4, pad_id=0, stats={"a": {}},
    )  # fmt: skip
    batch = rows.batch
    assert batch.input_ids[0, :2].tolist() == [5, 6]
    assert batch.target_ids[0, :2].tolist() == [6, 7]
    assert batch.segment_ids[0].tolist() == [0, 0, -1, -1]
    assert batch.loss_mask[0].tolist() == [False, True, False, False]  # targets 6 (mask 0), 7 (1)
    assert batch.advantages[0].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert rows.engine_logprobs[0, :2].tolist() == pytest.approx([-0.2, -0.3])
    assert rows.engine_known[0].tolist() == [True, True, False, False]
