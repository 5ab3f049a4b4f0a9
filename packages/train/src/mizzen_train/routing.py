"""Per-token slot routing, packed so every LoRA layer runs two batched GEMMs for all slots.

A micro-batch's ``slot_ids`` (``[b, s]``, ``-1`` = base only) becomes a :class:`SlotRouting`:
the active slots (sorted) and, for megatron's token order (``[s, b]`` flattened), the index that
gathers each slot's tokens into one padded block ``[slots, tokens_max, hidden]`` and the index
that scatters the packed result back.  Every slotted layer of one forward pass reads the same
routing from the shared :class:`RoutingState`.

Invariants:
- Block ``i`` holds only tokens of ``slots[i]``; its padding rows are zeroed with ``where`` (not a
  multiply), so a non-finite value of one slot can never reach another slot's block, forward or
  backward.  Tokens routed to ``-1`` receive an exact zero delta.
- Built on the host from host tensors (no device synchronisation); the index tensors are moved to
  the model's device once per micro-batch and shared by all layers.
- ``None`` fields mean "identity" and let the layer skip the gather/scatter: one slot covering
  every token needs neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotRouting:
    slots: tuple[int, ...]
    #: ``[len(slots)]`` adapter scale ``alpha / rank`` per active slot, in the model dtype.
    scales: torch.Tensor
    #: ``[len(slots), tokens_max]`` flat token index per packed row; None: identity.
    gather_index: torch.Tensor | None
    #: ``[len(slots), tokens_max, 1]`` True where a packed row is a real token; None: no padding.
    pad_mask: torch.Tensor | None
    #: ``[tokens]`` packed row of each token; None: identity.
    scatter_index: torch.Tensor | None
    #: ``[tokens, 1]`` True for tokens routed to a slot; None: every token is.
    token_mask: torch.Tensor | None


def build_routing(
    slot_ids: torch.Tensor,
    scales: Mapping[int, float],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> SlotRouting | None:
    """Routing for one micro-batch; ``None`` when no token uses an adapter.

    ``slot_ids`` is the host tensor ``[b, s]``; ``scales`` maps every slot present to its scale.
    """
    flat = slot_ids.t().reshape(-1).to(torch.int64)  # megatron order: index = s * b + b_index
    slots = tuple(int(s) for s in torch.unique(flat).tolist() if s >= 0)
    if not slots:
        return None
    scale_tensor = torch.tensor([scales[s] for s in slots], dtype=dtype).to(device)
    routed = flat >= 0
    every_token_routed = bool(routed.all())
    if len(slots) == 1 and every_token_routed:
        return SlotRouting(slots, scale_tensor, None, None, None, None)

    members = [torch.nonzero(flat == s, as_tuple=False).squeeze(1) for s in slots]
    tokens_max = max(int(m.numel()) for m in members)
    gather_index = torch.zeros(len(slots), tokens_max, dtype=torch.int64)
    pad_mask = torch.zeros(len(slots), tokens_max, 1, dtype=torch.bool)
    scatter_index = torch.zeros(flat.numel(), dtype=torch.int64)
    for block, tokens in enumerate(members):
        count = int(tokens.numel())
        gather_index[block, :count] = tokens
        pad_mask[block, :count] = True
        scatter_index[tokens] = block * tokens_max + torch.arange(count)
    padded = not bool(pad_mask.all())
    return SlotRouting(
        slots=slots,
        scales=scale_tensor,
        gather_index=gather_index.to(device),
        pad_mask=pad_mask.to(device) if padded else None,
        scatter_index=scatter_index.to(device),
        token_mask=None if every_token_routed else routed.unsqueeze(1).to(device),
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
