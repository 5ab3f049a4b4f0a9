"""Registration-time validation fails fast and names the field; request errors leave the executor
usable, while an unexpected failure part-way marks it failed until it is rebuilt."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mizzen_ci import register_cpu_ci
from mizzen_train.batch import SlotBatch
from mizzen_train.errors import SlotConfigError
from mizzen_train.losses import ClippedPolicyGradientLoss, CrossEntropyLoss
from mizzen_train.specs import AdamParams, ExecutorConfig, LoraSlotSpec
from mizzen_train.validation import (
    check_adam_requests,
    check_batch,
    check_executor_config,
    check_model_config,
    check_slot_request,
    resolve_losses,
)

register_cpu_ci(est_time=15, labels=["lora", "train"])


def _field(call) -> str:
    with pytest.raises(SlotConfigError) as info:
        call()
    error = info.value
    assert error.field in str(error) and "Fix:" in str(error)
    return error.field


@pytest.mark.parametrize(
    ("slot", "spec", "field"),
    [
        (5, LoraSlotSpec(4, 8.0), "slot"),
        (-1, LoraSlotSpec(4, 8.0), "slot"),
        (1, LoraSlotSpec(4, 8.0), "slot"),  # in use
        (0, LoraSlotSpec(9, 8.0), "rank"),
        (0, LoraSlotSpec(0, 8.0), "rank"),
        (0, LoraSlotSpec(4, 0.0), "alpha"),
        (0, LoraSlotSpec(4, float("nan")), "alpha"),
        (0, LoraSlotSpec(4, 8.0, init="orthogonal"), "init"),
        (0, LoraSlotSpec(4, 8.0, seed=-3), "seed"),
    ],
)
def test_slot_request_rules(slot, spec, field):
    def call():
        check_slot_request(slot, spec, num_slots=4, max_rank=8, loaded_slots={1})

    assert _field(call) == field


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (ExecutorConfig(num_slots=0, max_rank=8), "num_slots"),
        (ExecutorConfig(num_slots=2, max_rank=0), "max_rank"),
        (ExecutorConfig(num_slots=2, max_rank=8, micro_batch_size=0), "micro_batch_size"),
        (ExecutorConfig(num_slots=2, max_rank=8, target_modules=()), "target_modules"),
        (ExecutorConfig(2, 8, target_modules=("linear_qkv", "linear_qkv")), "target_modules"),
        (ExecutorConfig(2, 8, use_distributed_optimizer=True), "use_distributed_optimizer"),
        (ExecutorConfig(2, 8, overlap_grad_reduce=True), "overlap_grad_reduce"),
    ],
)
def test_executor_config_rules(config, field):
    assert _field(lambda: check_executor_config(config)) == field


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"fp16": True, "params_dtype": torch.float16}, "fp16"),
        ({"params_dtype": torch.float16}, "params_dtype"),
        ({"sequence_parallel": True}, "sequence_parallel"),
        ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size"),
        ({"context_parallel_size": 2}, "context_parallel_size"),
        ({"finalize_model_grads_func": print}, "finalize_model_grads_func"),
    ],
)
def test_model_config_rules(overrides, field):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=1)
    for name, value in overrides.items():  # set after construction: only our rule is tested
        setattr(config, name, value)
    assert _field(lambda: check_model_config(config)) == field


def _batch(row_slots, *, seq=6, **changes) -> SlotBatch:
    rows = len(row_slots)
    fields = {
        "input_ids": torch.zeros(rows, seq, dtype=torch.long),
        "target_ids": torch.ones(rows, seq, dtype=torch.long),
        "loss_mask": torch.ones(rows, seq, dtype=torch.bool),
        "slot_ids": torch.tensor(row_slots).unsqueeze(1).repeat(1, seq),
    }
    fields.update(changes)
    return SlotBatch(**fields)


def _check(batch, *, dp_size=1, micro_batch_size=1, loaded=(0, 1, 2)):
    return check_batch(
        batch,
        dp_size=dp_size,
        micro_batch_size=micro_batch_size,
        num_slots=3,
        loaded_slots=loaded,
        vocab_size=16,
        max_sequence_length=8,
    )


def test_batch_rules_accept_a_valid_batch_and_name_the_field_otherwise():
    mixed_row = torch.tensor([[0, 0, -1, -1, -1, -1], [1, 1, 1, 2, 2, 2]])
    assert _check(_batch([0, 0, 1, -1])) == [0, 0, 1, -1]
    assert _check(_batch([0, 1]), dp_size=2) == [0, 1]
    cases = {
        "batch.rows": [
            lambda: _check(_batch([0, 0, 1]), dp_size=2),
            lambda: _check(_batch([0, 0, 1, 1]), dp_size=2, micro_batch_size=4),
        ],
        "batch.slot_ids": [
            lambda: _check(_batch([0, 1], slot_ids=mixed_row)),  # two slots in one row
            lambda: _check(_batch([0, 1, 0])),  # not slot-contiguous
            lambda: _check(_batch([0, 1]), loaded=(0,)),  # slot 1 not loaded
            lambda: _check(_batch([0, 3])),  # out of range
        ],
        "batch.seq_len": [lambda: _check(_batch([0], seq=9))],
        "batch.input_ids": [
            lambda: _check(_batch([0], input_ids=torch.full((1, 6), 16))),
            lambda: _check(_batch([0], input_ids=torch.zeros(1, 6))),
        ],
        "batch.loss_mask": [lambda: _check(_batch([0], loss_mask=torch.ones(1, 5)))],
        "batch": [lambda: _check({"input_ids": torch.zeros(1, 2)})],
    }
    for field, calls in cases.items():
        for call in calls:
            assert _field(call) == field


def test_adam_request_rules():
    cases = [
        ({0: AdamParams(lr=0.0)}, "adam_params[0].lr"),
        ({0: AdamParams(lr=1e-3, betas=(1.0, 0.9))}, "adam_params[0].betas"),
        ({0: AdamParams(lr=1e-3, eps=0.0)}, "adam_params[0].eps"),
        ({0: AdamParams(lr=1e-3, weight_decay=-0.1)}, "adam_params[0].weight_decay"),
        ({0: AdamParams(lr=1e-3, max_grad_norm=0.0)}, "adam_params[0].max_grad_norm"),
        ({1: AdamParams(lr=1e-3)}, "adam_params[1]"),  # not loaded
        ({0: {"lr": 1e-3}}, "adam_params[0]"),
    ]
    for requests, field in cases:
        call = lambda r=requests: check_adam_requests(r, num_slots=2, loaded_slots={0})  # noqa: E731
        assert _field(call) == field


def test_loss_rules():
    batch = _batch([0, 1])
    assert resolve_losses(CrossEntropyLoss(), [0, 1], batch) == {
        0: CrossEntropyLoss(),
        1: CrossEntropyLoss(),
    }
    cases = [
        (ClippedPolicyGradientLoss(), "batch.old_logprobs"),
        ({0: CrossEntropyLoss()}, "loss_fn"),
        ({0: CrossEntropyLoss(), 1: "ppo"}, "loss_fn[1]"),
        (
            {0: CrossEntropyLoss(), 1: ClippedPolicyGradientLoss(clip_low=1.5)},
            "loss_fn[1].clip_low",
        ),
        (torch.nn.functional.cross_entropy, "loss_fn"),
    ]
    for loss_fn, field in cases:
        assert _field(lambda f=loss_fn: resolve_losses(f, [0, 1], batch)) == field


def _executor_scenario(kit) -> dict:
    from mizzen_train.errors import ExecutorFailedError

    fields = {}

    def field_of(call):
        try:
            call()
        except SlotConfigError as exc:
            return exc.field, str(exc)
        return None, "accepted"

    fields["target"] = field_of(lambda: kit.tiny_executor(target_modules=["q_proj"]))
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from mizzen_train.executor import SlotExecutor
    from mizzen_train.gpt import build_gpt
    from mizzen_train.specs import ExecutorConfig

    model = build_gpt(kit.TINY_GPT, device="cpu")
    config = ExecutorConfig(2, 8, target_modules=("linear_qkv", "embedding"))
    fields["not_slottable"] = field_of(lambda: SlotExecutor(model, config))
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    fields["model_untouched"] = type(qkv) is ColumnParallelLinear and all(
        p.requires_grad for p in model.parameters()
    )
    executor = kit.tiny_executor(num_slots=2, max_rank=8)
    executor.load_slot(0, 4, 8.0)
    fields["rank"] = field_of(lambda: executor.load_slot(1, 16, 8.0))
    fields["in_use"] = field_of(lambda: executor.load_slot(0, 4, 8.0))
    fields["unload"] = field_of(lambda: executor.unload_slot(1))
    bad = kit.random_adapter(executor, 4, seed=0)
    bad["decoder.layers.0.self_attention.linear_qkv.lora_A"] = torch.zeros(4, 65)
    fields["weights"] = field_of(lambda: executor.load_slot(1, 4, 8.0, weights=bad))
    fields["batch"] = field_of(
        lambda: executor.forward_backward(kit.tiny_batch([0, 1]), CrossEntropyLoss())
    )
    fields["usable_after_request_errors"] = executor.failed
    assert executor.loaded_slots == (0,)

    executor.forward_backward(kit.tiny_batch([0, 0]), CrossEntropyLoss())

    def broken(*args, **kwargs):
        raise RuntimeError("device lost (injected)")

    executor._slots[0].optimizer.publish = broken  # fault injection inside a step
    with contextlib.suppress(RuntimeError):
        executor.optim_step({0: AdamParams(lr=1e-3)})
    fields["failed"] = executor.failed
    try:
        executor.forward_backward(kit.tiny_batch([0, 0]), CrossEntropyLoss())
        fields["refused"] = "accepted"
    except ExecutorFailedError as exc:
        fields["refused"] = str(exc)
    return fields


def test_executor_registration_errors_and_failure_policy(kit):
    (fields,) = kit.run_ranks(_executor_scenario, args=(kit,))
    field, message = fields["target"]
    assert field == "target_modules" and "linear_fc1" in message  # lists the valid choices
    field, message = fields["not_slottable"]
    assert field == "target_modules" and "LanguageModelEmbedding is not a megatron-core" in message
    assert fields["model_untouched"], "a refused construction must leave the model as it was"
    assert fields["rank"][0] == "rank" and "max_rank=8" in fields["rank"][1]
    assert fields["in_use"][0] == "slot"
    assert fields["unload"][0] == "slot"
    assert fields["weights"][0] == "weights['decoder.layers.0.self_attention.linear_qkv.lora_A']"
    assert fields["batch"][0] == "batch.slot_ids"  # slot 1 is not loaded
    assert fields["usable_after_request_errors"] is None
    assert "optim_step: RuntimeError: device lost (injected)" in fields["failed"]
    assert "forward_backward refused" in fields["refused"] and "restore_slot" in fields["refused"]
