"""Worker of ``test_lora_slots_2gpu.py``: launched by torchrun on 2 GPUs (NCCL).

Runs the same two-slot training as TP=2 and as DP=2 (same base weights, adapters and batch),
with megatron's schedule and per-slot DDP, injects an inf into slot 1's gradient shard on rank 1
only at one step, saves and restores a slot checkpoint, and writes what it saw to
``<out>/rank<r>.json`` for the test to compare across ranks and layouts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import slot_kit
import torch

STEPS = 12
POISON_STEP = 6


def run_layout(tp: int, out: Path, device: str = "cuda") -> dict:
    from megatron.core import parallel_state

    from mizzen_train.gpt import GPTSpec
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        spec = GPTSpec(
            num_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            vocab_size=256,
            max_sequence_length=64,
            dtype="bf16",
        )
        # host initialisation: the same base weights at TP=2 and at TP=1
        executor = slot_kit.tiny_executor(
            num_slots=2,
            max_rank=8,
            micro_batch_size=2,
            gpt=spec,
            device=device,
            cpu_initialization=True,
        )
        executor.load_slot(0, 8, 16.0, weights=slot_kit.random_adapter(executor, 8, seed=1))
        executor.load_slot(1, 4, 8.0, weights=slot_kit.random_adapter(executor, 4, seed=2))
        batch = slot_kit.tiny_batch([0, 0, 0, 0, 1, 1, 1, 1], seq_len=32, vocab_size=256, seed=0)
        adam = {0: AdamParams(lr=1e-2), 1: AdamParams(lr=1e-2)}
        rank = torch.distributed.get_rank()
        losses, decisions = {0: [], 1: []}, []
        for step in range(STEPS):
            reports = executor.forward_backward(batch, CrossEntropyLoss())
            if step == POISON_STEP and rank == 1:
                optimizer = executor._slots[1].optimizer  # fault injection on one rank only
                optimizer.params[-1].main_grad.view(-1)[0] = float("inf")
            steps = executor.optim_step(adam)
            for slot in (0, 1):
                losses[slot].append(reports[slot].loss)
            # the norm as hex: exact, and inf/nan compare equal across ranks after JSON
            decisions.append(
                {
                    str(s): [r.stepped, r.skipped_nonfinite, r.grad_norm.hex()]
                    for s, r in steps.items()
                }
            )
        ckpt = out / f"ckpt-tp{tp}"
        executor.save_slot(0, str(ckpt))
        saved = executor.inspect_slot(0)
        executor.unload_slot(1)
        executor.restore_slot(1, str(ckpt))
        restored = executor.inspect_slot(1)
        restore_equal = saved["step"] == restored["step"] and all(
            torch.equal(saved[entry][name], restored[entry][name])
            for entry in ("weight", "master", "exp_avg", "exp_avg_sq")
            for name in saved[entry]
        )
        return {
            "poison_step": POISON_STEP,
            "dp_size": executor.dp_size,
            "losses": {str(k): v for k, v in losses.items()},
            "decisions": decisions,
            "restore_equal": restore_equal,
            "shards": sorted(p.name for p in ckpt.rglob("*.pt")),
        }
    finally:
        parallel_state.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # a failed peer surfaces within minutes instead of NCCL's default 10
    torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(minutes=4))
    try:
        results = {"tp2": run_layout(2, out), "dp2": run_layout(1, out)}
        rank = torch.distributed.get_rank()
        (out / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
