"""Benchmark: the embedded engine's batched generation against one request at a time.

    uv run python benchmarks/bench_embedded_batching.py [--device cuda] [--rounds 3] [--tiny]

The backend of the embedded engine (:class:`TransformersBackend`, the code behind ``mizzen-rollout
serve``) on the ~100M-parameter Llama of the GPU e2e tests (random weights written by code), in
float32 as the engines serve an exported snapshot.  For each workload -- the RL e2e's rollout
calls (16 samples of one prompt; 1 and 3 new tokens, with and without a LoRA adapter) and the SFT
e2e's eval set (16 different prompts, 16 greedy tokens) -- the same requests are generated two
ways in the same run, alternating, ``--rounds`` times (the median is printed):

- baseline: one request per call (what the engine did before batching);
- batched: all of them as one ``generate_batch`` call (one batched ``/generate``).

It prints, per workload, both times, the ratio batched/baseline, and checks that every batched
row generated the tokens of its request alone (greedy rows; sampled rows draw from their own
seeded generator, so they agree too unless float noise flips a draw -- the count is printed).
``--tiny`` runs the packaged tiny model on the CPU (a check of the script, not a measurement).

Imports the installed workspace (``uv run``; nothing here edits ``sys.path``).  In an image's own
environment (the GPU machine: torch, transformers, peft and safetensors, no venv), put the two
packages on the path: ``PYTHONPATH=packages/rollout/src:packages/train/src python benchmarks/
bench_embedded_batching.py --device cuda``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mizzen_rollout.engines import SamplingParams
from mizzen_rollout.engines.embedded.backend import (
    GenerationItem,
    TransformersBackend,
)

ROWS = 16


def _backend(args, workdir: Path) -> tuple[TransformersBackend, str | None]:
    import peft
    import transformers

    if args.tiny:
        backend = TransformersBackend(seed=0, device=args.device)
        base_dir = workdir / "tiny"
        backend.model.save_pretrained(str(base_dir))
    else:
        from mizzen_train.hf import LLAMA_100M, write_tiny_llama

        base_dir = write_tiny_llama(
            workdir / "llama-100m", seed=0, initializer_range=0.05, **LLAMA_100M
        )
        backend = TransformersBackend(model_path=str(base_dir), device=args.device)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir))
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=16,
            lora_alpha=32,
            init_lora_weights=False,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        ),
    )
    lora.save_pretrained(str(workdir / "adapter"))
    backend.load_lora("tenant@v1", str(workdir / "adapter"))
    return backend, "tenant@v1"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _workloads(backend, adapter):
    encode = backend.tokenizer.encode
    prompt = tuple(encode("Answer with one letter. Question 17: which letter? Answer:"))
    eval_prompts = [
        tuple(encode(f"Name colour {i}: the sky at {i} o'clock is")) for i in range(ROWS)
    ]

    def group(new_tokens, lora):
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=None)
        return [
            GenerationItem(prompt, sampling, f"g{new_tokens}{lora}-{i}", True, lambda: False, lora)
            for i in range(ROWS)
        ]

    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    return {
        "RL group, 1 new token": group(1, None),
        "RL group, 3 new tokens": group(3, None),
        "RL group, 1 new token, LoRA": group(1, adapter),
        "RL group, 3 new tokens, LoRA": group(3, adapter),
        "eval set, 16 greedy tokens": [
            GenerationItem(p, greedy, f"e{i}", False, lambda: False)
            for i, p in enumerate(eval_prompts)
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (a check)")
    args = parser.parse_args()
    if args.tiny:
        args.device = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        backend, adapter = _backend(args, Path(tmp))
        name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        print(f"embedded engine batching on {name} ({backend.description}), {args.rounds} rounds")
        print(
            f"{'workload':32} {'one at a time ms':>17} {'batched ms':>11} {'ratio':>7} {'rows agree':>11}"
        )
        for label, items in _workloads(backend, adapter).items():
            backend.generate_batch(items[:2])  # warm-up
            alone_s, batched_s = [], []
            for _ in range(args.rounds):
                _sync(args.device)
                start = time.perf_counter()
                alone = [backend.generate_batch([item])[0] for item in items]
                _sync(args.device)
                alone_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                together = backend.generate_batch(items)
                _sync(args.device)
                batched_s.append(time.perf_counter() - start)
            agree = sum(a.output_ids == b.output_ids for a, b in zip(alone, together, strict=True))
            a, b = statistics.median(alone_s), statistics.median(batched_s)
            print(
                f"{label:32} {a * 1e3:17.1f} {b * 1e3:11.1f} {b / a:7.3f} {agree:>8}/{len(items)}"
            )
            greedy = all(item.sampling.temperature == 0 for item in items)
            if greedy and agree != len(items):
                print(f"FAILED: greedy rows of {label!r} differ from their requests alone")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
