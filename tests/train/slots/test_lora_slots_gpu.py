"""GPU: two slots train in bf16 through megatron's real forward-backward schedule, with each
slot's gradients in its own megatron DistributedDataParallel; one slot's NaN leaves the other
bitwise unchanged; unloading gives every byte back; ``forward_backward_logprobs`` returns the
log-probs of the schedule's own forward."""

from __future__ import annotations

import torch

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=30,
    hardware=["hopper"],
    num_gpus=1,
    labels=["lora", "train", "megatron"],
    shares_gpu=True,
)

GPU_GPT = dict(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=256, dtype="bf16")


def _executor(kit):
    from mizzen_train.gpt import GPTSpec

    spec = GPTSpec(max_sequence_length=64, **GPU_GPT)
    return kit.tiny_executor(num_slots=2, max_rank=8, micro_batch_size=2, gpt=spec, device="cuda")


def _batch(kit, row_slots, seed, **kwargs):
    return kit.tiny_batch(
        row_slots, seq_len=32, vocab_size=GPU_GPT["vocab_size"], seed=seed, **kwargs
    )


def test_two_slots_learn_through_megatron_schedule_and_ddp(kit, nccl_rank, monkeypatch):
    import megatron.core.pipeline_parallel as pipeline_parallel
    from megatron.core.distributed import DistributedDataParallel

    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.memory import settled_allocated_bytes
    from mizzen_train.specs import AdamParams

    schedule_calls = []
    real_get = pipeline_parallel.get_forward_backward_func

    def counting_get(*args, **kwargs):
        schedule_calls.append(1)
        return real_get(*args, **kwargs)

    monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func", counting_get)

    executor = _executor(kit)
    executor.load_slot(0, 8, 16.0, seed=1)
    executor.load_slot(1, 4, 8.0, seed=2)
    record = executor._slots[0]
    assert isinstance(record.grad_sync, DistributedDataParallel)
    param = record.adapter.parameters_in_order()[0]
    assert (
        param.is_cuda and param.dtype is torch.bfloat16 and param.main_grad.dtype is torch.float32
    )
    del record, param  # hold no reference to slot memory across unload

    batch = _batch(kit, [0, 0, 0, 0, 1, 1, 1, 1], seed=0)  # 4 micro-batches of 2 rows
    adam = {0: AdamParams(lr=1e-2), 1: AdamParams(lr=1e-2, weight_decay=0.01)}
    history = {0: [], 1: []}
    for _ in range(30):
        reports = executor.forward_backward(batch, CrossEntropyLoss())
        steps = executor.optim_step(adam)
        for slot in (0, 1):
            history[slot].append(reports[slot].loss)
            assert steps[slot].stepped, steps[slot]
    assert len(schedule_calls) == 30, "forward_backward did not use megatron's schedule"
    for slot, losses in history.items():
        assert all(torch.isfinite(torch.tensor(losses))), losses
        # the frozen random output layer bounds the reachable loss near 4 (from ln 256 = 5.5)
        assert losses[-1] < 0.85 * losses[0], f"slot {slot} did not learn: {losses}"

    # unload gives every byte back (caches such as the attention mask exist from the first round)
    executor.unload_slot(0)
    executor.unload_slot(1)
    baseline = settled_allocated_bytes()
    executor.load_slot(0, 8, 16.0)
    executor.load_slot(1, 8, 16.0)
    loaded = settled_allocated_bytes()
    executor.forward_backward(batch, CrossEntropyLoss())
    executor.optim_step(adam)
    per_param = (loaded - baseline) / (2 * executor.trainable_parameters_per_slot())
    assert 17.9 < per_param <= 18.1, f"{per_param:.3f} bytes per trainable parameter per slot"
    executor.unload_slot(0)
    executor.unload_slot(1)
    after = settled_allocated_bytes(expected=baseline)
    assert after == baseline, f"{after - baseline} bytes still allocated after unloading"


def test_fused_logprobs_come_through_megatron_schedule(kit, nccl_rank):
    """``forward_backward_logprobs`` on CUDA: the log-probs megatron's schedule hands back from
    the loss are the separate forward's within bf16 rounding (a forward recording gradients may
    take other kernels), in batch order, the base-only micro-batch included."""
    from mizzen_train.losses import CrossEntropyLoss

    executor = _executor(kit)
    executor.load_slot(0, 8, 16.0, seed=1)
    executor.load_slot(1, 4, 8.0, seed=2)
    batch = _batch(kit, [0, 0, 0, 1, 1, 1, -1, -1], seed=3)  # the last micro-batch trains nothing
    separate = executor.forward_logprobs(batch)
    reports, fused = executor.forward_backward_logprobs(batch, CrossEntropyLoss())
    assert sorted(reports) == [0, 1] and fused.shape == separate.shape == (8, 32)
    assert fused.device.type == "cpu" and fused.dtype is torch.float32
    assert fused[6:].abs().min() > 0, "the base-only micro-batch was not computed"
    torch.testing.assert_close(fused, separate, rtol=0, atol=3e-2)
    # the rows are not interchangeable: a misplaced micro-batch would not pass the line above
    assert (separate[:2] - separate[4:6]).abs().max() > 0.1


def _poison_run(kit, poison: bool) -> dict:
    from mizzen_train.losses import ClippedPolicyGradientLoss
    from mizzen_train.specs import AdamParams

    executor = _executor(kit)
    for slot in (0, 1):
        executor.load_slot(slot, 8, 16.0, weights=kit.random_adapter(executor, 8, seed=slot))
    adam = {0: AdamParams(lr=1e-2), 1: AdamParams(lr=1e-2)}
    reports = None
    for step in range(3):
        # rows [0, 0, 1, 1] + a micro-batch mixing slot 0 and slot 1
        batch = _batch(kit, [0, 0, 0, 1, 1, 1], seed=step, with_policy_fields=True)
        if poison and step == 2:
            advantages = batch.advantages.clone()
            advantages[3, 7] = float("nan")  # slot 1's row in the mixed micro-batch
            batch = type(batch)(**{**batch.token_fields(), "advantages": advantages})
        before = executor.inspect_slot(1)
        executor.forward_backward(batch, ClippedPolicyGradientLoss())
        reports = executor.optim_step(adam)
    result = {
        "reports": {s: (r.stepped, r.skipped_nonfinite) for s, r in reports.items()},
        "slot0": executor.inspect_slot(0),
        "slot1": executor.inspect_slot(1),
        "slot1_before": before,
        "failed": executor.failed,
    }
    for slot in (0, 1):
        executor.unload_slot(slot)
    return result


def test_nan_in_one_slot_leaves_the_other_untouched(kit, nccl_rank):
    clean = _poison_run(kit, poison=False)
    poisoned = _poison_run(kit, poison=True)
    assert clean["reports"] == {0: (True, False), 1: (True, False)}
    assert poisoned["reports"] == {0: (True, False), 1: (False, True)}
    assert poisoned["failed"] is None
    for entry in ("weight", "master", "exp_avg", "exp_avg_sq"):
        for name, tensor in clean["slot0"][entry].items():
            other = poisoned["slot0"][entry][name]
            assert torch.equal(tensor, other), (
                f"slot 0 {entry} {name} differs: max |diff| {(tensor - other).abs().max()}"
            )
        for name, tensor in poisoned["slot1_before"][entry].items():
            assert torch.equal(tensor, poisoned["slot1"][entry][name]), f"slot 1 {entry} {name}"
    for name, grad in poisoned["slot1"]["grad"].items():
        assert torch.count_nonzero(grad) == 0, f"slot 1 grad {name} not discarded"
