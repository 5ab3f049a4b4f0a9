"""The batch contract of :meth:`SlotExecutor.forward_backward`.

A :class:`SlotBatch` is one request's rows, given whole and identical to every rank; each
data-parallel rank trains on its contiguous chunk of rows (:meth:`SlotBatch.rows_for`).  All
tensors are ``[rows, seq]``:

- ``input_ids`` / ``target_ids``: token ids (``target_ids`` is the next token of each position);
- ``loss_mask``: 1 where the position's loss counts (bool or 0/1 floats);
- ``slot_ids``: the slot whose adapter applies to each token, ``-1`` for base-only tokens;
- ``old_logprobs`` / ``advantages``: per-token fields the policy-gradient loss needs;
  ``ref_logprobs``: the reference (adapter-free base) model's log-probabilities, for its KL term;
- ``position_ids``: optional, ``arange(seq)`` per row when omitted (restarting at every segment
  when ``segment_ids`` is given);
- ``segment_ids``: optional, for packed rows: a segment is a run of equal ids along a row, and a
  token attends only to earlier tokens of its own segment, so several sequences share a row
  without seeing each other (the executor hands attention one THD stream with ``cu_seqlens``, no
  mask).  ``-1`` marks padding: left out of the stream, never attended to, never counted in a
  loss (whatever ``loss_mask`` says there), log-prob 0.  Positions (rotary and learned) restart
  at every segment.

Invariants (checked by :func:`mizzen_train.validation.check_batch` before any work starts):
- a row holds the tokens of at most one slot (its other tokens are ``-1``): attention mixes the
  tokens of a row, so two tenants in one row would exchange gradients;
- rows are slot-contiguous (all rows of one slot are adjacent), so the data-parallel and
  micro-batch cuts, which take contiguous row ranges, give each chunk few slots;
- rows divide evenly over the data-parallel ranks and then into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

#: Optional per-token tensor fields, in declaration order.
OPTIONAL_TOKEN_FIELDS = (
    "old_logprobs",
    "advantages",
    "position_ids",
    "segment_ids",
    "ref_logprobs",
)
#: The optional fields a loss may read (float per-token values), moved to the device with it.
LOSS_FIELDS = ("old_logprobs", "advantages", "ref_logprobs")


@dataclass(frozen=True)
class SlotBatch:
    input_ids: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    slot_ids: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def token_fields(self) -> dict[str, torch.Tensor]:
        """Every present tensor field by name."""
        present = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                present[spec.name] = value
        return present

    def select_rows(self, start: int, stop: int) -> SlotBatch:
        """The rows ``[start, stop)`` as a batch of their own (views, no copies)."""
        return replace(
            self, **{name: value[start:stop] for name, value in self.token_fields().items()}
        )

    def rows_for(self, dp_rank: int, dp_size: int) -> SlotBatch:
        """The contiguous chunk of rows data-parallel rank ``dp_rank`` of ``dp_size`` trains on."""
        per_rank = self.rows // dp_size
        return self.select_rows(dp_rank * per_rank, (dp_rank + 1) * per_rank)
