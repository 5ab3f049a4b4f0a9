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

The work is batched over slots, so a step's kernel launches and host time do not grow with the
number of slots: one multi-tensor norm over every requested slot's gradients, one multi-tensor
scale for the clipped ones, and one fused AdamW (``torch._fused_adamw_``) per distinct set of
hyperparameters over every stepping slot's tensors.

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
        reduce_grads: bool = True,
    ) -> None:
        if len(params) != len(counts_in_norm):
            raise ValueError("counts_in_norm must give one flag per parameter")
        self.slot = slot
        self.params = list(params)
        self.counts_in_norm = list(counts_in_norm)
        self.step = 0
        self._grad_sync = grad_sync
        #: False with one data-parallel replica: the reduction would be an identity (megatron
        #: scales by 1 there), so its collective and host work are skipped.
        self._reduce_grads = reduce_grads
        self._weight_storage = weight_storage
        total = sum(p.numel() for p in self.params)
        if weight_storage.numel() != total:
            raise ValueError("weight_storage must hold exactly the slot's parameters, in order")
        device = weight_storage.device
        self.master_storage = weight_storage.detach().to(torch.float32, copy=True)
        self.exp_avg_storage = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq_storage = torch.zeros(total, dtype=torch.float32, device=device)
        self._counted_mask = torch.tensor(self.counts_in_norm, dtype=torch.bool, device=device)
        #: The step count on the device, as the fused AdamW reads it (kept equal to ``step``).
        self.step_tensor = torch.zeros((), dtype=torch.float32, device=device)
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
        if self._reduce_grads:
            self._grad_sync.finish_grad_sync()

    def zero_grads(self) -> None:
        self._grad_sync.zero_grad_buffer()

    @property
    def counted_mask(self) -> torch.Tensor:
        """``[params]`` True for the parameters this rank counts in the global norm."""
        return self._counted_mask

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
        self.step_tensor.fill_(step)
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
    chosen = [optimizers[slot] for slot in order]
    for optimizer in chosen:
        optimizer.sync_grads()
    totals = _squared_norms(chosen, group)

    reports: dict[int, StepReport] = {}
    stepping: list[tuple[SlotOptimizer, AdamParams, float]] = []
    for optimizer, hyper, (counted, uncounted) in zip(
        chosen, (requests[slot] for slot in order), totals, strict=True
    ):
        if not (math.isfinite(counted) and math.isfinite(uncounted)):
            nonfinite = counted + uncounted  # nan or inf: what the report shows
            reports[optimizer.slot] = StepReport(
                optimizer.slot, nonfinite, False, True, optimizer.step, 1.0
            )
            continue
        norm = math.sqrt(counted)
        clip_coef = 1.0
        if hyper.max_grad_norm is not None:
            clip_coef = min(1.0, hyper.max_grad_norm / (norm + 1e-6))
        stepping.append((optimizer, hyper, clip_coef))
        reports[optimizer.slot] = StepReport(
            optimizer.slot, norm, True, False, optimizer.step + 1, clip_coef
        )
    if stepping:
        _clip_and_step(stepping)
    for optimizer in chosen:
        optimizer.zero_grads()
    for optimizer, _, _ in stepping:
        optimizer.publish()
    return reports


def _squared_norms(
    chosen: Sequence[SlotOptimizer], group: torch.distributed.ProcessGroup | None
) -> list[list[float]]:
    """Per slot, the all-reduced fp64 ``[counted, uncounted]`` sums of squared gradients.

    *counted* elements make the global norm (each element once world-wide); *uncounted* ones are
    this rank's copies of elements another rank counts.  They are all-reduced too, so a
    non-finite value in any copy on any rank is seen by every rank.  One multi-tensor norm over
    every slot's gradients; one all-reduce; one host read."""
    grads = [grad for optimizer in chosen for grad in optimizer.grads()]
    norms = torch.stack(torch._foreach_norm(grads)).to(torch.float64).square()
    counted = torch.cat([optimizer.counted_mask for optimizer in chosen])
    zero = torch.zeros((), dtype=torch.float64, device=norms.device)
    parts = torch.stack([torch.where(counted, norms, zero), torch.where(counted, zero, norms)], 1)
    sizes = [len(optimizer.params) for optimizer in chosen]
    if len(set(sizes)) == 1:  # slots of one executor share a layout: one reduction, in order
        squared = parts.view(len(chosen), sizes[0], 2).sum(1)
    else:
        squared = torch.stack([part.sum(0) for part in parts.split(sizes)])
    torch.distributed.all_reduce(squared, group=group)
    return squared.tolist()


@torch.no_grad()
def _clip_and_step(stepping: Sequence[tuple[SlotOptimizer, AdamParams, float]]) -> None:
    """Scale the clipped slots' gradients, then one fused AdamW per hyperparameter set."""
    clipped = [(optimizer, coef) for optimizer, _, coef in stepping if coef != 1.0]
    if clipped:
        grads = [grad for optimizer, _ in clipped for grad in optimizer.grads()]
        coefs = [coef for optimizer, coef in clipped for _ in optimizer.params]
        torch._foreach_mul_(grads, coefs)
    by_hyper: dict[AdamParams, list[SlotOptimizer]] = {}
    for optimizer, hyper, _ in stepping:
        by_hyper.setdefault(_adam_key(hyper), []).append(optimizer)
        optimizer.step += 1
    torch._foreach_add_([optimizer.step_tensor for optimizer, _, _ in stepping], 1.0)
    for hyper, group in by_hyper.items():
        beta1, beta2 = hyper.betas
        torch._fused_adamw_(
            [master for optimizer in group for master in optimizer.masters],
            [grad for optimizer in group for grad in optimizer.grads()],
            [moment for optimizer in group for moment in optimizer.exp_avg],
            [moment for optimizer in group for moment in optimizer.exp_avg_sq],
            [],
            [optimizer.step_tensor for optimizer in group for _ in optimizer.params],
            lr=hyper.lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            amsgrad=False,
            maximize=False,
        )


def _adam_key(hyper: AdamParams) -> AdamParams:
    """The hyperparameters the AdamW update reads (clipping is applied before it)."""
    return AdamParams(
        lr=hyper.lr,
        betas=tuple(hyper.betas),
        eps=hyper.eps,
        weight_decay=hyper.weight_decay,
        max_grad_norm=None,
    )
