"""Per-token slot routing of a micro-batch's packed stream, so every LoRA layer reads one plan.

The executor hands the model one packed stream per micro-batch (its real tokens end to end, see
:mod:`mizzen_train.executor`), whatever slots it holds; the executor's batch rule
(:func:`mizzen_train.validation.check_batch`) lets a row hold one slot's tokens and base-only
tokens (``-1``), never two slots, so a slot's tokens form a few long runs of the stream.  A
micro-batch's per-token slot ids become a :class:`SlotRouting` of one of two kinds:

- *single*: one slot covers every token; layers multiply the whole stream by its factors.
- *runs*: anything else; the stream is cut into maximal runs of one slot (or of base-only
  tokens), and a layer multiplies each run by its own slot's factors (slices of the stream or
  groups of a grouped GEMM, no gather, no scatter); base-only runs get an exact-zero delta.

Every slotted layer of one forward pass reads the same routing from the shared
:class:`RoutingState`.

Invariants:
- A slot's factors see only its own tokens, forward and backward: a run belongs to one slot and
  the factor gradients of a slot are sums over its runs only (in run order: deterministic, no
  atomic scatter-add), so a non-finite value of one slot can never reach another slot, and
  base-only tokens receive an exact-zero delta (a non-finite activation of one of them stays in
  that token's own row).
- The runs cover the stream exactly once, in order; a slot's scale is in ``token_scales`` at each
  of its tokens (0 at base-only tokens).
- Built on the host from host tensors (no device synchronisation); the device tensors are moved
  once per micro-batch and shared by all layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenRun:
    """Stream tokens ``start .. stop - 1`` of one slot (``block`` indexes the routing's slots) or
    base-only (``block == -1``)."""

    start: int
    stop: int
    block: int


@dataclass(frozen=True)
class SlotRouting:
    #: The active slots, sorted; a block index names one of them.
    slots: tuple[int, ...]
    #: ``[len(slots)]`` adapter scale ``alpha / rank`` per active slot, in the model dtype.
    scales: torch.Tensor
    #: *runs* kind: the stream's runs in order, covering it exactly.  ``None``: single kind.
    runs: tuple[TokenRun, ...] | None = None
    #: *runs* kind: ``[tokens, 1]`` the scale of each token's slot (0 at base-only tokens).
    token_scales: torch.Tensor | None = None
    #: *runs* kind: ``[len(runs)]`` int32, each run's ``stop`` (the grouped GEMMs' offsets).
    run_stops: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return "single" if self.runs is None else "runs"

    def block_runs(self, block: int) -> tuple[TokenRun, ...]:
        """The runs of slot ``slots[block]``, in stream order."""
        return tuple(run for run in self.runs or () if run.block == block)


def build_routing(
    token_slots: torch.Tensor,
    scales: Mapping[int, float],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> SlotRouting | None:
    """Routing for one micro-batch's stream; ``None`` when no token uses an adapter.

    ``token_slots`` is the host tensor of every stream token's slot (``-1``: base only), any
    shape (read in row-major order); ``scales`` maps every slot present to its scale.
    """
    token_slots = token_slots.reshape(-1).to(torch.int64)
    slots = tuple(int(s) for s in torch.unique(token_slots).tolist() if s >= 0)
    if not slots:
        return None
    scale_tensor = torch.tensor([scales[s] for s in slots], dtype=dtype).to(device)
    if len(slots) == 1 and bool((token_slots >= 0).all()):
        return SlotRouting(slots, scale_tensor)
    block_of = {slot: block for block, slot in enumerate(slots)}
    cuts = (token_slots[1:] != token_slots[:-1]).nonzero().view(-1) + 1
    bounds = [0, *cuts.tolist(), token_slots.numel()]
    firsts = token_slots.index_select(0, torch.tensor(bounds[:-1], dtype=torch.int64)).tolist()
    runs = tuple(
        TokenRun(start, stop, block_of.get(int(slot), -1))
        for start, stop, slot in zip(bounds[:-1], bounds[1:], firsts, strict=True)
    )
    # per token: 1 + its slot's block (0 for base-only tokens), indexing [0, scale of each slot]
    lookup = torch.tensor([0.0, *(scales[s] for s in slots)], dtype=dtype)
    token_blocks = torch.tensor([run.block + 1 for run in runs], dtype=torch.int64)
    lengths = torch.tensor([run.stop - run.start for run in runs], dtype=torch.int64)
    token_scales = lookup.index_select(0, token_blocks.repeat_interleave(lengths))
    return SlotRouting(
        slots=slots,
        scales=scale_tensor,
        runs=runs,
        token_scales=token_scales.view(-1, 1).to(device),
        run_stops=torch.tensor(bounds[1:], dtype=torch.int32).to(device),
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
