"""No tenant can hurt another: a NaN in one slot, a load or an unload of one slot leaves every
other slot bitwise unchanged, and every rank takes the same skip decision."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=40, labels=["lora", "train", "distributed"])

# DP=2, micro-batches of 3 rows: rank 0 runs one micro-batch holding both slots, rank 1 only
# slot 1's rows.  With ``base_tokens`` row 1 (slot 0) ends in base-only tokens, so the routing
# has a base-only run too.
ROWS = [0, 0, 1, 1, 1, 1]


def _batch(kit, step: int, base_tokens: bool):
    batch = kit.tiny_batch(ROWS, seed=step, with_policy_fields=True)
    if not base_tokens:
        return batch
    slot_ids = batch.slot_ids.clone()
    slot_ids[1, slot_ids.shape[1] // 2 :] = -1
    return type(batch)(**{**batch.token_fields(), "slot_ids": slot_ids})


def _run(kit, poison_slot1: bool, base_tokens: bool) -> dict:
    from mizzen_train.losses import ClippedPolicyGradientLoss
    from mizzen_train.specs import AdamParams

    executor = kit.tiny_executor(num_slots=2, max_rank=8, micro_batch_size=3)
    for slot in (0, 1):
        weights = kit.random_adapter(executor, 4, seed=20 + slot)
        executor.load_slot(slot, 4, 8.0, weights=weights)
    adam = {0: AdamParams(lr=1e-2, weight_decay=0.01), 1: AdamParams(lr=1e-2)}
    history = []
    for step in range(3):
        batch = _batch(kit, step, base_tokens)
        if poison_slot1 and step == 2:
            advantages = batch.advantages.clone()
            advantages[2, 5] = float("nan")  # one token of the slot-1 row on DP rank 0
            batch = type(batch)(**{**batch.token_fields(), "advantages": advantages})
        before = executor.inspect_slot(1)
        executor.forward_backward(batch, ClippedPolicyGradientLoss())
        reports = executor.optim_step(adam)
        history.append(
            {slot: (r.stepped, r.skipped_nonfinite, r.step) for slot, r in reports.items()}
        )
    return {
        "history": history,
        "slot0": executor.inspect_slot(0),
        "slot1": executor.inspect_slot(1),
        "slot1_before_last": before,
        "failed": executor.failed,
    }


def _nan_scenario(kit, base_tokens: bool) -> dict:
    from mizzen_train.routing import build_routing

    rows = _batch(kit, 0, base_tokens).slot_ids[:3]  # rank 0's micro-batch
    routing = build_routing(rows, {0: 1.0, 1: 1.0}, dtype=torch.float32, device="cpu")
    return {
        "has_base_only_run": any(run.block < 0 for run in routing.runs),
        "clean": _run(kit, poison_slot1=False, base_tokens=base_tokens),
        "poisoned": _run(kit, poison_slot1=True, base_tokens=base_tokens),
    }


@pytest.mark.parametrize("base_tokens", [False, True], ids=["slot_rows", "base_tokens_in_row"])
def test_nan_in_one_slot_leaves_the_other_bitwise_unchanged(kit, base_tokens):
    results = kit.run_ranks(_nan_scenario, world_size=2, args=(kit, base_tokens))  # DP=2
    assert results[0]["has_base_only_run"] == base_tokens
    for rank, result in enumerate(results):
        clean, poisoned = result["clean"], result["poisoned"]
        assert poisoned["failed"] is None, "a non-finite gradient must not fail the executor"
        # the last step: slot 0 stepped, slot 1 (poisoned on DP rank 1 only) skipped everywhere
        assert poisoned["history"][2][0] == (True, False, 3)
        assert poisoned["history"][2][1] == (False, True, 2), f"rank {rank}"
        assert clean["history"][2][1] == (True, False, 3)
        for entry in ("weight", "master", "exp_avg", "exp_avg_sq", "grad"):
            for name, tensor in clean["slot0"][entry].items():
                assert torch.equal(tensor, poisoned["slot0"][entry][name]), f"slot0 {entry} {name}"
        # the skipped slot: weights, masters and moments as before the step; grads discarded
        for entry in ("weight", "master", "exp_avg", "exp_avg_sq"):
            for name, tensor in poisoned["slot1_before_last"][entry].items():
                assert torch.equal(tensor, poisoned["slot1"][entry][name]), f"slot1 {entry} {name}"
        for name, grad in poisoned["slot1"]["grad"].items():
            assert torch.count_nonzero(grad) == 0, f"slot 1 grad {name} not zeroed"


def _skip_decision_scenario(kit, poison_rank: int, replicated: bool) -> dict:
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    executor = kit.tiny_executor(num_slots=2, max_rank=8, micro_batch_size=2)
    for slot in (0, 1):
        executor.load_slot(slot, 4, 8.0, weights=kit.random_adapter(executor, 4, seed=slot))
    executor.forward_backward(kit.tiny_batch([0, 0, 1, 1]), CrossEntropyLoss())
    rank = torch.distributed.get_rank()
    if rank == poison_rank:
        # Fault injection on ONE rank, into slot 1 only, so the other rank's local gradients are
        # all finite: either a TP-split factor, or a TP-replicated one (whose copy on TP rank 1
        # the global norm does not count, yet must not step on a non-finite value).
        optimizer = executor._slots[1].optimizer
        chosen = [p for p in optimizer.params if p.tensor_model_parallel != replicated]
        chosen[0].main_grad.view(-1)[0] = float("inf")
    reports = executor.optim_step({0: AdamParams(lr=1e-3), 1: AdamParams(lr=1e-3)})
    return {slot: (r.stepped, r.skipped_nonfinite, r.grad_norm) for slot, r in reports.items()}


def test_same_skip_decision_on_both_ranks(kit):
    for poison_rank, replicated in ((0, False), (1, False), (1, True)):
        results = kit.run_ranks(
            _skip_decision_scenario, world_size=2, tp=2, args=(kit, poison_rank, replicated)
        )
        for result in results:
            stepped, skipped, norm = result[1]
            assert (stepped, skipped) == (False, True) and not math.isfinite(norm)
            stepped, skipped, norm = result[0]
            assert (stepped, skipped) == (True, False) and math.isfinite(norm)
        # the global norm is the same value on every rank, bit for bit
        assert results[0][0][2] == results[1][0][2]


def _load_unload_scenario(kit) -> dict:
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    executor = kit.tiny_executor(num_slots=3, max_rank=8, micro_batch_size=2)
    for slot in (0, 1, 2):
        executor.load_slot(slot, 4, 8.0, weights=kit.random_adapter(executor, 4, seed=slot))
    executor.forward_backward(kit.tiny_batch([0, 0, 1, 1, 2, 2], seed=1), CrossEntropyLoss())
    executor.optim_step({0: AdamParams(lr=1e-2)})  # slot 0 has moments; 1 and 2 pending grads
    executor.forward_backward(kit.tiny_batch([0, 0, 2, 2], seed=2), CrossEntropyLoss())
    others = {slot: executor.inspect_slot(slot) for slot in (0, 2)}
    assert others[2]["grad"]["decoder.layers.1.mlp.linear_fc2.lora_A"].abs().sum() > 0

    record = executor._slots[1]
    slot1_memory = [weakref.ref(p) for p in record.adapter.parameters_in_order()]
    slot1_memory += [weakref.ref(record.grad_sync), weakref.ref(record.adapter.storage)]
    slot1_memory += [weakref.ref(buffer.grad_data) for buffer in record.grad_sync.buffers]
    slot1_memory += [weakref.ref(record.optimizer.exp_avg_storage)]
    del record
    executor.unload_slot(1)
    freed = all(ref() is None for ref in slot1_memory)
    after_unload = {slot: executor.inspect_slot(slot) for slot in (0, 2)}
    executor.load_slot(1, 8, 2.0, init="gaussian", seed=9)
    executor.forward_backward(kit.tiny_batch([1, 1, 1, 1], seed=3), CrossEntropyLoss())
    executor.optim_step({1: AdamParams(lr=1e-2)})
    after_reload = {slot: executor.inspect_slot(slot) for slot in (0, 2)}
    gc.collect()
    return {"others": others, "unload": after_unload, "reload": after_reload, "freed": freed}


def test_load_and_unload_leave_other_slots_untouched(kit):
    for result in kit.run_ranks(_load_unload_scenario, world_size=2, tp=2, args=(kit,)):
        assert result["freed"], "unload_slot left slot memory alive (params, DDP, buffers, Adam)"
        for phase in ("unload", "reload"):
            for slot, state in result["others"].items():
                assert result[phase][slot]["step"] == state["step"]
                for entry in ("weight", "master", "exp_avg", "exp_avg_sq", "grad"):
                    for name, tensor in state[entry].items():
                        got = result[phase][slot][entry][name]
                        assert torch.equal(tensor, got), f"{phase}: slot {slot} {entry} {name}"
