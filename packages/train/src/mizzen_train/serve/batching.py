"""Tinker data and losses as slot-executor batches: one tenant's datums become rows of its slot.

A Tinker ``Datum`` is ``model_input`` tokens ``x`` and per-position ``loss_fn_inputs`` of the same
length (``target_tokens`` ``y``: the next token of each position; ``weights``; ``logprobs``, the
sampler's; ``advantages``).  Position ``i`` of a row is input ``x[i]`` and target ``y[i]``, which
is the executor's :class:`~mizzen_train.batch.SlotBatch` contract, so a datum is one row.

The rules, one table (:data:`LOSSES`): which inputs each served loss needs, and which executor
loss it runs as.

- ``cross_entropy``: ``loss_mask = weights`` (non-negative), the executor's CrossEntropyLoss;
- ``importance_sampling``: ``loss_mask = 1``, ``old_logprobs = logprobs``; the executor's
  clipped surrogate with bounds so wide (ratio in [1e-6, 1e6+1]) that it is the unclipped
  ``-ratio * advantage`` wherever a sampler and a learner agree to within a factor of a million;
- ``ppo``: as above with ``clip_low_threshold`` / ``clip_high_threshold`` (defaults 0.8 / 1.2).

Invariants:
- A request is checked whole before anything runs: token ids inside the vocabulary, every
  input present with the datum's length, lengths within the model's context, a known loss --
  otherwise :class:`~mizzen_train.serve.wire.WireError` (400) naming ``data[i].field``.
  Non-finite float inputs are *not* refused: they are the tenant's own business, and the
  executor's isolation keeps them out of every other slot (a tenant test checks it bitwise).
- Rows are padded to a multiple of ``seq_bucket``; requests batch together only with equal padded
  lengths, so a tenant's rows are the same tensors whether it runs alone or with others.
- The reported ``loss:sum`` is Tinker's definition (a sum over tokens) computed from the
  per-token logprobs; the executor's gradient is its per-request mean over the loss mask (Adam
  is invariant to that scale; ``grad_clip_norm`` applies to the mean's gradient).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mizzen_train.serve.wire import WireError, check_token_ids

__all__ = ["LOSSES", "TenantRows", "build_rows", "join_rows", "loss_sums"]

#: served loss -> the loss_fn_inputs it needs
LOSSES: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
IS_CLIP_LOW, IS_CLIP_HIGH = 1.0 - 1e-6, 1e6


@dataclass(frozen=True)
class TenantRows:
    """One request's rows for one slot (numpy, unpadded) and its executor loss."""

    slot: int
    loss_fn: str
    clip: tuple[float, float]
    inputs: tuple[np.ndarray, ...]
    targets: tuple[np.ndarray, ...]
    mask: tuple[np.ndarray, ...]
    old_logprobs: tuple[np.ndarray, ...]
    advantages: tuple[np.ndarray, ...]
    padded_len: int

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.inputs)


def build_rows(
    data: Sequence[Any],
    loss_fn: str,
    config: Mapping[str, Any] | None,
    *,
    slot: int,
    vocab_size: int,
    max_seq_len: int,
    seq_bucket: int,
    forward_only: bool = False,
) -> TenantRows:
    """The rows of ``data`` (SDK ``Datum`` objects) for ``slot``; WireError(400) when invalid."""
    if loss_fn not in LOSSES:
        raise WireError(400, f"loss_fn {loss_fn!r} is not served. Fix: use one of {sorted(LOSSES)}")
    if not data:
        raise WireError(400, "data: empty. Fix: send at least one Datum")
    clip = _clip(loss_fn, config or {})
    needed = ("target_tokens",) if forward_only else LOSSES[loss_fn]
    rows: dict[str, list[np.ndarray]] = {k: [] for k in ("x", "y", "m", "old", "adv")}
    for index, datum in enumerate(data):
        _one_row(index, datum, needed, loss_fn, vocab_size, max_seq_len, rows)
    longest = max(len(row) for row in rows["x"])
    padded = min(max_seq_len, math.ceil(longest / seq_bucket) * seq_bucket)
    if not forward_only and loss_fn == "cross_entropy" and sum(m.sum() for m in rows["m"]) <= 0:
        raise WireError(
            400,
            "loss_fn_inputs.weights: all zero, nothing to train. Fix: use forward() for logprobs",
        )
    return TenantRows(
        slot, loss_fn, clip, *(tuple(rows[k]) for k in ("x", "y", "m", "old", "adv")), padded
    )


def _clip(loss_fn: str, config: Mapping[str, Any]) -> tuple[float, float]:
    if loss_fn != "ppo":
        if config:
            raise WireError(400, f"loss_fn_config: {loss_fn} takes none. Fix: leave it out")
        return IS_CLIP_LOW, IS_CLIP_HIGH
    unknown = sorted(set(config) - {"clip_low_threshold", "clip_high_threshold"})
    if unknown:
        raise WireError(400, f"loss_fn_config.{unknown[0]}: not a ppo setting")
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    if not (isinstance(low, float) and isinstance(high, float) and 0 < low < 1 < high < 1e6):
        raise WireError(
            400, "loss_fn_config: need 0 < clip_low_threshold < 1 < clip_high_threshold"
        )
    return 1.0 - low, high - 1.0


def _one_row(index, datum, needed, loss_fn, vocab_size, max_seq_len, rows) -> None:
    where = f"data[{index}]"
    tokens = np.asarray(datum.model_input.to_ints(), dtype=np.int64)
    length = len(tokens)
    if not 1 <= length <= max_seq_len:
        raise WireError(
            400, f"{where}.model_input: {length} tokens; the model takes 1..{max_seq_len}"
        )
    inputs = datum.loss_fn_inputs
    for name in needed:
        if name not in inputs:
            raise WireError(
                400, f"{where}.loss_fn_inputs.{name}: missing; {loss_fn} needs {list(needed)}"
            )
    arrays = {name: np.asarray(value.to_numpy()).reshape(-1) for name, value in inputs.items()}
    for name, array in arrays.items():
        if array.shape[0] != length:
            raise WireError(
                400, f"{where}.loss_fn_inputs.{name}: {array.shape[0]} values for {length} tokens"
            )
    raw_targets = arrays["target_tokens"]
    targets = raw_targets.astype(np.int64)
    if raw_targets.dtype.kind == "f" and not np.array_equal(targets, raw_targets):
        raise WireError(400, f"{where}.loss_fn_inputs.target_tokens: not whole numbers. Fix: "
                             "send token ids (int64)")  # fmt: skip
    for name, ids in (("model_input", tokens), ("loss_fn_inputs.target_tokens", targets)):
        check_token_ids(f"{where}.{name}", ids, vocab_size)
    weights = arrays.get("weights", np.ones(length)).astype(np.float32)
    if loss_fn == "cross_entropy" and np.isfinite(weights).all() and (weights < 0).any():
        raise WireError(400, f"{where}.loss_fn_inputs.weights: negative. Fix: weights >= 0")
    zeros = np.zeros(length, dtype=np.float32)
    rows["x"].append(tokens)
    rows["y"].append(targets)
    rows["m"].append(weights if loss_fn == "cross_entropy" else np.ones(length, np.float32))
    rows["old"].append(arrays.get("logprobs", zeros).astype(np.float32))
    rows["adv"].append(arrays.get("advantages", zeros).astype(np.float32))


def join_rows(parts: Sequence[TenantRows], micro_batch_size: int):
    """One :class:`~mizzen_train.batch.SlotBatch` of several tenants' rows (equal padded length;
    filler rows of slot -1 make the row count a multiple of ``micro_batch_size``) and the
    per-slot executor losses."""
    import torch

    from mizzen_train.batch import SlotBatch
    from mizzen_train.losses import ClippedPolicyGradientLoss, CrossEntropyLoss

    seq = parts[0].padded_len
    count = sum(len(p.inputs) for p in parts)
    rows = count + (-count) % micro_batch_size
    tensors = {
        "input_ids": torch.zeros(rows, seq, dtype=torch.int64),
        "target_ids": torch.zeros(rows, seq, dtype=torch.int64),
        "loss_mask": torch.zeros(rows, seq, dtype=torch.float32),
        "slot_ids": torch.full((rows, seq), -1, dtype=torch.int64),
        "old_logprobs": torch.zeros(rows, seq, dtype=torch.float32),
        "advantages": torch.zeros(rows, seq, dtype=torch.float32),
    }
    losses = {}
    row = 0
    for part in parts:
        for x, y, m, old, adv in zip(
            part.inputs, part.targets, part.mask, part.old_logprobs, part.advantages, strict=True
        ):
            n = len(x)
            tensors["input_ids"][row, :n] = torch.from_numpy(x)
            tensors["target_ids"][row, :n] = torch.from_numpy(y)
            tensors["loss_mask"][row, :n] = torch.from_numpy(m)
            tensors["slot_ids"][row, :] = part.slot
            tensors["old_logprobs"][row, :n] = torch.from_numpy(old)
            tensors["advantages"][row, :n] = torch.from_numpy(adv)
            row += 1
        if part.loss_fn == "cross_entropy":
            losses[part.slot] = CrossEntropyLoss()
        else:
            losses[part.slot] = ClippedPolicyGradientLoss(
                clip_low=part.clip[0], clip_high=part.clip[1]
            )
    return SlotBatch(**tensors), losses


def loss_sums(part: TenantRows, logprobs: Sequence[np.ndarray]) -> dict[str, float]:
    """Tinker's metrics of one request from its per-row target logprobs (before the step)."""
    total = 0.0
    for lp, m, old, adv in zip(
        logprobs, part.mask, part.old_logprobs, part.advantages, strict=True
    ):
        lp = lp.astype(np.float64)
        if part.loss_fn == "cross_entropy":
            total += float(-(m * lp).sum())
            continue
        ratio = np.exp(lp - old)
        clipped = np.clip(ratio, 1.0 - part.clip[0], 1.0 + part.clip[1])
        total += float(-np.minimum(ratio * adv, clipped * adv).sum())
    return {"loss:sum": total}
