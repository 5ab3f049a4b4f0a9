"""A tenant's learning-rate schedule and the optimizer request of one step.

Invariants:
- :func:`lr_at` is a pure function of the tenant's fields and the (1-based) step: a resumed run
  steps with exactly the rates the uninterrupted one would have used.
- No step has learning rate 0: warmup starts at ``lr / warmup_steps`` and decay reaches its floor
  one step after the last.
"""

from __future__ import annotations

import math

from mizzen_train.run.sections import AdapterTrainingConfig

__all__ = ["adam_params", "lr_at"]


def lr_at(tenant: AdapterTrainingConfig, step: int, total_steps: int) -> float:
    """Learning rate of ``step`` (1-based): linear warmup, then constant / cosine / linear decay
    towards ``min_lr_ratio * lr``, reached one step after the last (so no step has lr 0)."""
    peak = tenant.lr
    if tenant.warmup_steps and step <= tenant.warmup_steps:
        return peak * step / tenant.warmup_steps
    if tenant.lr_schedule == "constant":
        return peak
    span = max(1, total_steps - tenant.warmup_steps)
    progress = min(1.0, (step - tenant.warmup_steps - 1) / span)
    floor = tenant.min_lr_ratio * peak
    if tenant.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak - (peak - floor) * progress


def adam_params(tenant: AdapterTrainingConfig, lr: float):
    """The executor's AdamW request for ``tenant`` at learning rate ``lr``."""
    from mizzen_train.specs import AdamParams

    return AdamParams(
        lr=lr,
        betas=tuple(tenant.betas),
        eps=tenant.eps,
        weight_decay=tenant.weight_decay,
        max_grad_norm=tenant.max_grad_norm or None,
    )
