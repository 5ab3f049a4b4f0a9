"""Plain request and configuration records of the slot executor (no behaviour, no torch).

Every rule about their values lives in :mod:`mizzen_train.validation`, which the executor applies
when a request arrives (registration time), so a record can be built freely and fails only where
it is used, with the field named.

Invariants:
- Records are frozen: a request cannot change after it was validated.
- Defaults are the executor's supported settings; fields whose only valid value is the default
  (``use_distributed_optimizer``, ``overlap_grad_reduce``) exist so a caller asking for the
  unsupported setting gets a clear refusal instead of a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Initialisers for a slot's A matrix (B always starts at zero, so a fresh slot adds nothing).
#: ``kaiming_uniform``: U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform with a=sqrt(5), as in PEFT);
#: ``gaussian``: N(0, 1/rank).
LORA_INITS = ("kaiming_uniform", "gaussian")

#: The largest LoRA seed (seeds are 32-bit: each layer's generator seed is derived from it, and
#: torch's generator takes a signed 64-bit one).
MAX_LORA_SEED = 2**32 - 1

#: The linear layers of megatron-core's local GPT layer spec that LoRA targets by default.
DEFAULT_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoraSlotSpec:
    """One tenant's adapter shape: true ``rank`` (stored padded to the executor's max rank),
    ``alpha`` (delta scale ``alpha / rank``), the A initialiser and its seed."""

    rank: int
    alpha: float
    init: str = "kaiming_uniform"
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class AdamParams:
    """Per-request AdamW hyperparameters of one slot's step (decoupled weight decay).

    ``max_grad_norm=None`` disables clipping; the norm is still computed (the finiteness check
    needs it)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0


@dataclass(frozen=True)
class ExecutorConfig:
    """Shape of the slot pool and how batches are cut.

    ``micro_batch_size`` counts rows per micro-batch on one data-parallel rank.
    """

    num_slots: int
    max_rank: int
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    micro_batch_size: int = 1
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
