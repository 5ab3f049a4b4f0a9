"""GPU: the slot executor trains through the fast packed path (bf16, CUDA kernels of
``causal_thd_attention(impl="auto")``) like through the reference path.

One NCCL rank.  A Llama-shaped model (RMSNorm, SwiGLU with megatron's fused bias-SwiGLU, rope,
GQA) in bf16; packed rows of mixed sample lengths.  The first step's loss and LoRA gradients of
the fast path match the reference loop's (fp32 softmax per segment) within bf16 noise, and 15
steps train both paths to the same falling loss.
"""

from __future__ import annotations

import torch

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=25,
    hardware=["hopper"],
    num_gpus=1,
    labels=["lora", "train", "megatron"],
    shares_gpu=True,
)

STEPS = 15
SEQ = 512
# samples per row: short, long and in-between, so the fast path buckets several lengths
ROW_SAMPLES = [[100, 37, 300, 60], [511], [64] * 7 + [50], [200, 200, 90]]


def _batch():
    from mizzen_train.batch import SlotBatch

    generator = torch.Generator().manual_seed(0)
    rows = len(ROW_SAMPLES)
    input_ids = torch.randint(0, 512, (rows, SEQ), generator=generator)
    target_ids = (input_ids * 5 + 3) % 512
    segment_ids = torch.full((rows, SEQ), -1)
    for row, lengths in enumerate(ROW_SAMPLES):
        start = 0
        for index, length in enumerate(lengths):
            segment_ids[row, start : start + length] = index
            start += length
    slot_ids = torch.zeros(rows, SEQ, dtype=torch.long)
    return SlotBatch(input_ids, target_ids, segment_ids >= 0, slot_ids, segment_ids=segment_ids)


def _train(kit, impl: str | None) -> dict:
    from mizzen_train.gpt import GPTSpec
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    spec = GPTSpec.llama(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=512,
        vocab_size=512,
        max_sequence_length=SEQ,
        dtype="bf16",
    )
    executor = kit.tiny_executor(
        num_slots=1, max_rank=16, micro_batch_size=2, gpt=spec, device="cuda"
    )
    executor.attention_impl = impl
    executor.load_slot(0, 16, 32.0, weights=kit.random_adapter(executor, 16, seed=7))
    batch = _batch()
    losses, first_grad = [], None
    for step in range(STEPS):
        report = executor.forward_backward(batch, CrossEntropyLoss())[0]
        losses.append(report.loss)
        if step == 0:
            first_grad = executor.inspect_slot(0)["grad"]
        executor.optim_step({0: AdamParams(lr=1e-2)})
    return {"losses": losses, "grad": first_grad, "packing": report.packing_efficiency}


def test_fast_packed_path_trains_like_the_reference(kit, nccl_rank):
    from mizzen_train.packed_attention import default_impl

    assert default_impl(torch.device("cuda")) == "auto"
    fast = _train(kit, None)
    reference = _train(kit, "reference")
    first_fast, first_ref = fast["losses"][0], reference["losses"][0]
    assert abs(first_fast - first_ref) / first_ref < 1e-2, (first_fast, first_ref)
    for name, ref in reference["grad"].items():
        got = fast["grad"][name].flatten().double()
        ref = ref.flatten().double()
        if ref.norm() == 0:
            continue
        cosine = torch.dot(got, ref) / (got.norm() * ref.norm())
        assert cosine > 0.99, f"{name}: gradient cosine {cosine:.4f} vs the reference path"
    assert fast["losses"][-1] < first_fast - 0.05, f"no learning: {fast['losses']}"
    last_fast, last_ref = fast["losses"][-1], reference["losses"][-1]
    assert abs(last_fast - last_ref) / last_ref < 5e-2, (fast["losses"], reference["losses"])
    real = sum(map(sum, ROW_SAMPLES))
    assert abs(fast["packing"] - real / (len(ROW_SAMPLES) * SEQ)) < 1e-9
