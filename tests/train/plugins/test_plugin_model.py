"""Plugin models under the slot executor: PluginGPT's logits are the plugin model's own on the
sequences a dense mask or megatron's THD ``PackedSeqParams`` describe; LoRA wraps exactly the
plugin's target table (plain ``nn.Linear``), the base stays frozen bit for bit while adapters
train; slotted rows equal the merged model of their slot; megatron's GPT holds no plain linear
(its wrapping is unchanged); a deepseek_v4 policy-gradient step moves log-probs the right way."""

from __future__ import annotations

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=25, labels=["train", "lora", "plugins"])
pytestmark = pytest.mark.in_child  # its body's threads/world end with it

#: The LoRA target table, pinned: which linears of each plugin LoRA adapts.
TARGETS = {
    "nemotron_h": {"in_proj", "qkv_proj", "up_proj", "down_proj"},
    "deepseek_v4": {"wq_a", "wq_b", "wkv", "wo", "gate_proj", "up_proj", "down_proj"},
}
PLUGINS = tuple(TARGETS)


def executor_for(name, base, *, num_slots=2, micro_batch_size=4):
    from mizzen_train.executor import SlotExecutor
    from mizzen_train.plugin_models import import_plugin_model
    from mizzen_train.specs import ExecutorConfig

    imported = import_plugin_model(name, base)
    executor = SlotExecutor(
        imported.model,
        ExecutorConfig(
            num_slots=num_slots,
            max_rank=4,
            micro_batch_size=micro_batch_size,
            target_modules=imported.target_modules,
        ),
    )
    return imported, executor


def batch_of(row_slots, *, seq_len=24, seed=0):
    from mizzen_train.batch import SlotBatch

    g = torch.Generator().manual_seed(seed)
    rows = len(row_slots)
    input_ids = torch.randint(3, 259, (rows, seq_len), generator=g)
    target_ids = torch.empty_like(input_ids)
    for row, slot in enumerate(row_slots):  # a per-slot periodic pattern a LoRA can learn
        target_ids[row] = 40 + 7 * (slot + 2) + 5 * (torch.arange(seq_len) % 3)
    slot_ids = torch.tensor(row_slots).unsqueeze(1).expand(rows, seq_len).clone()
    return SlotBatch(input_ids, target_ids, torch.ones(rows, seq_len, dtype=torch.bool), slot_ids)


def random_adapter(executor, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=g) * 0.2
        for name, shape in executor.adapter_shapes(rank).items()
    }


@pytest.mark.parametrize("name", PLUGINS)
def test_lora_wraps_the_plugins_target_table_and_only_adapters_train(name, tiny_base):
    from mizzen_plugins import get
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    plain = get(name).causal_lm(get(name).tiny_config)
    expected = [
        path for path, m in plain.named_modules()
        if isinstance(m, torch.nn.Linear) and path.rsplit(".", 1)[-1] in TARGETS[name]
    ]  # fmt: skip
    imported, executor = executor_for(name, tiny_base(name))
    assert set(imported.target_modules) == TARGETS[name]
    assert sorted(executor.layers) == sorted(f"lm.{p}" for p in expected)
    assert all(layer.parallel_mode == "local" for layer in executor.layers.values())
    model = imported.model
    assert not any(p.requires_grad for p in model.parameters())
    base_before = {k: v.clone() for k, v in model.state_dict().items()}

    executor.load_slot(0, 4, 8.0)
    batch = batch_of([0, 0, 0, 0])
    losses = []
    for _ in range(5):
        losses.append(executor.forward_backward(batch, CrossEntropyLoss())[0].loss)
        executor.optim_step({0: AdamParams(lr=2e-2)})
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items()), "base weights changed"
    adapter = executor.adapter_weights(0)
    assert all(adapter[f"{k}.lora_B"].abs().sum() > 0 for k in executor.layers), "B stayed 0"
    assert losses[-1] < losses[0] - 0.1, losses


def segments_alone(lm, ids, segments):
    """Each segment of each row run alone through the plugin model, logits laid back in place."""
    out = []
    for row in range(ids.shape[0]):
        for seg in torch.unique_consecutive(segments[row]):
            out.append(lm(ids[row][segments[row] == seg]))
    return torch.cat(out).view(*ids.shape, -1)


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[b, 1, s, s]`` True where masked: later positions and other segments (the dense mask a
    GPTModel caller may pass; the executor itself packs, and builds none)."""
    seq_len = segment_ids.shape[1]
    later = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    other = segment_ids.unsqueeze(2) != segment_ids.unsqueeze(1)
    return (later | other).unsqueeze(1)


@pytest.mark.parametrize("name", PLUGINS)
def test_dense_masks_and_thd_params_give_the_plugin_models_own_logits(name, tiny_base):
    from megatron.core.packed_seq_params import PackedSeqParams

    from mizzen_train.executor import segment_positions
    from mizzen_train.plugin_models import import_plugin_model

    model = import_plugin_model(name, tiny_base(name)).model.eval()
    ids = torch.randint(3, 259, (2, 20), generator=torch.Generator().manual_seed(1))
    segments = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [0] * 3 + [1] * 17])
    with torch.no_grad():
        expected = segments_alone(model.lm, ids, segments)
        dense = model(ids, segment_positions(segments), document_causal_mask(segments))
        torch.testing.assert_close(dense, expected, rtol=1e-5, atol=1e-5)

        lengths = [7, 9, 4, 3, 17]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
            max_seqlen_q=17, max_seqlen_kv=17,
        )  # fmt: skip
        packed = model(ids.reshape(1, -1), segment_positions(segments).reshape(1, -1), None, params)
        torch.testing.assert_close(packed.view(2, 20, -1), expected, rtol=1e-5, atol=1e-5)

        # only the packed stream: a rows layout ('sbhd') is refused, naming the format
        rows_params = PackedSeqParams(
            qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
            max_seqlen_q=17, max_seqlen_kv=17,
        )  # fmt: skip
        with pytest.raises(ValueError, match="qkv_format='sbhd'"):
            model(ids, segment_positions(segments), None, rows_params)

        causal = torch.ones(20, 20, dtype=torch.bool).triu(1).view(1, 1, 20, 20)
        rows = model(ids, torch.arange(20).expand(2, -1), causal)  # every row one document
        rows_expected = segments_alone(model.lm, ids, torch.zeros_like(ids))
        torch.testing.assert_close(rows, rows_expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(rows, expected, atol=1e-3), "segments must matter"


def test_masks_and_positions_a_plugin_cannot_express_are_refused(tiny_base):
    from mizzen_train.plugin_models import import_plugin_model

    model = import_plugin_model("deepseek_v4", tiny_base("deepseek_v4")).model
    ids = torch.randint(3, 259, (1, 8))
    full = torch.zeros(1, 1, 8, 8, dtype=torch.bool)  # bidirectional: not document-causal
    with pytest.raises(ValueError, match="not a document-causal mask"):
        model(ids, torch.arange(8).view(1, 8), full)
    segments = torch.tensor([[0] * 4 + [1] * 4])
    with pytest.raises(ValueError, match="position_ids must restart"):
        model(ids, torch.arange(8).view(1, 8), document_causal_mask(segments))


@pytest.mark.parametrize("name", PLUGINS)
def test_slotted_rows_equal_their_slots_merged_model(name, tiny_base):
    from mizzen_plugins import get
    from mizzen_train.losses import target_logprobs
    from mizzen_train.plugin_models.export import merged_state

    imported, executor = executor_for(name, tiny_base(name))
    for slot in (0, 1):
        executor.load_slot(slot, 4, 8.0, weights=random_adapter(executor, 4, seed=slot))
    batch = batch_of([1, 1, 0, -1], seq_len=16)  # two slots' rows and a base-only row
    got = executor.forward_logprobs(batch)
    raw = imported.source.raw
    for row, slot in enumerate([1, 1, 0, None]):
        lm = get(name).causal_lm(raw)
        lm.load_state_dict(merged_state(imported.model, executor, slot))
        with torch.no_grad():
            logits = lm(batch.input_ids[row])
        want = target_logprobs(logits.unsqueeze(0), batch.target_ids[row : row + 1])[0]
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)
    base_only = executor.forward_logprobs(batch_of([-1, -1, -1, -1], seq_len=16))
    torch.testing.assert_close(got[3], base_only[3], rtol=0, atol=0)


def test_megatron_gpt_holds_no_plain_linear():
    """So extending the wrapper to nn.Linear leaves megatron models wrapped exactly as before."""
    from mizzen_train.gpt import GPTSpec, build_gpt

    for spec in (  # the GPT-2 default and the Llama shape the trainers import
        GPTSpec(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64),
        GPTSpec(
            num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
            normalization="RMSNorm", activation="swiglu", position_embedding="rope",
            num_query_groups=2, add_bias_linear=False,
        ),
    ):  # fmt: skip
        model = build_gpt(spec, device="cpu")
        assert not [p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def test_deepseek_v4_policy_gradient_step_moves_logprobs_with_the_advantages(tiny_base):
    """The RL policy step (clipped policy gradient, old log-probs from the executor) on a plugin
    without an engine: positive-advantage rows gain log-probability, negative ones lose it."""
    from dataclasses import replace

    from mizzen_train.losses import ClippedPolicyGradientLoss
    from mizzen_train.specs import AdamParams

    _, executor = executor_for("deepseek_v4", tiny_base("deepseek_v4"))
    executor.load_slot(0, 4, 8.0)
    batch = batch_of([0, 0, 0, 0], seq_len=16, seed=3)
    old = executor.forward_logprobs(batch)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0]).view(4, 1).expand(4, 16).clone()
    batch = replace(batch, old_logprobs=old, advantages=advantages)
    report = executor.forward_backward(batch, ClippedPolicyGradientLoss())[0]
    assert report.metrics["importance_ratio"] == pytest.approx(1.0, abs=1e-5)
    executor.optim_step({0: AdamParams(lr=1e-2)})
    change = (executor.forward_logprobs(batch) - old).mean(dim=1)
    assert change[0] > 0 and change[2] > 0 and change[1] < 0 and change[3] < 0, change


def test_megatrons_schedule_step_drives_plugin_gpt(tiny_base):
    """What megatron's no-pipelining schedule (the executor's CUDA path) asks of the model, on a
    CPU: its model type and config, and its ``forward_step`` running the executor-style step."""
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import forward_step
    from megatron.core.utils import get_model_config, get_model_type

    from mizzen_train.plugin_models import import_plugin_model

    model = import_plugin_model("deepseek_v4", tiny_base("deepseek_v4")).model
    assert get_model_type(model) == ModelType.encoder_or_decoder
    assert get_model_config(model) is model.config
    ids = torch.randint(3, 259, (2, 8))
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1).view(1, 1, 8, 8)

    def step(data, model):
        logits = model(next(data), torch.arange(8).expand(2, -1), mask)
        return logits, lambda out: (out.float().sum(), torch.tensor(16), {"s": out.sum().detach()})

    store = []
    output, tokens = forward_step(step, iter([ids]), model, 1, None, store, model.config, 1)
    assert int(tokens) == 16 and len(store) == 1 and output.dim() == 0
