"""Per-token losses a forward_backward request can select, per call or per slot.

Both losses start from the log-probability of each target token under the current adapter,
:func:`target_logprobs`, computed from vocabulary-parallel logits ``[b, s, vocab/tp]``:

- CUDA logits with tensor-parallel size 1 (megatron's ``parallel_state`` not initialised counts
  as 1): :func:`fused_target_logprobs` through ``torch.compile(dynamic=True)``, one process-wide
  compiled function made on the first such call.  Inductor fuses the fp32 upcast into the
  reductions (the bf16 logits are read, never copied to fp32) and the backward into one
  elementwise pass ``g * (onehot - softmax)`` written in the logits' dtype; what it keeps for
  backward is the logits themselves and two fp32 numbers per token, no fp32 copy of the logits.
- Otherwise (CPU logits, or tensor-parallel size > 1): megatron-core's
  ``vocab_parallel_cross_entropy`` on an fp32 copy (tensor parallelism never gathers the
  vocabulary).  The CPU never invokes the compiler.

Both paths compute ``(x_t - m) - log(sum(exp(x - m)))`` in fp32 with ``m`` the row's maximum
logit, so their values and gradients agree within fp32 rounding (the gradient then rounded to the
logits' dtype).  A target id outside ``[0, vocab)`` behaves as in megatron: its shifted target
logit counts as 0, so its logprob is ``m - logsumexp(x)`` (that of an argmax token) and its
gradient is ``-g * softmax`` (no one-hot term).  Mis-shaped targets, non-integer ids and logits
and targets on different devices are errors naming what was given.

The losses:

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

import functools
from collections.abc import Callable
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
    """Log-probability ``[b, s]`` (fp32) of ``target_ids`` ``[b, s]`` under vocab-parallel
    ``logits`` ``[b, s, vocab/tp]``: the compiled fused path for CUDA logits at tensor-parallel
    size 1, megatron's otherwise (see the module docstring)."""
    _check_targets(logits, target_ids)
    if _fused_path_applies(logits):
        return _compiled_fused_target_logprobs()(logits, target_ids)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron's kernel works in place on its input, so it gets an fp32 copy (or the fp32
    # logits themselves, which nothing else reads afterwards).
    return -vocab_parallel_cross_entropy(logits.float(), target_ids)


def fused_target_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """The un-compiled body of the fused path: megatron's arithmetic on the whole vocabulary.

    ``(x_t - m) - log(sum(exp(x - m)))`` in fp32, ``m`` the row maximum (detached: its gradient
    cancels).  The target logit is picked by comparing the vocabulary index with the id rather
    than by ``gather``, whose backward is a scatter into a zero tensor as large as the logits;
    the comparison keeps the backward one elementwise pass, and an id outside the vocabulary
    matches no index, which gives megatron's value for it."""
    x = logits.float()
    shifted = x - x.amax(dim=-1, keepdim=True).detach()
    vocab_ids = torch.arange(x.shape[-1], device=x.device)
    hit = vocab_ids == target_ids.unsqueeze(-1)
    target_shifted = torch.where(hit, shifted, 0.0).sum(dim=-1)
    return target_shifted - shifted.exp().sum(dim=-1).log()


@functools.cache
def _compiled_fused_target_logprobs() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`fused_target_logprobs` through ``torch.compile``, made once per process (dynamic
    shapes: a graph per dtype and grad mode serves every batch shape, a size-1 dimension aside,
    which inductor specialises)."""
    return torch.compile(fused_target_logprobs, dynamic=True)


def _fused_path_applies(logits: torch.Tensor) -> bool:
    """CUDA logits and tensor-parallel size 1 (parallel state not initialised counts as 1)."""
    if not logits.is_cuda:
        return False
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.get_tensor_model_parallel_world_size() == 1


def _check_targets(logits: torch.Tensor, target_ids: torch.Tensor) -> None:
    """One integer id per logits row, on the logits' device; the vocabulary is not empty."""
    if (
        target_ids.dtype.is_floating_point
        or target_ids.dtype.is_complex
        or target_ids.dtype == torch.bool
    ):
        raise TypeError(
            f"target_logprobs: target_ids must hold integer token ids, got dtype "
            f"{target_ids.dtype}; pass them as torch.long"
        )
    if (
        logits.dim() < 1
        or logits.shape[-1] == 0
        or tuple(target_ids.shape) != tuple(logits.shape[:-1])
    ):
        raise ValueError(
            f"target_logprobs: logits of shape {list(logits.shape)} need target_ids of shape "
            f"{list(logits.shape[:-1])} (one id per row of a non-empty vocabulary), got "
            f"{list(target_ids.shape)}"
        )
    if target_ids.device != logits.device:
        raise ValueError(
            f"target_logprobs: target_ids are on {target_ids.device} but logits on "
            f"{logits.device}; move them to the logits' device"
        )


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
