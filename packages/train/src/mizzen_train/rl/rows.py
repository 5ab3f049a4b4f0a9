"""RL's training rows: a step's scored samples as one slot-contiguous
:class:`~mizzen_train.batch.SlotBatch`, a row per sample, a segment per row.

:func:`tokenise_rows` turns ``[(tenant, {"sample", "advantage", "usable"}), ...]`` (the tenants'
rows in table order, each tenant's samples in group order) into :class:`StepRows`: the batch
(``input_ids``, ``target_ids``, ``loss_mask``, ``slot_ids``, ``advantages``, ``segment_ids``),
the engine's log-probabilities where it reported them, and which tenant owns each row.

Invariants:
- Row ``i`` holds sample ``i``: ``prompt + response`` shifted by one (``len - 1`` positions)
  from position 0, segment id 0 there and ``-1`` on the padding after it, so the executor's
  packed (THD) path hands attention each sample as its own sequence (``cu_seqlens``), positions
  restart at 0 for every sample, no token attends across samples or to padding, and padding is
  never computed nor counted in a loss.  A sample with fewer than two tokens is a row of
  padding (all ``-1``); with an empty prompt the first response token has no target position
  (nothing precedes it), so the loss covers the rest of the response.
- The loss mask covers the response tokens of usable samples only (their ``loss_mask``), the
  advantage is the sample's on those tokens (NaN for a tenant of ``nan_tenants``: the fault
  drill), the engine log-probs are known exactly where the sample carries them.
- The row width is the caller's, the same every step (one width for the whole run), so a
  tenant's rows are the same tensors whatever the other tenants generate; a sample longer
  than it is an error naming the cause.
- Pure: the same samples give the same tensors on every call (the writer builds them once a
  step and shares them with every rank).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mizzen_train.batch import SlotBatch

__all__ = ["StepRows", "padded_width", "tokenise_rows"]

#: The segment id of padding (:mod:`mizzen_train.batch`).
PADDING = -1


@dataclass(frozen=True)
class StepRows:
    """A step's rows (see the module docstring); picklable, so one broadcast shares it."""

    batch: SlotBatch
    engine_logprobs: torch.Tensor
    engine_known: torch.Tensor
    row_tenant: tuple[str, ...]
    #: Each tenant's rollout statistics (reward mean/std, lengths, samples, timings).
    stats: dict[str, dict[str, Any]]

    def rows_of(self, tenant: str) -> torch.Tensor:
        """``[rows]`` True for ``tenant``'s rows."""
        import torch

        return torch.tensor([name == tenant for name in self.row_tenant], dtype=torch.bool)

    def real_tokens(self) -> torch.Tensor:
        """``[rows, seq]`` True for the samples' tokens (segment id >= 0)."""
        assert self.batch.segment_ids is not None
        return self.batch.segment_ids >= 0


def padded_width(positions: int, context: int) -> int:
    """A row width of at least ``positions`` that context parallel ``context`` cuts into its
    ``2 * context`` chunks (``positions`` itself without context parallel)."""
    chunks = 2 * context if context > 1 else 1
    return -(-positions // chunks) * chunks


def tokenise_rows(
    rows: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    slot_of: Mapping[str, int],
    width: int,
    pad_id: int,
    stats: dict[str, dict[str, Any]],
    nan_tenants: Collection[str] = (),
) -> StepRows:
    """The rows of ``rows`` (see the module docstring); ``stats`` ride along unchanged."""
    import torch

    from mizzen_train.batch import SlotBatch

    n = len(rows)
    tensors = {
        "input_ids": torch.full((n, width), pad_id, dtype=torch.long),
        "target_ids": torch.full((n, width), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((n, width), dtype=torch.bool),
        "slot_ids": torch.zeros((n, width), dtype=torch.long),
        "advantages": torch.zeros((n, width), dtype=torch.float32),
        "segment_ids": torch.full((n, width), PADDING, dtype=torch.long),
    }
    engine = {
        "logprobs": torch.zeros((n, width), dtype=torch.float32),
        "known": torch.zeros((n, width), dtype=torch.bool),
    }
    for i, (name, row) in enumerate(rows):
        tensors["slot_ids"][i] = slot_of[name]
        _fill_row(tensors, engine, i, row, width=width, nan=name in nan_tenants)
    return StepRows(
        batch=SlotBatch(**tensors),
        engine_logprobs=engine["logprobs"],
        engine_known=engine["known"],
        row_tenant=tuple(name for name, _ in rows),
        stats=stats,
    )


def _fill_row(
    tensors: dict[str, torch.Tensor],
    engine: dict[str, torch.Tensor],
    i: int,
    row: Mapping[str, Any],
    *,
    width: int,
    nan: bool,
) -> None:
    """Row ``i`` from one sample: its tokens as segment 0, its loss and advantages."""
    import torch

    sample = row["sample"]
    prompt, response = list(sample.prompt_tokens), list(sample.response_tokens)
    seq = prompt + response
    length = len(seq) - 1
    if length < 1:  # nothing generated from nothing: a row of padding, no loss
        return
    if length > width:
        raise RuntimeError(
            f"a sample is {len(seq)} tokens, more than the {width + 1} the prompts and "
            "max_new_tokens allow; the engine tokenises differently from the trainer's tokenizer"
        )
    tensors["input_ids"][i, :length] = torch.tensor(seq[:-1])
    tensors["target_ids"][i, :length] = torch.tensor(seq[1:])
    tensors["segment_ids"][i, :length] = 0
    if not (row["usable"] and response):
        return
    # position j predicts token j + 1: response token k sits at position len(prompt) + k - 1,
    # so with an empty prompt the first response token is predicted by nothing (no target)
    first = 1 if not prompt else 0
    span = slice(len(prompt) - 1 + first, len(prompt) - 1 + len(response))
    tensors["loss_mask"][i, span] = torch.tensor(sample.loss_mask[first:], dtype=torch.bool)
    tensors["advantages"][i, span] = float("nan") if nan else row["advantage"]
    if sample.rollout_logprobs is not None:
        logprobs = sample.rollout_logprobs[first:]
        engine["logprobs"][i, span] = torch.tensor(logprobs, dtype=torch.float32)
        engine["known"][i, span] = True
