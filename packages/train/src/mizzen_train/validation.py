"""Registration-time rules of the slot executor: fail fast, name the field, say why.

Every check runs before the operation changes any state or starts any collective.  Every rank
receives the same request, so every rank raises the same :class:`SlotConfigError` at the same
point and the executor stays usable (see :mod:`mizzen_train.errors`).

Rules that exist for a reason beyond "out of range" carry it in the message:

- ``fp16`` is refused: fp16 training needs one dynamic loss scale for the whole model, so one
  tenant's overflow would skip or rescale every other tenant's step.  Use bf16 (or fp32).
- the distributed optimizer is refused: it reduce-scatters the whole gradient buffer and
  all-gathers all parameters on every step, while slots accumulate gradients across calls and
  step independently (a slot that is not stepping must keep its pending gradients untouched).
- overlapped grad reduction is refused: it launches the data-parallel reduction at the end of
  every forward_backward, but a slot's gradients are reduced once, when that slot steps.
- a model-wide ``finalize_model_grads_func`` is refused for the same reason.
- sequence parallelism is refused: the LoRA branch of a column-parallel layer needs the
  full-sequence input, which sequence parallelism shards.
- pipeline and context parallelism are refused for now: forward_backward drives megatron's
  no-pipelining schedule only.
- a batch row may hold one slot's tokens only, and rows must divide over the data-parallel ranks
  and then into micro-batches (see :mod:`mizzen_train.batch`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from mizzen_train.batch import SlotBatch
from mizzen_train.errors import SlotConfigError
from mizzen_train.losses import ClippedPolicyGradientLoss, CrossEntropyLoss
from mizzen_train.specs import (
    LORA_INITS,
    MAX_LORA_SEED,
    AdamParams,
    ExecutorConfig,
    LoraSlotSpec,
)

#: Loss functions the executor knows how to run.
SUPPORTED_LOSSES = (CrossEntropyLoss, ClippedPolicyGradientLoss)


def _positive_int(field: str, value: Any, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SlotConfigError(field, value, "must be a positive integer", fix)


def _positive_finite(field: str, value: Any, fix: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise SlotConfigError(field, value, "must be a finite number > 0", fix)


# -- executor construction --------------------------------------------------------------------


def check_executor_config(config: ExecutorConfig) -> None:
    _positive_int("num_slots", config.num_slots, "give the number of slots the pool holds (>= 1)")
    _positive_int("max_rank", config.max_rank, "give the largest LoRA rank a slot may use (>= 1)")
    _positive_int(
        "micro_batch_size", config.micro_batch_size, "give rows per micro-batch per DP rank (>= 1)"
    )
    targets = config.target_modules
    if (
        isinstance(targets, str)
        or not targets
        or not all(isinstance(name, str) and name for name in targets)
    ):
        raise SlotConfigError(
            "target_modules",
            targets,
            "must be a non-empty sequence of module names",
            "e.g. ('linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2')",
        )
    if len(set(targets)) != len(targets):
        raise SlotConfigError(
            "target_modules", targets, "names must be unique", "list each name once"
        )
    if config.use_distributed_optimizer:
        raise SlotConfigError(
            "use_distributed_optimizer",
            True,
            "the distributed optimizer reduce-scatters every gradient and all-gathers every "
            "parameter on each step, but slots step independently and keep pending gradients",
            "set use_distributed_optimizer=False (each slot keeps fp32 masters and Adam state)",
        )
    if config.overlap_grad_reduce:
        raise SlotConfigError(
            "overlap_grad_reduce",
            True,
            "overlapped reduction all-reduces gradients at the end of every forward_backward, "
            "but a slot's gradients are reduced once, when that slot steps",
            "set overlap_grad_reduce=False",
        )


def check_model_config(model_config: Any) -> None:
    """Rules on the megatron ``TransformerConfig`` of the model the executor wraps."""
    if getattr(model_config, "fp16", False):
        raise SlotConfigError(
            "fp16",
            True,
            "fp16 needs one dynamic loss scale for the whole model, so one tenant's overflow "
            "would skip or rescale every other tenant's step",
            "build the model with bf16=True, params_dtype=torch.bfloat16 (or fp32)",
        )
    if model_config.params_dtype not in (torch.bfloat16, torch.float32):
        raise SlotConfigError(
            "params_dtype",
            model_config.params_dtype,
            "slot adapters support bf16 or fp32 weights",
            "use params_dtype=torch.bfloat16 (GPU) or torch.float32 (CPU tests)",
        )
    if getattr(model_config, "sequence_parallel", False):
        raise SlotConfigError(
            "sequence_parallel",
            True,
            "the LoRA branch of a column-parallel layer needs the full-sequence input, which "
            "sequence parallelism shards",
            "set sequence_parallel=False",
        )
    for field in ("pipeline_model_parallel_size", "context_parallel_size"):
        size = getattr(model_config, field, 1)
        if size != 1:
            raise SlotConfigError(
                field,
                size,
                "forward_backward drives megatron's no-pipelining schedule only",
                f"set {field}=1",
            )
    if getattr(model_config, "finalize_model_grads_func", None) is not None:
        raise SlotConfigError(
            "finalize_model_grads_func",
            model_config.finalize_model_grads_func,
            "a model-wide finalize would all-reduce every slot's pending gradients after each "
            "forward_backward; each slot reduces its own when it steps",
            "leave finalize_model_grads_func=None",
        )


# -- slot requests -----------------------------------------------------------------------------


def check_slot_index(slot: Any, *, num_slots: int, field: str = "slot") -> None:
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < num_slots:
        raise SlotConfigError(
            field, slot, f"must be a slot index in [0, {num_slots})", "use a slot of this pool"
        )


def check_slot_request(
    slot: Any,
    spec: LoraSlotSpec,
    *,
    num_slots: int,
    max_rank: int,
    loaded_slots: Collection[int],
) -> None:
    check_slot_index(slot, num_slots=num_slots)
    if slot in loaded_slots:
        raise SlotConfigError(
            "slot", slot, "slot is in use", f"unload_slot({slot}) first or pick a free slot"
        )
    rank = spec.rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise SlotConfigError(
            "rank",
            rank,
            f"must be an integer in [1, max_rank={max_rank}]",
            "lower the rank or build the executor with a larger max_rank",
        )
    _positive_finite("alpha", spec.alpha, "give a positive LoRA alpha (delta scale alpha/rank)")
    if spec.init not in LORA_INITS:
        raise SlotConfigError("init", spec.init, "unknown initialiser", f"use one of {LORA_INITS}")
    seed = spec.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_LORA_SEED:
        raise SlotConfigError(
            "seed", seed, f"must be an integer in [0, {MAX_LORA_SEED}]", "pass e.g. seed=0"
        )


def check_adapter_weights(
    weights: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]
) -> None:
    """Imported full adapter tensors: exactly the expected names, true-rank shapes, finite."""
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if missing or unknown:
        raise SlotConfigError(
            "weights",
            f"missing={missing[:4]} unknown={unknown[:4]}",
            "must hold exactly one A and one B per slotted layer",
            f"provide tensors named like {next(iter(expected))!r}",
        )
    for name, shape in expected.items():
        tensor = weights[name]
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise SlotConfigError(
                f"weights[{name!r}]", got, f"must have the full true-rank shape {shape}", "reshape"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise SlotConfigError(
                f"weights[{name!r}]", "non-finite", "must be finite", "fix the adapter"
            )


def check_adam_requests(
    requests: Mapping[Any, AdamParams], *, num_slots: int, loaded_slots: Collection[int]
) -> None:
    for slot, params in requests.items():
        field = f"adam_params[{slot!r}]"
        check_slot_index(slot, num_slots=num_slots, field=field)
        if slot not in loaded_slots:
            raise SlotConfigError(field, slot, "slot is not loaded", f"load_slot({slot}) first")
        if not isinstance(params, AdamParams):
            raise SlotConfigError(field, params, "must be an AdamParams", "pass AdamParams(lr=...)")
        _positive_finite(f"{field}.lr", params.lr, "give a learning rate > 0")
        betas = params.betas
        if (
            not isinstance(betas, tuple | list)
            or len(betas) != 2
            or not all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise SlotConfigError(
                f"{field}.betas", betas, "must be two numbers in [0, 1)", "e.g. (0.9, 0.999)"
            )
        _positive_finite(f"{field}.eps", params.eps, "give eps > 0, e.g. 1e-8")
        wd = params.weight_decay
        if (
            isinstance(wd, bool)
            or not isinstance(wd, int | float)
            or not math.isfinite(wd)
            or wd < 0
        ):
            raise SlotConfigError(
                f"{field}.weight_decay", wd, "must be a finite number >= 0", "e.g. 0.0 or 0.01"
            )
        if params.max_grad_norm is not None:
            _positive_finite(
                f"{field}.max_grad_norm", params.max_grad_norm, "give a norm > 0, or None"
            )


# -- batches -----------------------------------------------------------------------------------


def check_batch(
    batch: Any,
    *,
    dp_size: int,
    micro_batch_size: int,
    num_slots: int,
    loaded_slots: Collection[int],
    vocab_size: int,
    max_sequence_length: int,
) -> list[int]:
    """Shape, dtype and slot rules of a forward_backward batch; returns each row's slot."""
    if not isinstance(batch, SlotBatch):
        raise SlotConfigError("batch", type(batch), "must be a SlotBatch", "wrap the tensors")
    shape = tuple(batch.input_ids.shape) if isinstance(batch.input_ids, torch.Tensor) else None
    for name, tensor in batch.token_fields().items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise SlotConfigError(
                f"batch.{name}", type(tensor), "must be a 2-D tensor [rows, seq]", "reshape"
            )
        if tuple(tensor.shape) != shape:
            raise SlotConfigError(
                f"batch.{name}",
                tuple(tensor.shape),
                f"must match batch.input_ids {shape}",
                "give every field the same [rows, seq] shape",
            )
        if tensor.device.type != "cpu":
            raise SlotConfigError(
                f"batch.{name}",
                str(tensor.device),
                "batches arrive as host tensors (routing is planned on the host)",
                "pass CPU tensors; the executor moves them to the device",
            )
    for name in ("input_ids", "target_ids", "slot_ids", "position_ids", "segment_ids"):
        tensor = getattr(batch, name)
        if tensor is not None and (tensor.dtype.is_floating_point or tensor.dtype == torch.bool):
            raise SlotConfigError(
                f"batch.{name}", tensor.dtype, "must be an integer tensor", "use torch.long"
            )
    rows, seq = shape
    if seq > max_sequence_length:
        raise SlotConfigError(
            "batch.seq_len",
            seq,
            f"exceeds the model's max_sequence_length={max_sequence_length}",
            "shorten the rows",
        )
    for name in ("input_ids", "target_ids"):
        tensor = getattr(batch, name)
        if rows and (int(tensor.min()) < 0 or int(tensor.max()) >= vocab_size):
            raise SlotConfigError(
                f"batch.{name}",
                (int(tensor.min()), int(tensor.max())),
                f"token ids must lie in [0, vocab_size={vocab_size})",
                "fix the tokenisation",
            )
    if rows == 0 or rows % dp_size != 0:
        raise SlotConfigError(
            "batch.rows",
            rows,
            f"must be a positive multiple of the data-parallel size {dp_size}",
            f"pad or trim the batch to a multiple of {dp_size} rows",
        )
    if (rows // dp_size) % micro_batch_size != 0:
        raise SlotConfigError(
            "batch.rows",
            rows,
            f"rows per data-parallel rank ({rows // dp_size}) must be a multiple of "
            f"micro_batch_size={micro_batch_size}",
            f"send a multiple of {dp_size * micro_batch_size} rows",
        )

    slot_ids = batch.slot_ids
    low, high = int(slot_ids.min()), int(slot_ids.max())
    if low < -1 or high >= num_slots:
        raise SlotConfigError(
            "batch.slot_ids",
            (low, high),
            f"slot ids must lie in [-1, {num_slots}) (-1 = base only)",
            "route tokens to slots of this pool",
        )
    row_slots: list[int] = []
    for row in range(rows):
        present = torch.unique(slot_ids[row]).tolist()
        slots = [s for s in present if s >= 0]
        if len(slots) > 1:
            raise SlotConfigError(
                "batch.slot_ids",
                f"row {row} holds slots {slots}",
                "a row may hold one slot's tokens (others -1): attention mixes a row's tokens, "
                "so two tenants in one row would exchange gradients",
                "put each tenant's sequences in rows of their own",
            )
        row_slots.append(slots[0] if slots else -1)
    seen: list[int] = []
    for slot in row_slots:
        if slot >= 0 and (not seen or seen[-1] != slot):
            if slot in seen:
                raise SlotConfigError(
                    "batch.slot_ids",
                    f"rows of slot {slot} are not adjacent (row order {row_slots})",
                    "batches are slot-contiguous",
                    "sort the rows by slot",
                )
            seen.append(slot)
    for slot in seen:
        if slot not in loaded_slots:
            raise SlotConfigError(
                "batch.slot_ids", slot, "routes tokens to a slot that is not loaded", "load it"
            )
    if batch.loss_mask.dtype != torch.bool and not batch.loss_mask.dtype.is_floating_point:
        raise SlotConfigError(
            "batch.loss_mask", batch.loss_mask.dtype, "must be bool or float", "use torch.bool"
        )
    return row_slots


def resolve_losses(
    loss_fn: Any, slots: Sequence[int], batch: SlotBatch
) -> dict[int, CrossEntropyLoss | ClippedPolicyGradientLoss]:
    """One supported loss per slot of the batch, from a single loss or a ``{slot: loss}`` map."""
    if isinstance(loss_fn, Mapping):
        per_slot = {}
        for slot in slots:
            if slot not in loss_fn:
                raise SlotConfigError(
                    "loss_fn",
                    sorted(loss_fn),
                    f"has no loss for slot {slot}, which the batch uses",
                    "give a loss for every slot in the batch",
                )
            per_slot[slot] = loss_fn[slot]
        fields = {slot: f"loss_fn[{slot}]" for slot in slots}
    else:
        per_slot = dict.fromkeys(slots, loss_fn)
        fields = dict.fromkeys(slots, "loss_fn")
    for slot, loss in per_slot.items():
        if not isinstance(loss, SUPPORTED_LOSSES):
            raise SlotConfigError(
                fields[slot],
                loss,
                "unsupported loss function",
                "use CrossEntropyLoss() or ClippedPolicyGradientLoss(...)",
            )
        if isinstance(loss, ClippedPolicyGradientLoss):
            for name in ("clip_low", "clip_high"):
                _positive_finite(f"{fields[slot]}.{name}", getattr(loss, name), "e.g. 0.2")
            kl = loss.kl_coef
            if (
                isinstance(kl, bool)
                or not isinstance(kl, int | float)
                or not kl >= 0
                or kl == float("inf")
            ):
                raise SlotConfigError(
                    f"{fields[slot]}.kl_coef", kl, "must be a finite number >= 0", "e.g. 0.05"
                )
            if loss.clip_low >= 1.0:
                raise SlotConfigError(
                    f"{fields[slot]}.clip_low",
                    loss.clip_low,
                    "must be < 1 (the ratio's lower bound is 1 - clip_low > 0)",
                    "e.g. 0.2",
                )
        for name in loss.requires:
            tensor = getattr(batch, name)
            if tensor is None or not tensor.dtype.is_floating_point:
                raise SlotConfigError(
                    f"batch.{name}",
                    None if tensor is None else tensor.dtype,
                    f"{type(loss).__name__} (slot {slot}) needs a float tensor [rows, seq]",
                    f"fill batch.{name}",
                )
    return per_slot
