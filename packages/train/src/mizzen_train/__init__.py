"""mizzen-train: fine-tuning language models on megatron-core.

Supervised and RL fine-tuning for mizzen: a multi-tenant LoRA slot executor (many adapters, each
with its own optimizer, trained in slots of one base model), SFT and policy-gradient losses, and
slot checkpoints.  Rollout samples come from :mod:`mizzen_rollout.samples`, the one sample contract.

Invariant: every module imports on a CPU machine with no GPU-only library installed (megatron-core
and torch are allowed at module scope; transformer_engine, apex, flash_attn, … only inside the
functions that use them).
"""

__version__ = "0.1.0"
