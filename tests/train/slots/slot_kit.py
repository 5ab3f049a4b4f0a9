"""Builders shared by the train tests, their worker ranks and the 2-GPU worker script.

A plain module (not a conftest) so a script launched by torchrun can import it from its own
directory; ``tests/train/conftest.py`` loads it by path and hands it to tests as the ``kit``
fixture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mizzen_train.batch import SlotBatch
from mizzen_train.executor import SlotExecutor
from mizzen_train.gpt import GPTSpec, build_gpt
from mizzen_train.specs import ExecutorConfig

TINY_GPT = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)


def tiny_batch(
    row_slots: Sequence[int],
    *,
    seq_len: int = 16,
    vocab_size: int = TINY_GPT.vocab_size,
    seed: int = 0,
    with_policy_fields: bool = False,
) -> SlotBatch:
    """A host batch with one row per entry of ``row_slots`` (a slot id, -1 = base only).

    Each slot's targets are its own short periodic token pattern (position-dependent, input
    independent): low-rank enough for a LoRA to learn in a few steps, and different per slot,
    so a slot that trained on another slot's data would not learn its own."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(row_slots)
    input_ids = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    positions = torch.arange(seq_len)
    target_ids = torch.empty_like(input_ids)
    for row, slot in enumerate(row_slots):
        target_ids[row] = (7 * (slot + 2) + 5 * (positions % 3)) % vocab_size
    slot_ids = torch.tensor(row_slots, dtype=torch.int64).unsqueeze(1).expand(rows, seq_len)
    loss_mask = torch.ones(rows, seq_len, dtype=torch.bool)
    loss_mask[:, :2] = False
    fields: dict[str, torch.Tensor] = {}
    if with_policy_fields:
        fields["old_logprobs"] = -torch.rand(rows, seq_len, generator=generator) - 4.0
        fields["advantages"] = torch.randn(rows, seq_len, generator=generator)
    return SlotBatch(
        input_ids=input_ids,
        target_ids=target_ids,
        loss_mask=loss_mask,
        slot_ids=slot_ids.clone(),
        **fields,
    )


def tiny_executor(
    *,
    num_slots: int = 2,
    max_rank: int = 8,
    micro_batch_size: int = 2,
    gpt: GPTSpec = TINY_GPT,
    device: str = "cpu",
    target_modules: Sequence[str] | None = None,
    cpu_initialization: bool | None = None,
) -> SlotExecutor:
    """A tiny GPT (hidden 64, 2 layers) under a slot executor, on the current parallel state.

    ``cpu_initialization=True`` draws the base weights on the host (the same at every TP size);
    the default does so on the CPU only."""
    model = build_gpt(gpt, device=device, cpu_initialization=cpu_initialization)
    extra = {} if target_modules is None else {"target_modules": tuple(target_modules)}
    config = ExecutorConfig(
        num_slots=num_slots, max_rank=max_rank, micro_batch_size=micro_batch_size, **extra
    )
    return SlotExecutor(model, config)


def random_adapter(
    executor: SlotExecutor, rank: int, *, seed: int, magnitude: float = 0.2
) -> dict[str, torch.Tensor]:
    """Full true-rank factors with every entry non-zero (a fresh slot's B is zero)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.rand(shape, generator=generator) - 0.5) * 2 * magnitude
        for name, shape in executor.adapter_shapes(rank).items()
    }


def split_dims(executor: SlotExecutor) -> dict[str, int | None]:
    """Factor name -> the dimension its TP shards split (None: replicated)."""
    return {factor.name: factor.split_dim for factor in executor.layout}


def join_tp_shards(
    per_rank: Sequence[dict[str, torch.Tensor]], dims: dict[str, int | None]
) -> dict[str, torch.Tensor]:
    """Full factors from every TP rank's local shards (replicated ones must agree exactly)."""
    joined = {}
    for name, dim in dims.items():
        parts = [shards[name] for shards in per_rank]
        if dim is None:
            for part in parts[1:]:
                assert torch.equal(part, parts[0]), f"{name}: replicated factor differs across TP"
            joined[name] = parts[0]
        else:
            joined[name] = torch.cat(parts, dim=dim)
    return joined
