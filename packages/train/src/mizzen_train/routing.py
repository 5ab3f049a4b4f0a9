"""Per-row slot routing of a micro-batch, so every LoRA layer runs one batched GEMM pair.

The executor's batch rule (:func:`mizzen_train.validation.check_batch`) lets a row hold one slot's
tokens and base-only tokens (``-1``), never two slots: attention mixes a row's tokens.  So a
micro-batch's ``slot_ids`` (``[b, s]``) becomes a :class:`SlotRouting` of one of two kinds:

- *single*: one slot covers every token; layers multiply the whole input by that slot's factors.
- *rows*: anything else; each row multiplies by its own slot's factors, one ``bmm`` over the batch
  axis of megatron's ``[s, b, h]`` activations, read in place (no gather, no scatter), and
  base-only tokens and rows get their delta replaced by an exact zero.

Every slotted layer of one forward pass reads the same routing from the shared
:class:`RoutingState`.

Invariants:
- A slot's factors see only its own rows, forward and backward: per-row factor gradients are
  summed per slot over that slot's rows only (:class:`mizzen_train.lora._FactorRows`), and
  base-only tokens are masked with ``where`` (not a multiply), so a non-finite value of one slot
  can never reach another slot, and base-only tokens receive an exact zero delta.
- Built on the host from host tensors (no device synchronisation); the few device tensors are
  moved once per micro-batch and shared by all layers.
- A row holding two slots is refused (``ValueError``): the executor validates batches before
  routing them, so this is a broken caller, not bad user input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotRouting:
    #: The active slots, sorted; a block index names one of them.
    slots: tuple[int, ...]
    #: ``[len(slots)]`` adapter scale ``alpha / rank`` per active slot, in the model dtype.
    scales: torch.Tensor
    #: *rows* kind: the block of every row, ``-1`` for base-only rows.  ``None``: single kind.
    row_blocks: tuple[int, ...] | None = None
    #: *rows* kind: ``[b]`` scale of every row's slot (0 for base-only rows), model dtype.
    row_scales: torch.Tensor | None = None
    #: *rows* kind: ``[s, b, 1]`` True for tokens routed to a slot; None: every token is.
    token_mask: torch.Tensor | None = None
    #: *rows* kind: the rows of each block, ascending (computed once per micro-batch).
    block_rows: tuple[tuple[int, ...], ...] = ()
    #: *rows* kind: ``n`` when block ``k`` is exactly rows ``k*n .. k*n+n-1`` for every block
    #: (per-block sums are then one reduction over a ``[blocks, n, ...]`` view); else None.
    uniform_run: int | None = None

    @property
    def kind(self) -> str:
        return "single" if self.row_blocks is None else "rows"


def build_routing(
    slot_ids: torch.Tensor,
    scales: Mapping[int, float],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> SlotRouting | None:
    """Routing for one micro-batch; ``None`` when no token uses an adapter.

    ``slot_ids`` is the host tensor ``[b, s]``; ``scales`` maps every slot present to its scale.
    """
    slot_ids = slot_ids.to(torch.int64)
    slots = tuple(int(s) for s in torch.unique(slot_ids).tolist() if s >= 0)
    if not slots:
        return None
    scale_tensor = torch.tensor([scales[s] for s in slots], dtype=dtype).to(device)
    routed = slot_ids >= 0
    every_token_routed = bool(routed.all())
    if len(slots) == 1 and every_token_routed:
        return SlotRouting(slots, scale_tensor)

    row_slot = slot_ids.max(dim=1).values  # the row's slot, or -1 for a base-only row
    mixed = routed & (slot_ids != row_slot.unsqueeze(1))
    if bool(mixed.any()):
        row = int(mixed.any(dim=1).nonzero()[0])
        raise ValueError(f"row {row} holds more than one slot: validate batches before routing")
    block_of = {slot: block for block, slot in enumerate(slots)}
    per_row = [int(s) for s in row_slot.tolist()]
    row_scales = torch.tensor([scales[s] if s >= 0 else 0.0 for s in per_row], dtype=dtype)
    row_blocks = tuple(block_of.get(s, -1) for s in per_row)
    block_rows = tuple(
        tuple(row for row, b in enumerate(row_blocks) if b == block) for block in range(len(slots))
    )
    run = len(row_blocks) // len(slots)
    uniform = row_blocks == tuple(block for block in range(len(slots)) for _ in range(run))
    return SlotRouting(
        slots=slots,
        scales=scale_tensor,
        row_blocks=row_blocks,
        row_scales=row_scales.to(device),
        token_mask=None if every_token_routed else routed.t().unsqueeze(2).to(device),
        block_rows=block_rows,
        uniform_run=run if uniform else None,
    )


class RoutingState:
    """The routing of the micro-batch being run, shared by every slotted layer of one model.

    Outside :meth:`use` it is ``None`` and slotted layers compute the base model only.
    """

    def __init__(self) -> None:
        self.current: SlotRouting | None = None

    @contextlib.contextmanager
    def use(self, routing: SlotRouting | None) -> Iterator[None]:
        previous = self.current
        self.current = routing
        try:
            yield
        finally:
            self.current = previous
