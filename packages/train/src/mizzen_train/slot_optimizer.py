"""Per-slot optimizer: fp32 masters and AdamW state for one slot, stepped in lockstep over ranks.

:class:`SlotOptimizer` owns, for one slot, an fp32 master copy of its adapter and the two Adam
moments (each one flat allocation), and reads the slot's fp32 gradients from the ``main_grad``
buffers of the slot's megatron ``DistributedDataParallel`` (its ``grad_sync``).  Hyperparameters
(:class:`~mizzen_train.specs.AdamParams`) arrive with each step request.

:func:`step_slot_optimizers` steps several slots on every rank in one sorted order:

1. *prepare* — reduce each slot's gradients over data parallelism (one collective per slot, same
   order everywhere), then one all-reduce of the squared gradient norms of all requested slots
   over every rank holding their parameters.  Each parameter element is counted once world-wide
   for the norm (only the first data-parallel replica counts, and TP-replicated factors only on
   TP rank 0); the copies the norm does not count are summed alongside, so a non-finite value in
   any copy on any rank is seen too.  Every rank holds the same totals *before* it checks
   finiteness, so all ranks take the same decision.
2. *clip and step* — a slot with a non-finite norm is skipped (``skipped_nonfinite``); the others
   are clipped to ``max_grad_norm`` and take one AdamW step on their masters.
3. *zero* — every requested slot's gradients are zeroed (a skipped slot's are discarded).
4. *publish* — masters of the slots that stepped are copied into the model's weights.

Invariants:
- A slot's step reads and writes only that slot's tensors; a slot not in the request is not
  touched at all (its pending gradients keep accumulating).
- A skipped slot's weights, masters, moments and step count are unchanged.
- Any exception propagates to the caller (the executor marks itself failed: see
  :mod:`mizzen_train.executor`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mizzen_train.specs import AdamParams


class GradSync(Protocol):
    """The part of megatron's ``DistributedDataParallel`` a slot optimizer uses."""

    def finish_grad_sync(self) -> None: ...

    def zero_grad_buffer(self) -> None: ...


@dataclass(frozen=True)
class StepReport:
    """What one slot's step did."""

    slot: int
    #: Global gradient norm before clipping (nan/inf when non-finite).
    grad_norm: float
    stepped: bool
    skipped_nonfinite: bool
    #: The slot's optimizer step count after this request.
    step: int
    #: Factor the gradients were scaled by (1.0 when unclipped or skipped).
    clip_coef: float


class SlotOptimizer:
    """fp32 masters + AdamW moments of one slot's parameters."""

    def __init__(
        self,
        slot: int,
        params: Sequence[torch.nn.Parameter],
        *,
        counts_in_norm: Sequence[bool],
        grad_sync: GradSync,
        weight_storage: torch.Tensor,
    ) -> None:
        if len(params) != len(counts_in_norm):
            raise ValueError("counts_in_norm must give one flag per parameter")
        self.slot = slot
        self.params = list(params)
        self.counts_in_norm = list(counts_in_norm)
        self.step = 0
        self._grad_sync = grad_sync
        self._weight_storage = weight_storage
        total = sum(p.numel() for p in self.params)
        if weight_storage.numel() != total:
            raise ValueError("weight_storage must hold exactly the slot's parameters, in order")
        device = weight_storage.device
        self.master_storage = weight_storage.detach().to(torch.float32, copy=True)
        self.exp_avg_storage = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq_storage = torch.zeros(total, dtype=torch.float32, device=device)
        self._counted_mask = torch.tensor(self.counts_in_norm, dtype=torch.bool, device=device)
        self.masters = self._views(self.master_storage)
        self.exp_avg = self._views(self.exp_avg_storage)
        self.exp_avg_sq = self._views(self.exp_avg_sq_storage)

    def _views(self, storage: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for param in self.params:
            views.append(storage[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()
        return views

    # -- gradients ------------------------------------------------------------------------------

    def grads(self) -> list[torch.Tensor]:
        return [param.main_grad for param in self.params]

    def sync_grads(self) -> None:
        """Reduce this slot's accumulated gradients over data parallelism (a collective)."""
        self._grad_sync.finish_grad_sync()

    def zero_grads(self) -> None:
        self._grad_sync.zero_grad_buffer()

    def local_grad_sq_norms(self) -> torch.Tensor:
        """fp64 ``[counted, uncounted]`` sums of squares of this rank's gradient elements.

        *counted* elements make the global norm (each element once world-wide); *uncounted* ones
        are this rank's copies of elements another rank counts.  They are all-reduced too, so a
        non-finite value in any copy on any rank is seen by every rank."""
        norms = torch.stack(torch._foreach_norm(self.grads())).to(torch.float64).square()
        zero = torch.zeros((), dtype=torch.float64, device=norms.device)
        counted = self._counted_mask
        return torch.stack(
            [torch.where(counted, norms, zero).sum(), torch.where(counted, zero, norms).sum()]
        )

    # -- update ---------------------------------------------------------------------------------

    @torch.no_grad()
    def apply_adam(self, hyper: AdamParams, clip_coef: float) -> None:
        """One AdamW step of the masters from the (already reduced) gradients."""
        grads = self.grads()
        if clip_coef != 1.0:
            torch._foreach_mul_(grads, clip_coef)
        beta1, beta2 = hyper.betas
        self.step += 1
        bias_correction1 = 1.0 - beta1**self.step
        bias_correction2 = 1.0 - beta2**self.step
        torch._foreach_lerp_(self.exp_avg, grads, 1.0 - beta1)
        torch._foreach_mul_(self.exp_avg_sq, beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, 1.0 - beta2)
        if hyper.weight_decay:
            torch._foreach_mul_(self.masters, 1.0 - hyper.lr * hyper.weight_decay)
        denom = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denom, math.sqrt(bias_correction2))
        torch._foreach_add_(denom, hyper.eps)
        torch._foreach_addcdiv_(self.masters, self.exp_avg, denom, -hyper.lr / bias_correction1)

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the masters into the model's weights (cast to the model dtype)."""
        self._weight_storage.copy_(self.master_storage)

    # -- state ----------------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Masters and moments per parameter (views, in parameter order)."""
        return {"master": self.masters, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    @torch.no_grad()
    def load_state(self, state: Mapping[str, Sequence[torch.Tensor]], step: int) -> None:
        """Restore masters and moments (shapes validated by the caller) and publish."""
        for name, targets in self.state_tensors().items():
            for target, source in zip(targets, state[name], strict=True):
                target.copy_(source)
        self.step = step
        self.publish()


def step_slot_optimizers(
    optimizers: Mapping[int, SlotOptimizer],
    requests: Mapping[int, AdamParams],
    *,
    group: torch.distributed.ProcessGroup | None = None,
) -> dict[int, StepReport]:
    """Step the requested slots in one sorted order on every rank (see the module docstring).

    ``group`` spans every rank holding the slots' parameters (default: the world).
    """
    order = sorted(requests)
    if not order:
        return {}
    for slot in order:
        optimizers[slot].sync_grads()
    squared = torch.stack([optimizers[slot].local_grad_sq_norms() for slot in order])
    torch.distributed.all_reduce(squared, group=group)
    totals = squared.tolist()

    reports: dict[int, StepReport] = {}
    for slot, (counted, uncounted) in zip(order, totals, strict=True):
        optimizer, hyper = optimizers[slot], requests[slot]
        if not (math.isfinite(counted) and math.isfinite(uncounted)):
            nonfinite = counted + uncounted  # nan or inf: what the report shows
            reports[slot] = StepReport(slot, nonfinite, False, True, optimizer.step, 1.0)
            continue
        norm = math.sqrt(counted)
        clip_coef = 1.0
        if hyper.max_grad_norm is not None:
            clip_coef = min(1.0, hyper.max_grad_norm / (norm + 1e-6))
        optimizer.apply_adam(hyper, clip_coef)
        reports[slot] = StepReport(slot, norm, True, False, optimizer.step, clip_coef)
    for slot in order:
        optimizers[slot].zero_grads()
    for slot in order:
        if reports[slot].stepped:
            optimizers[slot].publish()
    return reports
