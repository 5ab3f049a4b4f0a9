"""Slotted LoRA is exact: per-layer against a dense fp64 reference, on a GPT against merged
weights, and the same at TP=2 as at TP=1 (losses, gradients, stepped weights)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["lora", "megatron", "distributed"])


# slot ids per row ([b, s] with s = 5; the layer sees them row-major as one stream) and the
# routing kind they must take
LAYER_CASES = {
    # a row ending in base-only tokens, and a base-only row
    "runs_with_base_tokens": ([[0] * 5, [1, 1, 1, -1, -1], [-1] * 5], "runs"),
    # slot 1 in two runs (its gradients summed over both), a base-only row between them
    "runs_not_contiguous": ([[1] * 5, [0] * 5, [-1] * 5, [1] * 5], "runs"),
    # one run per slot, in slot order
    "runs_in_slot_order": ([[0] * 5, [0] * 5, [1] * 5, [1] * 5], "runs"),
    # one slot in a run after base-only tokens
    "one_slot_after_base_tokens": ([[-1, -1, 0, 0, 0], [0] * 5], "runs"),
    # one slot, every token
    "single": ([[0] * 5, [0] * 5], "single"),
}


def _layer_scenario(
    slot_rows: list[list[int]], kind: str, small: int = 24, large: int = 40
) -> dict[str, float]:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from mizzen_train.lora import SlottedLoRALinear, _grouped_gemms_apply
    from mizzen_train.routing import RoutingState, build_routing

    torch.manual_seed(0)
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)
    bases = {
        "column": ColumnParallelLinear(
            small, large, config=config, init_method=torch.nn.init.normal_, bias=True
        ),
        "row": RowParallelLinear(
            large,
            small,
            config=config,
            init_method=torch.nn.init.normal_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=True,
        ),
    }
    max_rank, ranks, scales = 6, {0: 3, 1: 6}, {0: 2.0, 1: 0.5}
    slot_ids = torch.tensor(slot_rows)
    rows = slot_ids.shape[0]
    errors = {}
    for mode, base in bases.items():
        routing_state = RoutingState()
        layer = SlottedLoRALinear(base, key=mode, max_rank=max_rank, routing=routing_state)
        factors = {}
        for slot, rank in ranks.items():
            lora_a = torch.zeros(layer.a_local_shape)
            lora_b = torch.zeros(layer.b_local_shape)
            lora_a[:rank] = torch.randn(rank, lora_a.shape[1])
            lora_b[:, :rank] = torch.randn(lora_b.shape[0], rank)
            factors[slot] = (torch.nn.Parameter(lora_a), torch.nn.Parameter(lora_b))
            layer.attach(slot, *factors[slot])
        # the packed stream as megatron holds it: [tokens, 1, in], the rows end to end
        x = torch.randn(rows * 5, 1, layer.a_local_shape[1], requires_grad=True)
        routing = build_routing(slot_ids, scales, dtype=torch.float32, device=torch.device("cpu"))
        assert routing.kind == kind, (routing.kind, kind)
        with routing_state.use(routing):
            out, bias = layer(x)
        errors[f"{mode}.grouped_gemms"] = float(
            _grouped_gemms_apply(x, out) != (small * 4 % 16 == 0 and large * 4 % 16 == 0)
        )
        if bias is not None:
            out = out + bias
        grad_out = torch.randn_like(out)
        out.backward(grad_out)

        # dense per-token reference in fp64
        x64 = x.detach().double().requires_grad_(True)
        ref_factors = {
            s: tuple(p.detach().double().requires_grad_(True) for p in f)
            for s, f in factors.items()
        }
        weight = base.weight.detach().double()
        ref = torch.einsum("tbi,oi->tbo", x64, weight) + base.bias.detach().double()
        deltas = torch.zeros_like(ref)
        for token, slot in enumerate(slot_ids.reshape(-1).tolist()):
            if slot < 0:
                continue
            lora_a, lora_b = ref_factors[slot]
            deltas[token, 0] = scales[slot] * (lora_b @ (lora_a @ x64[token, 0]))
        ref = ref + deltas
        ref.backward(grad_out.double())
        errors[f"{mode}.out"] = (out.double() - ref).abs().max().item()
        errors[f"{mode}.grad_x"] = (x.grad.double() - x64.grad).abs().max().item()
        for slot, (lora_a, lora_b) in factors.items():
            if slot not in slot_ids:  # an attached slot the batch does not use: no gradient
                errors[f"{mode}.unused{slot}"] = float(lora_a.grad is not None) + float(
                    lora_b.grad is not None
                )
                continue
            ref_a, ref_b = ref_factors[slot]
            errors[f"{mode}.grad_A{slot}"] = (lora_a.grad.double() - ref_a.grad).abs().max().item()
            errors[f"{mode}.grad_B{slot}"] = (lora_b.grad.double() - ref_b.grad).abs().max().item()
            # padding rows/columns beyond the slot's rank receive exactly zero gradient
            rank = ranks[slot]
            errors[f"{mode}.pad_grad{slot}"] = float(
                lora_a.grad[rank:].abs().sum() + lora_b.grad[:, rank:].abs().sum()
            )
    return errors


def test_routing_cuts_the_stream_into_runs_of_one_slot():
    from mizzen_train.routing import TokenRun, build_routing

    slot_ids = torch.tensor([[3, 3, -1], [1, 1, 3]])  # slots 1 and 3: blocks 0 and 1
    routing = build_routing(slot_ids, {1: 0.5, 3: 2.0}, dtype=torch.float32, device="cpu")
    assert routing.kind == "runs" and routing.slots == (1, 3)
    assert routing.runs == (
        TokenRun(0, 2, 1), TokenRun(2, 3, -1), TokenRun(3, 5, 0), TokenRun(5, 6, 1)
    )  # fmt: skip
    assert routing.block_runs(1) == (TokenRun(0, 2, 1), TokenRun(5, 6, 1))
    assert routing.token_scales.view(-1).tolist() == [2.0, 2.0, 0.0, 0.5, 0.5, 2.0]
    assert build_routing(torch.full((2, 3), -1), {}, dtype=torch.float32, device="cpu") is None
    single = build_routing(torch.full((2, 3), 3), {3: 2.0}, dtype=torch.float32, device="cpu")
    assert single.kind == "single" and single.runs is None


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_slotted_layers_match_dense_reference(kit, case):
    """Aligned widths take the grouped GEMMs (runs kind), odd ones one GEMM per run."""
    (errors,) = kit.run_ranks(_layer_scenario, args=LAYER_CASES[case])
    assert errors, "scenario produced no comparisons"
    for name, error in errors.items():
        assert error < 1e-4, f"{name}: max error {error}"
    (errors,) = kit.run_ranks(_layer_scenario, args=(*LAYER_CASES[case], 21, 35))
    assert errors, "scenario produced no comparisons"
    for name, error in errors.items():
        assert error < 1e-4, f"{name}: max error {error}"
        if "pad_grad" in name or "unused" in name:
            assert error == 0.0, f"{name}: padding or an unused slot got gradient {error}"


def _mixed_rows_scenario(kit, row_slots: list[int]) -> dict[str, float]:
    """Gradients of every slot of a mixed micro-batch (accumulated into megatron's main_grad
    by the runs path) against each slot's rows run alone (one row per micro-batch: the single
    path, ordinary autograd)."""
    import dataclasses

    from mizzen_train.losses import CrossEntropyLoss

    specs = {0: (4, 8.0, 21), 1: (8, 4.0, 22), 2: (6, 6.0, 23)}  # slot: (rank, alpha, seed)
    batch = kit.tiny_batch(row_slots, seed=9)

    def gradients(micro_batch_size: int, rows: list[int]) -> dict[int, dict]:
        executor = kit.tiny_executor(num_slots=3, max_rank=8, micro_batch_size=micro_batch_size)
        for slot, (rank, alpha, seed) in specs.items():
            weights = kit.random_adapter(executor, rank, seed=seed)
            executor.load_slot(slot, rank, alpha, weights=weights)
        part = dataclasses.replace(
            batch, **{name: value[rows] for name, value in batch.token_fields().items()}
        )
        executor.forward_backward(part, CrossEntropyLoss())
        return {slot: executor.inspect_slot(slot)["grad"] for slot in specs}

    mixed = gradients(len(row_slots), list(range(len(row_slots))))
    errors = {}
    for slot in specs:
        rows = [row for row, s in enumerate(row_slots) if s == slot]
        alone = gradients(1, rows)[slot]
        scale = max(g.abs().max().item() for g in alone.values())
        assert scale > 0, "the reference gradient is zero: the comparison would be vacuous"
        errors[f"slot{slot}"] = max(
            (mixed[slot][name] - alone[name]).abs().max().item() / scale for name in alone
        )
    return errors


@pytest.mark.parametrize(
    "row_slots",
    [[0, 0, 1, 1, 2, 2], [1, 0, 0, 2, 2, -1]],
    ids=["equal_runs", "unequal_runs_with_base_row"],
)
def test_mixed_micro_batch_gradients_equal_each_slot_alone(kit, row_slots):
    (errors,) = kit.run_ranks(_mixed_rows_scenario, args=(kit, row_slots))
    for name, error in errors.items():
        assert error < 1e-5, f"{name}: max relative gradient error {error}"


def _merged_reference_scenario(kit) -> dict[str, float]:
    from mizzen_train.gpt import build_gpt

    executor = kit.tiny_executor(num_slots=3, max_rank=8, micro_batch_size=2)
    specs = {0: (4, 8.0, 11), 2: (8, 4.0, 12)}  # slot: (rank, alpha, seed)
    adapters = {}
    for slot, (rank, alpha, seed) in specs.items():
        adapters[slot] = kit.random_adapter(executor, rank, seed=seed)
        executor.load_slot(slot, rank, alpha, weights=adapters[slot])
    batch = kit.tiny_batch([0, 0, 2, 2, -1, -1], seed=3)
    got = executor.forward_logprobs(batch)

    errors = {}
    for slot in (0, 2, -1):
        reference = build_gpt(kit.TINY_GPT, device="cpu")  # same seed: same base weights
        if slot >= 0:
            rank, alpha, _ = specs[slot]
            with torch.no_grad():
                for layer_key in executor.layers:
                    weight = reference.get_submodule(layer_key).weight
                    lora_a = adapters[slot][f"{layer_key}.lora_A"]
                    lora_b = adapters[slot][f"{layer_key}.lora_B"]
                    weight += (alpha / rank) * lora_b @ lora_a
        rows = [i for i, s in enumerate([0, 0, 2, 2, -1, -1]) if s == slot]
        ids = batch.input_ids[rows]
        seq = ids.shape[1]
        positions = torch.arange(seq).unsqueeze(0).expand(len(rows), -1)
        with torch.no_grad():  # rows without packed_seq_params: each row one causal sequence
            logits = reference(ids, positions, None)
        expected = torch.log_softmax(logits.double(), dim=-1)
        expected = expected.gather(-1, batch.target_ids[rows].unsqueeze(-1)).squeeze(-1)
        errors[f"slot{slot}"] = (got[rows].double() - expected).abs().max().item()
    # the adapters must actually matter for this comparison to mean anything
    errors["adapter_effect"] = -(got[0:2] - got[4:6]).abs().max().item()
    return errors


def test_gpt_logprobs_match_merged_dense_weights(kit):
    (errors,) = kit.run_ranks(_merged_reference_scenario, args=(kit,))
    assert errors.pop("adapter_effect") < -1e-3, "adapters changed nothing: test is vacuous"
    for name, error in errors.items():
        assert error < 2e-5, f"{name}: max |logprob - merged reference| = {error}"


def _train_scenario(kit, micro_batch_size: int) -> dict:
    from mizzen_train.losses import ClippedPolicyGradientLoss, CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    executor = kit.tiny_executor(num_slots=2, max_rank=8, micro_batch_size=micro_batch_size)
    executor.load_slot(0, 4, 8.0, weights=kit.random_adapter(executor, 4, seed=5))
    executor.load_slot(1, 8, 16.0, weights=kit.random_adapter(executor, 8, seed=6))
    batch = kit.tiny_batch([0, 0, 1, 1], seed=4, with_policy_fields=True)
    losses = {0: CrossEntropyLoss(), 1: ClippedPolicyGradientLoss(0.2, 0.3)}
    reports = executor.forward_backward(batch, losses)
    grads = {slot: executor.inspect_slot(slot)["grad"] for slot in (0, 1)}
    steps = executor.optim_step({0: AdamParams(lr=1e-2), 1: AdamParams(lr=3e-3, weight_decay=0.1)})
    return {
        "dims": kit.split_dims(executor),
        "losses": {slot: (r.loss, r.metrics) for slot, r in reports.items()},
        "norms": {slot: r.grad_norm for slot, r in steps.items()},
        "grads": grads,
        "weights": {slot: executor.inspect_slot(slot)["master"] for slot in (0, 1)},
        "logprobs": executor.forward_logprobs(batch),
    }


def test_dp2_equals_dp1(kit):
    """Two data-parallel replicas, each with one slot's rows: the reduced gradients step both
    replicas to the single-rank weights (the other replica's slot has no rows here)."""
    (single,) = kit.run_ranks(_train_scenario, args=(kit, 2))
    pair = kit.run_ranks(_train_scenario, world_size=2, tp=1, args=(kit, 2))
    for slot in (0, 1):
        for result in pair:
            assert abs(single["norms"][slot] - result["norms"][slot]) < 1e-5
            for name, reference in single["weights"][slot].items():
                weight = result["weights"][slot][name]
                assert torch.allclose(weight, reference, atol=1e-5, rtol=1e-4), f"{slot} {name}"
    for result in pair:
        assert torch.allclose(result["logprobs"], single["logprobs"], atol=1e-5)


# micro-batches of 2 rows hold one slot each (the single path); of 4, both slots (the runs path)
@pytest.mark.parametrize("micro_batch_size", [2, 4], ids=["one_slot_per_micro_batch", "mixed"])
def test_tp2_equals_tp1(kit, micro_batch_size):
    (single,) = kit.run_ranks(_train_scenario, args=(kit, micro_batch_size))
    pair = kit.run_ranks(_train_scenario, world_size=2, tp=2, args=(kit, micro_batch_size))
    dims = single["dims"]
    assert {d for d in dims.values()} == {None, 0, 1}, "expected replicated and both split axes"
    for slot in (0, 1):
        loss_1, metrics_1 = single["losses"][slot]
        for result in pair:
            loss_2, metrics_2 = result["losses"][slot]
            assert abs(loss_1 - loss_2) < 1e-5
            for name, value in metrics_1.items():
                assert abs(value - metrics_2[name]) < 1e-5, name
            assert abs(single["norms"][slot] - result["norms"][slot]) < 1e-5
        for entry in ("grads", "weights"):
            joined = kit.join_tp_shards([r[entry][slot] for r in pair], dims)
            for name, full in joined.items():
                reference = single[entry][slot][name]
                assert full.shape == reference.shape, name
                assert torch.allclose(full, reference, atol=1e-5, rtol=1e-4), f"{entry} {name}"
        assert single["grads"][slot]["decoder.layers.0.mlp.linear_fc1.lora_B"].abs().sum() > 0
    for result in pair:
        assert torch.allclose(result["logprobs"], single["logprobs"], atol=1e-5)


def test_a_stream_its_routing_does_not_cover_is_refused_naming_the_layer():
    from mizzen_train.lora import SlottedLoRALinear
    from mizzen_train.routing import RoutingState, build_routing

    state = RoutingState()
    layer = SlottedLoRALinear(torch.nn.Linear(16, 16), key="proj", max_rank=8, routing=state)
    for slot in (0, 1):
        layer.attach(
            slot, torch.nn.Parameter(torch.zeros(8, 16)), torch.nn.Parameter(torch.zeros(16, 8))
        )
    routing = build_routing(
        torch.tensor([0, 0, 1, 1, 1]), {0: 1.0, 1: 1.0}, dtype=torch.float32, device="cpu"
    )
    with state.use(routing), pytest.raises(ValueError, match="proj: the routing covers 5 stream"):
        layer(torch.randn(3, 16))


@given(
    token_slots=st.lists(st.integers(-1, 3), min_size=1, max_size=64),
    scales=st.lists(st.floats(0.125, 8.0), min_size=4, max_size=4),
)
@settings(max_examples=200, deadline=None)
def test_routing_runs_cover_any_stream_once_each_of_one_slot(token_slots, scales):
    """Whatever the per-token slots: the runs tile the stream in order, each maximal and of one
    slot, the token scales are each token's slot's (0 for base-only), the offsets are the runs'
    stops -- or no routing when no token has a slot, the single kind when one slot has all."""
    from mizzen_train.routing import build_routing

    by_slot = {slot: scales[slot] for slot in range(4)}
    routing = build_routing(torch.tensor(token_slots), by_slot, dtype=torch.float32, device="cpu")
    present = sorted({s for s in token_slots if s >= 0})
    if not present:
        assert routing is None
        return
    assert routing.slots == tuple(present)
    if len(present) == 1 and min(token_slots) >= 0:
        assert routing.kind == "single"
        return
    runs = routing.runs
    assert runs[0].start == 0 and runs[-1].stop == len(token_slots)
    for before, after in itertools.pairwise(runs):
        assert before.stop == after.start and before.block != after.block
    for run in runs:
        slot = routing.slots[run.block] if run.block >= 0 else -1
        assert run.stop > run.start and set(token_slots[run.start : run.stop]) == {slot}
    expected = [by_slot[s] if s >= 0 else 0.0 for s in token_slots]
    assert routing.token_scales.view(-1).tolist() == pytest.approx(expected)
    assert routing.run_stops.tolist() == [run.stop for run in runs]
