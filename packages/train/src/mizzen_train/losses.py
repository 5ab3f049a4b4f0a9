"""Per-token losses a forward_backward request can select, per call or per slot.

Both losses start from the log-probability of each target token under the current adapter,
computed from vocabulary-parallel logits with megatron-core's ``vocab_parallel_cross_entropy`` (so
tensor parallelism never gathers the vocabulary):

- :class:`CrossEntropyLoss` (SFT): ``-logprob``.
- :class:`ClippedPolicyGradientLoss` (RL, PPO-style): with importance ratio
  ``r = exp(logprob - old_logprob)`` and advantage ``A``, ``-min(r*A, clip(r, 1-clip_low,
  1+clip_high)*A)``; reports the fraction of tokens where the clipped branch was taken.  With
  ``kl_coef > 0`` it adds ``kl_coef * k3`` per token, ``k3 = exp(d) - d - 1`` with
  ``d = ref_logprob - logprob`` (the non-negative, unbiased estimator of ``KL(pi || ref)`` on
  samples of ``pi``); the reference is the adapter-free base model, so no copy of it is kept.
  The ``kl`` metric is reported whenever ``ref_logprobs`` is given, whatever the coefficient.

Invariants:
- A loss returns *per-token* values and per-token metrics; the executor weights them by the loss
  mask over the slot's global token count and sums per slot, so a slot's loss never mixes with
  another slot's tokens.
- Losses are frozen dataclasses (hashable): the executor groups slots that share one.
- Nothing here reduces across tokens or ranks; a non-finite input yields non-finite values only at
  the tokens that carry it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch


class TokenLoss(Protocol):
    """What :meth:`SlotExecutor.forward_backward` accepts as a loss function."""

    name: ClassVar[str]
    #: Optional :class:`~mizzen_train.batch.SlotBatch` fields this loss reads.
    requires: ClassVar[tuple[str, ...]]
    #: Names of the per-token metrics :meth:`per_token` returns.
    metrics: ClassVar[tuple[str, ...]]

    def per_token(
        self, logprobs: torch.Tensor, fields: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss ``[b, s]`` and per-token metrics (detached) from target logprobs."""
        ...


def target_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``target_ids`` under vocab-parallel ``logits`` ``[b, s, vocab/tp]``.

    Computed in fp32.  megatron's kernel works in place on its input, so it gets an fp32 copy
    (or the fp32 logits themselves, which nothing else reads afterwards).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float(), target_ids)


@dataclass(frozen=True)
class CrossEntropyLoss:
    """Supervised fine-tuning: negative log-likelihood of the target tokens."""

    name: ClassVar[str] = "cross_entropy"
    requires: ClassVar[tuple[str, ...]] = ()
    metrics: ClassVar[tuple[str, ...]] = ()

    def per_token(
        self, logprobs: torch.Tensor, fields: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del fields
        return -logprobs, {}


@dataclass(frozen=True)
class ClippedPolicyGradientLoss:
    """PPO-style clipped surrogate with importance ratio against ``old_logprobs``."""

    name: ClassVar[str] = "clipped_policy_gradient"
    metrics: ClassVar[tuple[str, ...]] = ("clip_fraction", "importance_ratio", "kl")

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0

    @property
    def requires(self) -> tuple[str, ...]:
        base = ("old_logprobs", "advantages")
        return (*base, "ref_logprobs") if self.kl_coef > 0 else base

    def per_token(
        self, logprobs: torch.Tensor, fields: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        advantages = fields["advantages"]
        ratio = torch.exp(logprobs - fields["old_logprobs"])
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * advantages
        loss = -torch.minimum(unclipped, clipped)
        reference = fields.get("ref_logprobs")
        if reference is not None:
            delta = reference - logprobs
            kl = torch.exp(delta) - delta - 1.0
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * kl
            kl_metric = kl.detach()
        else:
            kl_metric = torch.zeros_like(logprobs)
        metrics = {
            "clip_fraction": (clipped < unclipped).to(torch.float32),
            "importance_ratio": ratio.detach(),
            "kl": kl_metric,
        }
        return loss, metrics
