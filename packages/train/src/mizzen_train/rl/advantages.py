"""Advantages of a group of samples drawn for one prompt (the estimator is pluggable by name).

- ``grpo``: ``(r - mean(group)) / (std(group) + eps)`` (population std), the group-normalised
  advantage of GRPO;
- ``mean``: ``r - mean(group)`` (Dr. GRPO's unnormalised baseline);
- ``module:function`` (or ``file.py:function``): any ``f(rewards: list[float]) -> list[float]``,
  loaded by the one loader of :mod:`mizzen_rollout.api`.

Invariants:
- A group whose rewards are all equal gets exactly zero advantages (nothing to prefer), for
  every built-in estimator.
- A sample without a reward (failed, aborted) gets advantage 0 and does not enter its group's
  statistics; its tokens are masked out of the loss by the trainer.
- Pure Python on floats: no torch, cheap to test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["ESTIMATORS", "AdvantageFn", "group_advantages", "load_estimator"]

AdvantageFn = Callable[[Sequence[float]], list[float]]


def grpo(rewards: Sequence[float], *, eps: float = 1e-6) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std == 0.0:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def mean_baseline(rewards: Sequence[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [0.0 if r == mean else r - mean for r in rewards]


ESTIMATORS: dict[str, AdvantageFn] = {"grpo": grpo, "mean": mean_baseline}


def load_estimator(spec: str) -> AdvantageFn:
    """A built-in estimator by name, or ``module:function`` / ``file.py:function`` by the one
    loader's rule (:func:`mizzen_rollout.api.load_object`); its ObjectSpecError (a ValueError)
    names the fix."""
    from mizzen_rollout.api import load_object

    return load_object(spec, what="advantage estimator", builtins=ESTIMATORS)


def group_advantages(rewards: Sequence[float | None], estimator: AdvantageFn) -> list[float]:
    """Advantages of one group (``None`` rewards: advantage 0, left out of the statistics)."""
    scored = [(i, float(r)) for i, r in enumerate(rewards) if r is not None]
    out = [0.0] * len(rewards)
    if not scored:
        return out
    values = estimator([r for _, r in scored])
    if len(values) != len(scored):
        raise ValueError(f"the estimator returned {len(values)} advantages for {len(scored)}")
    for (i, _), value in zip(scored, values, strict=True):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"the estimator returned a non-finite advantage {value}")
        out[i] = value
    return out
