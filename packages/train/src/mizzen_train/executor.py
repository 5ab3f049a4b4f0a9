"""The slot executor: one base model, K LoRA slots, four operations, no cross-tenant effects.

:class:`SlotExecutor` wraps a megatron-core GPT (local layer spec) built on every rank of the job.
It freezes the base, wraps the target linears with :class:`~mizzen_train.lora.SlottedLoRALinear`
and then serves, on every rank in the same order:

- :meth:`~SlotExecutor.load_slot` — initialise (or import) one slot's adapter, give it its own
  megatron ``DistributedDataParallel`` (an fp32 ``main_grad`` buffer, zeroed) and its own
  :class:`~mizzen_train.slot_optimizer.SlotOptimizer` (fp32 masters and Adam moments).
- :meth:`~SlotExecutor.unload_slot` — detach the slot and free all of its memory.
- :meth:`~SlotExecutor.forward_backward` — one forward/backward over a batch that may carry
  several slots' rows; gradients accumulate per slot until that slot steps.  The loss is chosen
  per request (or per slot): SFT cross-entropy or the clipped policy-gradient loss.  On CUDA the
  micro-batches run through megatron's ``get_forward_backward_func()`` schedule; on a CPU
  (tests) through the same forward step and loss in a plain loop, because megatron's schedules
  allocate on ``"cuda"``.
- :meth:`~SlotExecutor.optim_step` — :func:`~mizzen_train.slot_optimizer.step_slot_optimizers`
  over ``{slot: AdamParams}``.

Model inputs.  Every micro-batch becomes one packed stream: its real tokens (segment id >= 0; every
token of unsegmented rows), ``input_ids`` ``[1, T]``, positions restarting per segment, and a
:class:`~mizzen_train.packed_attention.PackedStream` (megatron's ``PackedSeqParams``,
``qkv_format="thd"``, ``cu_seqlens``) as ``packed_seq_params``; the model's
:class:`~mizzen_train.packed_attention.PackedCoreAttention` runs document-causal attention over it.
A micro-batch holding several slots is routed per run of the stream
(:mod:`mizzen_train.routing`): padding is never computed, whatever the slots.  No dense mask is
built anywhere.

Context parallel (``parallel_state``'s CP size ``C > 1``): the stream is padded and cut into
``2C`` chunks, rank ``r`` holding chunks ``r`` and ``2C-1-r``
(:func:`mizzen_plugins.context_parallel.shard_packed_stream`, load-balanced); keys and values are
all-gathered (their gradients returned to their owners), each rank's loss covers its tokens, the
loss report sums over data-parallel x context-parallel ranks and so do the slots' gradients
(megatron's DDP reduces over that group); the routing is built on each rank's share of the
stream, so a micro-batch may hold several slots under CP too.

Packing: :attr:`SlotLossReport.packing_efficiency` (per slot) and :attr:`SlotExecutor.last_packing`
(the request) give real tokens over token slots.

plus :meth:`~SlotExecutor.forward_logprobs` (forward only: target log-probabilities, e.g. the
``old_logprobs`` of an RL request), :meth:`~SlotExecutor.forward_backward_logprobs` (a
``forward_backward`` that also returns the target log-probabilities of its own forward: what
``forward_logprobs`` would have returned just before it, without a second forward pass) and
:meth:`~SlotExecutor.save_slot` / :meth:`~SlotExecutor.restore_slot` (see
:mod:`mizzen_train.checkpoint`).

Loss scaling: slot ``k``'s loss is the mean over its loss-masked tokens of the *whole* request
(every rank sees the whole batch, so the count needs no collective), each data-parallel rank sums
its rows' share, and the per-slot DDP sums over ranks (``calculate_per_token_loss=True`` makes
megatron neither average over micro-batches nor over ranks).  The result is the exact gradient of
the request's per-slot mean, at any data-parallel size and micro-batch count.

Failure policy.  Request errors (:class:`~mizzen_train.errors.SlotConfigError`) are raised by
validation before anything changes, identically on every rank, and leave the executor usable.
Checkpoint errors are agreed on over all ranks before they are raised, so they leave it usable
too.  *Any other exception marks the executor failed*, and every later call raises
:class:`~mizzen_train.errors.ExecutorFailedError` until the executor is rebuilt (a fresh model and
executor, slots restored from their checkpoints).  Why: operations are sequences of collectives.
A rank that raises part-way stops issuing them while its peers continue, so the next collective
pairs mismatched calls (wrong data or a hang); and the failing rank may hold a half-applied state
(gradients partly accumulated, masters stepped but not published).  Neither can be repaired
locally, and continuing would silently corrupt other tenants' slots.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from mizzen_train import checkpoint
from mizzen_train.batch import LOSS_FIELDS, SlotBatch
from mizzen_train.errors import ExecutorFailedError, SlotCheckpointError, SlotConfigError
from mizzen_train.lora import SlotAdapter, adapter_layout, apply_slotted_lora
from mizzen_train.losses import TokenLoss, target_logprobs
from mizzen_train.packed_attention import PackedCoreAttention, PackedStream, packed_stream
from mizzen_train.routing import RoutingState, SlotRouting, build_routing
from mizzen_train.slot_optimizer import SlotOptimizer, StepReport, step_slot_optimizers
from mizzen_train.specs import AdamParams, ExecutorConfig, LoraSlotSpec
from mizzen_train.validation import (
    check_adam_requests,
    check_adapter_weights,
    check_batch,
    check_executor_config,
    check_model_config,
    check_slot_index,
    check_slot_request,
    resolve_losses,
)


@dataclass(frozen=True)
class SlotLossReport:
    """One slot's share of a forward_backward request (global over data-parallel ranks)."""

    slot: int
    #: Mean per-token loss over the slot's loss-masked tokens of the request.
    loss: float
    num_tokens: int
    #: Means of the loss's per-token metrics (e.g. ``clip_fraction``), same weighting.
    metrics: dict[str, float] = field(default_factory=dict)
    #: Real tokens / token slots of the slot's rows in the request (1.0 for unsegmented rows).
    packing_efficiency: float = 1.0


@dataclass
class _LoadedSlot:
    spec: LoraSlotSpec
    adapter: SlotAdapter
    grad_sync: DistributedDataParallel
    optimizer: SlotOptimizer


@dataclass
class _ModelInputs:
    #: ``[1, T]``: the packed stream of the micro-batch's real tokens (this CP rank's share).
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    packed: PackedStream
    routing: SlotRouting | None
    #: Host ``[T]`` index into the micro-batch's flattened ``[b * s + 1]`` tokens (``b * s``: the
    #: context-parallel pad sentinel) of every stream token.
    gather: torch.Tensor
    #: Real (non-padding) tokens of the micro-batch (before any context-parallel split).
    real_tokens: int
    #: Host ``[real_tokens]`` row-major index of the whole stream's tokens into ``[b * s]``.
    stream_index: torch.Tensor

    def take(self, tensor: torch.Tensor, fill: float | int | bool = 0) -> torch.Tensor:
        """A host ``[b, s]`` tensor laid out like the model input (pads hold ``fill``)."""
        flat = tensor.reshape(-1)
        flat = torch.cat([flat, flat.new_full((1,), fill)])
        return flat.index_select(0, self.gather).view(1, -1)


@dataclass
class _MicroBatch:
    #: The micro-batch's rows as the request gave them (shape of the log-probs it returns).
    rows: SlotBatch
    inputs: _ModelInputs
    #: loss_mask / (slot's token count in the request); 0 for base-only or unmasked tokens.
    weights: torch.Tensor
    #: Index of each token's slot in the request's slot list; len(slots) for none.
    bins: torch.Tensor
    #: (loss, bool selector shaped like the model input) per distinct loss of the slots.
    losses: list[tuple[TokenLoss, torch.Tensor]]
    fields: dict[str, torch.Tensor]
    num_tokens: torch.Tensor
    #: Whether any real token of the whole micro-batch (every CP rank's share) is a slot's: the
    #: same answer on every CP rank, so they all run it or all skip it.
    trains: bool


def real_token_mask(rows: SlotBatch) -> torch.Tensor:
    """``[b, s]`` True for real tokens: segment id >= 0 (every token when rows are unsegmented)."""
    if rows.segment_ids is None:
        return torch.ones(rows.input_ids.shape, dtype=torch.bool)
    return rows.segment_ids >= 0


def stream_segments(rows: SlotBatch, real: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Row-major index of the real tokens and the lengths of their segments, in stream order.

    A segment is a run of one row's tokens with one segment id (a whole row when unsegmented);
    segments never span rows."""
    index = torch.nonzero(real.reshape(-1)).flatten()
    if index.numel() == 0:
        return index, []
    row = torch.div(index, rows.seq_len, rounding_mode="floor")
    if rows.segment_ids is None:
        key = row
    else:
        segments = rows.segment_ids.reshape(-1).index_select(0, index)
        key = row * (int(rows.segment_ids.max()) + 1) + segments
    _, counts = torch.unique_consecutive(key, return_counts=True)
    return index, counts.tolist()


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 where the segment id changes along each row."""
    rows, seq_len = segment_ids.shape
    index = torch.arange(seq_len).expand(rows, -1)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(start_index, dim=1).values


@dataclass(frozen=True)
class PackingReport:
    """How full a request's rows were: real tokens (segment id >= 0) over token slots."""

    real_tokens: int
    slots: int

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.slots if self.slots else 0.0


class SlotExecutor:
    """K LoRA slots on one frozen megatron-core GPT (see the module docstring)."""

    #: Context parallel splits each packed stream over the CP ranks (``_stream_inputs``).
    SUPPORTS_CONTEXT_PARALLEL = True

    def __init__(self, model: torch.nn.Module, config: ExecutorConfig) -> None:
        check_executor_config(config)
        model_config = model.config
        check_model_config(model_config)
        _check_packed_attention(model)
        self.model = model
        self.config = config
        first_param = next(model.parameters())
        self.device = first_param.device
        self.dtype = model_config.params_dtype
        self._routing = RoutingState()
        # validates every target before it wraps any: a refusal leaves the model untouched
        self.layers = apply_slotted_lora(
            model, config.target_modules, max_rank=config.max_rank, routing=self._routing
        )
        for param in model.parameters():
            param.requires_grad_(False)
        # Per-slot means are formed in the loss; megatron must then sum, not average, over
        # micro-batches and data-parallel ranks.
        model_config.calculate_per_token_loss = True
        model.train()
        self.layout = adapter_layout(self.layers)
        self._slots: dict[int, _LoadedSlot] = {}
        self._failure: str | None = None
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        if self.cp_size > 1:
            _activations_always_require_grad(model)
        #: Packing of the last forward_backward request (all its rows).
        self.last_packing: PackingReport | None = None
        #: Attention kernel (:data:`mizzen_train.packed_attention.IMPLS`); None = by device:
        #: the fast kernels on CUDA, the reference loop on the CPU.
        self.attention_impl: str | None = None

    # -- failure policy -------------------------------------------------------------------------

    @property
    def failed(self) -> str | None:
        """Why the executor refuses work (None while it is usable)."""
        return self._failure

    def _check_usable(self, operation: str) -> None:
        if self._failure is not None:
            raise ExecutorFailedError(
                f"{operation} refused: the executor failed earlier ({self._failure}). A failure "
                "part-way through an operation leaves ranks out of step in their collectives and "
                "slot state possibly half-updated; rebuild the model and executor on every rank "
                "and restore the slots with restore_slot() from their checkpoints."
            )

    @contextlib.contextmanager
    def _mutating(self, operation: str, *, agreed: tuple[type[BaseException], ...] = ()):
        """Run the state-changing part of an operation; any unagreed exception fails us."""
        try:
            yield
        except agreed:
            raise
        except BaseException as exc:
            self._failure = f"{operation}: {type(exc).__name__}: {exc}"
            raise

    # -- introspection --------------------------------------------------------------------------

    @property
    def loaded_slots(self) -> tuple[int, ...]:
        return tuple(sorted(self._slots))

    def slot_spec(self, slot: int) -> LoraSlotSpec:
        return self._loaded(slot, "slot").spec

    def adapter_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Full true-rank shape of every factor a slot of ``rank`` imports or exports, by name."""
        return {factor.name: factor.true_rank_shape(rank) for factor in self.layout}

    def trainable_parameters_per_slot(self) -> int:
        """Parameters one slot trains on this rank (its local shards, padding included)."""
        return sum(math.prod(factor.local_shape) for factor in self.layout)

    def slot_memory_bytes(self, slot: int) -> dict[str, int]:
        """Bytes this rank holds for one slot, by owner (weights, fp32 grads, masters, Adam)."""
        record = self._loaded(slot, "slot")
        opt = record.optimizer
        grads = sum(
            buffer.grad_data.numel() * buffer.grad_data.element_size()
            for buffer in record.grad_sync.buffers
        )
        return {
            "weights": record.adapter.storage.numel() * record.adapter.storage.element_size(),
            "grads": grads,
            "masters": opt.master_storage.numel() * 4,
            "adam": (opt.exp_avg_storage.numel() + opt.exp_avg_sq_storage.numel()) * 4,
        }

    def inspect_slot(self, slot: int) -> dict[str, Any]:
        """Host copies of one slot's local tensors, by factor name: ``weight``, ``master``,
        ``exp_avg``, ``exp_avg_sq``, ``grad`` (pending fp32 gradient), and ``step``."""
        record = self._loaded(slot, "slot")
        opt = record.optimizer
        names = [factor.name for factor in self.layout]
        per_param = {
            "weight": [p.detach() for p in record.adapter.parameters_in_order()],
            "master": opt.masters,
            "exp_avg": opt.exp_avg,
            "exp_avg_sq": opt.exp_avg_sq,
            "grad": opt.grads(),
        }
        state: dict[str, Any] = {
            entry: {
                name: t.detach().to("cpu", copy=True)
                for name, t in zip(names, tensors, strict=True)
            }
            for entry, tensors in per_param.items()
        }
        state["step"] = opt.step
        return state

    @torch.no_grad()
    def adapter_weights(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's full (TP shards joined) fp32 factors at its true rank, by factor name --
        the ``weights`` :meth:`load_slot` takes -- read from the optimizer's fp32 masters.

        Collective under tensor parallelism (split factors are all-gathered over the TP group);
        tensors stay on the executor's device."""
        self._check_usable("adapter_weights")
        record = self._loaded(slot, "slot")
        full: dict[str, torch.Tensor] = {}
        for factor, master in zip(self.layout, record.optimizer.masters, strict=True):
            tensor = master.detach()
            layer = factor.layer
            if factor.split_dim is not None and layer.tp_size > 1:
                parts = [torch.empty_like(tensor) for _ in range(layer.tp_size)]
                torch.distributed.all_gather(parts, tensor.contiguous(), group=layer.tp_group)
                tensor = torch.cat(parts, dim=factor.split_dim)
            full[factor.name] = checkpoint.trim_rank_padding(
                tensor,
                rank=record.spec.rank,
                rank_axis_from_end=factor.rank_axis_from_end,
                name=factor.name,
            ).clone()
        return full

    def _loaded(self, slot: Any, field_name: str) -> _LoadedSlot:
        check_slot_index(slot, num_slots=self.config.num_slots, field=field_name)
        if slot not in self._slots:
            raise SlotConfigError(
                field_name, slot, "slot is not loaded", f"load_slot({slot}) first"
            )
        return self._slots[slot]

    # -- load / unload --------------------------------------------------------------------------

    def load_slot(
        self,
        slot: int,
        rank: int,
        alpha: float,
        *,
        init: str = "kaiming_uniform",
        seed: int = 0,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Give ``slot`` a fresh adapter (or the full true-rank ``weights``), optimizer and zero
        gradients.  ``weights`` maps ``"<layer key>.lora_A"`` to ``[rank, in]`` and
        ``"<layer key>.lora_B"`` to ``[out, rank]``."""
        self._check_usable("load_slot")
        spec = LoraSlotSpec(rank=rank, alpha=alpha, init=init, seed=seed)
        check_slot_request(
            slot,
            spec,
            num_slots=self.config.num_slots,
            max_rank=self.config.max_rank,
            loaded_slots=self._slots,
        )
        if weights is not None:
            check_adapter_weights(weights, self.adapter_shapes(spec.rank))
        with self._mutating("load_slot"):
            adapter = SlotAdapter(self.layout, dtype=self.dtype, device=self.device)
            if weights is not None:
                adapter.import_full(spec, weights)
            else:
                adapter.initialize(spec)
            self._slots[slot] = self._build_slot(slot, spec, adapter)

    def _build_slot(self, slot: int, spec: LoraSlotSpec, adapter: SlotAdapter) -> _LoadedSlot:
        """Grad buffer (megatron DDP) and optimizer for a filled adapter; attach it."""
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
            average_in_collective=False,
        )
        grad_sync = DistributedDataParallel(self.model.config, ddp_config, module=adapter)
        params = adapter.parameters_in_order()
        first_replica = self.dp_rank == 0 and self.cp_rank == 0
        optimizer = SlotOptimizer(
            slot,
            params,
            counts_in_norm=[
                first_replica and param_is_not_tensor_parallel_duplicate(p) for p in params
            ],
            grad_sync=grad_sync,
            weight_storage=adapter.storage,
            reduce_grads=self.dp_size * self.cp_size > 1,
        )
        adapter.attach_to_layers(slot)
        return _LoadedSlot(spec, adapter, grad_sync, optimizer)

    def unload_slot(self, slot: int) -> None:
        """Detach ``slot`` and free its weights, gradients, masters and Adam state."""
        self._check_usable("unload_slot")
        self._loaded(slot, "slot")
        with self._mutating("unload_slot"):
            record = self._slots.pop(slot)
            record.adapter.detach_from_layers(slot)
            del record
            # megatron's DDP hooks close over the DDP object (a reference cycle through the
            # autograd graph's grad accumulators): collect it now so the memory is back on return.
            gc.collect()

    # -- forward / backward ---------------------------------------------------------------------

    def forward_backward(
        self, batch: SlotBatch, loss_fn: TokenLoss | Mapping[int, TokenLoss]
    ) -> dict[int, SlotLossReport]:
        """Accumulate every batch slot's gradients; returns each slot's loss report."""
        reports, _ = self._checked_forward_backward(batch, loss_fn, keep_logprobs=False)
        return reports

    def forward_backward_logprobs(
        self, batch: SlotBatch, loss_fn: TokenLoss | Mapping[int, TokenLoss]
    ) -> tuple[dict[int, SlotLossReport], torch.Tensor]:
        """:meth:`forward_backward`, and the log-probability of every target token taken from
        the same forward pass: ``forward_logprobs(batch)`` as it was before this call (the
        weights this forward ran with; equal on the CPU, within rounding on CUDA, where a
        forward that records gradients may take other kernels), same shape and placement,
        without a second forward.  A micro-batch that trains nothing (base-only rows) gets a
        forward of its own."""
        reports, logprobs = self._checked_forward_backward(batch, loss_fn, keep_logprobs=True)
        assert logprobs is not None
        return reports, logprobs

    def _checked_forward_backward(
        self,
        batch: SlotBatch,
        loss_fn: TokenLoss | Mapping[int, TokenLoss],
        *,
        keep_logprobs: bool,
    ) -> tuple[dict[int, SlotLossReport], torch.Tensor | None]:
        self._check_usable("forward_backward")
        row_slots = check_batch(
            batch,
            dp_size=self.dp_size,
            micro_batch_size=self.config.micro_batch_size,
            num_slots=self.config.num_slots,
            loaded_slots=self._slots,
            vocab_size=self.model.vocab_size,
            max_sequence_length=self.model.max_sequence_length,
        )
        slots = sorted({slot for slot in row_slots if slot >= 0})
        losses = resolve_losses(loss_fn, slots, batch)
        with self._mutating("forward_backward"):
            return self._forward_backward(batch, slots, losses, keep_logprobs=keep_logprobs)

    def forward_logprobs(self, batch: SlotBatch) -> torch.Tensor:
        """Log-probability of every target token under its row's slot (forward only).

        Returns the whole batch's ``[rows, seq]`` fp32 host tensor on every rank (each
        data-parallel rank computes its rows; one all-gather joins them).  Use it for the
        ``old_logprobs`` of a policy-gradient request, or to evaluate."""
        self._check_usable("forward_logprobs")
        check_batch(
            batch,
            dp_size=self.dp_size,
            micro_batch_size=self.config.micro_batch_size,
            num_slots=self.config.num_slots,
            loaded_slots=self._slots,
            vocab_size=self.model.vocab_size,
            max_sequence_length=self.model.max_sequence_length,
        )
        with self._mutating("forward_logprobs"):
            return self._forward_logprobs_unchecked(batch)

    def _forward_logprobs_unchecked(self, batch: SlotBatch) -> torch.Tensor:
        with torch.no_grad():
            local = batch.rows_for(self.dp_rank, self.dp_size)
            size = self.config.micro_batch_size
            parts = []
            for start in range(0, local.rows, size):
                rows = local.select_rows(start, start + size)
                parts.append(self._forward_rows(rows, self._model_inputs(rows)))
            return self._gather_rows(parts)

    def _forward_rows(self, rows: SlotBatch, inputs: _ModelInputs) -> torch.Tensor:
        """Target log-probabilities ``[b, s]`` of one micro-batch by a forward of its own (call
        under ``no_grad``); zeros where no token is real."""
        if not inputs.real_tokens:
            return torch.zeros(rows.input_ids.shape, device=self.device)
        logits = self._forward(self.model, inputs)
        values = target_logprobs(logits, inputs.target_ids).float()
        return self._to_rows(values, inputs, rows)

    def _gather_rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """This data-parallel rank's micro-batch rows joined with every other rank's, in batch
        order, as one host tensor (the same on every rank)."""
        mine = torch.cat(parts).contiguous()
        gathered = [torch.empty_like(mine) for _ in range(self.dp_size)]
        torch.distributed.all_gather(gathered, mine, group=parallel_state.get_data_parallel_group())
        return torch.cat(gathered).cpu()

    def _forward_backward(
        self,
        batch: SlotBatch,
        slots: list[int],
        losses: Mapping[int, TokenLoss],
        *,
        keep_logprobs: bool,
    ) -> tuple[dict[int, SlotLossReport], torch.Tensor | None]:
        if not slots:  # base-only rows (the same on every rank): nothing to train
            return {}, self._forward_logprobs_unchecked(batch) if keep_logprobs else None
        real = real_token_mask(batch)
        mask = batch.loss_mask.to(torch.bool) & real
        self.last_packing = PackingReport(int(real.sum()), real.numel())
        token_counts = {slot: int(mask[batch.slot_ids == slot].sum().item()) for slot in slots}
        packing = {}
        for slot in slots:
            of_slot = (batch.slot_ids == slot).any(dim=1)
            packing[slot] = PackingReport(int(real[of_slot].sum()), int(real[of_slot].numel()))
        metric_names = ["loss", *sorted({m for loss in losses.values() for m in loss.metrics})]
        local = batch.rows_for(self.dp_rank, self.dp_size)
        size = self.config.micro_batch_size
        prepared = [
            self._prepare(local.select_rows(start, start + size), slots, token_counts, losses)
            for start in range(0, local.rows, size)
        ]
        # A micro-batch of base-only rows (padding) trains nothing: skip its forward entirely.
        # Safe to differ across data-parallel ranks: a forward/backward only talks within TP,
        # whose ranks share their rows.
        # So is one without real tokens; every CP rank of a DP rank holds the same rows.
        micro_batches = [mb for mb in prepared if mb.trains]
        loss_fn = functools.partial(self._micro_batch_loss, slots=slots, metric_names=metric_names)
        if not micro_batches:
            reduced = []
        elif self.device.type == "cuda":
            reduced = self._run_megatron_schedule(micro_batches, loss_fn, local.seq_len)
        else:
            reduced = self._run_local_schedule(micro_batches, loss_fn)
        total = torch.zeros(len(slots), len(metric_names), device=self.device)
        for part in reduced:
            total += part["slot_sums"]
        torch.distributed.all_reduce(
            total, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        values = total.tolist()
        reports = {}
        for index, slot in enumerate(slots):
            row = dict(zip(metric_names, values[index], strict=True))
            reports[slot] = SlotLossReport(
                slot=slot,
                loss=row.pop("loss"),
                num_tokens=token_counts[slot],
                metrics={name: row[name] for name in losses[slot].metrics},
                packing_efficiency=packing[slot].efficiency,
            )
        if not keep_logprobs:
            return reports, None
        return reports, self._gather_rows(self._kept_logprobs(prepared, reduced))

    def _kept_logprobs(
        self, prepared: list[_MicroBatch], reduced: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Each local micro-batch's ``[b, s]`` target log-probabilities: the ones its loss kept
        (``reduced`` in order of the micro-batches that trained), or a forward of its own."""
        trained = sum(micro_batch.trains for micro_batch in prepared)
        if len(reduced) != trained:  # one entry per micro-batch run (no pipeline stages here)
            raise RuntimeError(f"{len(reduced)} loss results for {trained} micro-batches")
        kept = iter(reduced)
        parts = []
        with torch.no_grad():
            for micro_batch in prepared:
                if micro_batch.trains:
                    values = next(kept)["logprobs"]
                    parts.append(self._to_rows(values, micro_batch.inputs, micro_batch.rows))
                else:
                    parts.append(self._forward_rows(micro_batch.rows, micro_batch.inputs))
        return parts

    def _model_inputs(self, rows: SlotBatch) -> _ModelInputs:
        """The micro-batch as model inputs: one packed stream of its real tokens (``[1, T]``,
        this CP rank's load-balanced share), routed per run of slot."""
        slot_ids = rows.slot_ids.to(torch.int64)
        present = sorted({int(s) for s in torch.unique(slot_ids).tolist() if s >= 0})
        index, lengths = stream_segments(rows, real_token_mask(rows))
        return self._stream_inputs(rows, present, index, lengths)

    def _slot_routing(self, slot_ids: torch.Tensor, present: list[int]) -> SlotRouting | None:
        return build_routing(
            slot_ids,
            {slot: self._slots[slot].spec.scale for slot in present},
            dtype=self.dtype,
            device=self.device,
        )

    def _stream_inputs(
        self, rows: SlotBatch, present: list[int], index: torch.Tensor, lengths: list[int]
    ) -> _ModelInputs:
        from mizzen_plugins.context_parallel import shard_packed_stream
        from mizzen_plugins.thd import PackedLayout

        device = self.device
        layout = PackedLayout.from_lengths(lengths)
        sentinel = rows.rows * rows.seq_len
        shard = None
        if self.cp_size > 1:
            shard = shard_packed_stream(layout, self.cp_size, self.cp_rank, "load_balanced")
            local = shard.local_token_index
            gather = torch.full_like(local, sentinel)
            is_real = local < layout.num_tokens
            gather[is_real] = index.index_select(0, local[is_real])
            positions = shard.local_positions
            stream_layout = shard.layout
        else:
            gather = index
            positions = layout.positions
            stream_layout = layout
        inputs = _ModelInputs(
            input_ids=torch.empty(0),
            position_ids=torch.empty(0),
            target_ids=torch.empty(0),
            packed=self._packed_stream(stream_layout, positions, shard),
            routing=None,
            gather=gather,
            real_tokens=layout.num_tokens,
            stream_index=index,
        )
        inputs.routing = self._slot_routing(inputs.take(rows.slot_ids.to(torch.int64), -1), present)
        inputs.input_ids = inputs.take(rows.input_ids).to(device=device, dtype=torch.int64)
        inputs.target_ids = inputs.take(rows.target_ids).to(device=device, dtype=torch.int64)
        position_ids = positions.view(1, -1)
        if rows.position_ids is not None:
            position_ids = inputs.take(rows.position_ids)
        inputs.position_ids = position_ids.to(device=device, dtype=torch.int64)
        return inputs

    def _packed_stream(self, layout, positions, shard) -> PackedStream:
        return packed_stream(
            layout,
            device=self.device,
            positions=positions,
            qkv_format="thd",
            cp_shard=shard,
            cp_group=parallel_state.get_context_parallel_group() if shard is not None else None,
            impl=self.attention_impl,
        )

    def _to_rows(self, values: torch.Tensor, inputs: _ModelInputs, rows: SlotBatch) -> torch.Tensor:
        """Per-token values shaped like the model input back to the micro-batch's ``[b, s]``
        (the whole stream under context parallelism; padding positions hold 0)."""
        flat = values.reshape(-1)
        shard = inputs.packed.cp_shard
        if shard is not None:
            from mizzen_plugins.context_parallel import all_gather_rows

            flat = all_gather_rows(flat, shard, inputs.packed.cp_group)[: inputs.real_tokens]
        out = torch.zeros(rows.rows * rows.seq_len, device=values.device, dtype=values.dtype)
        out[inputs.stream_index.to(values.device)] = flat
        return out.view(rows.rows, rows.seq_len)

    def _prepare(
        self,
        rows: SlotBatch,
        slots: list[int],
        token_counts: Mapping[int, int],
        losses: Mapping[int, TokenLoss],
    ) -> _MicroBatch:
        device = self.device
        inputs = self._model_inputs(rows)
        slot_ids = rows.slot_ids.to(torch.int64)
        bins = torch.full_like(slot_ids, len(slots))
        denominators = torch.ones(slot_ids.shape, dtype=torch.float32)
        for index, slot in enumerate(slots):
            member = slot_ids == slot
            bins[member] = index
            denominators[member] = float(max(token_counts[slot], 1))
        counted = (slot_ids >= 0) & real_token_mask(rows)
        weights = torch.where(counted, rows.loss_mask.to(torch.float32) / denominators, 0.0)
        weights = inputs.take(weights, 0.0)
        bins = inputs.take(bins, len(slots))
        by_loss: dict[TokenLoss, torch.Tensor] = {}
        for slot in inputs.routing.slots if inputs.routing is not None else ():
            selector = inputs.take(slot_ids == slot, False)
            loss = losses[slot]
            by_loss[loss] = by_loss[loss] | selector if loss in by_loss else selector
        fields = {
            name: inputs.take(getattr(rows, name).to(torch.float32)).to(device=device)
            for name in LOSS_FIELDS
            if getattr(rows, name) is not None
        }
        return _MicroBatch(
            rows=rows,
            inputs=inputs,
            weights=weights.to(device),
            bins=bins.to(device),
            losses=[(loss, selector.to(device)) for loss, selector in by_loss.items()],
            fields=fields,
            num_tokens=torch.tensor(int((weights > 0).sum()), dtype=torch.int, device=device),
            trains=bool(counted.any()),
        )

    def _forward(self, model: torch.nn.Module, inputs: _ModelInputs) -> torch.Tensor:
        with self._routing.use(inputs.routing):
            return model(
                inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed
            )

    def _micro_batch_loss(
        self,
        micro_batch: _MicroBatch,
        logits: torch.Tensor,
        *,
        slots: list[int],
        metric_names: list[str],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """megatron's 3-tuple loss contract: (loss to backprop, token count, reduced metrics)."""
        logprobs = target_logprobs(logits, micro_batch.inputs.target_ids)
        # exact zeros still tied to the graph: a CP rank whose share holds no slot token runs
        # the backward (and its collectives) like its peers, sending zero gradients
        per_token = torch.where(torch.zeros_like(logprobs, dtype=torch.bool), logprobs, 0.0)
        metric_values = {name: torch.zeros_like(logprobs) for name in metric_names[1:]}
        for loss, selector in micro_batch.losses:
            values, metrics = loss.per_token(logprobs, micro_batch.fields)
            per_token = torch.where(selector, values, per_token)
            for name, value in metrics.items():
                metric_values[name] = torch.where(selector, value, metric_values[name])
        weights = micro_batch.weights
        counted = weights > 0
        weighted = torch.where(counted, per_token * weights, 0.0)
        columns = [weighted.detach()] + [
            torch.where(counted, metric_values[name] * weights, 0.0) for name in metric_names[1:]
        ]
        stacked = torch.stack([column.reshape(-1) for column in columns], dim=1)
        sums = torch.zeros(len(slots) + 1, len(metric_names), device=stacked.device)
        sums.index_add_(0, micro_batch.bins.reshape(-1), stacked)
        reduced = {"slot_sums": sums[: len(slots)], "logprobs": logprobs.detach()}
        return weighted.sum(), micro_batch.num_tokens, reduced

    def _run_local_schedule(
        self, micro_batches: list[_MicroBatch], loss_fn: Callable
    ) -> list[dict[str, torch.Tensor]]:
        store = []
        for micro_batch in micro_batches:
            logits = self._forward(self.model, micro_batch.inputs)
            loss, _, reduced = loss_fn(micro_batch, logits)
            loss.backward()
            store.append(reduced)
        return store

    def _run_megatron_schedule(
        self, micro_batches: list[_MicroBatch], loss_fn: Callable, seq_len: int
    ) -> list[dict[str, torch.Tensor]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[_MicroBatch], model: torch.nn.Module):
            micro_batch = next(data_iterator)
            return self._forward(model, micro_batch.inputs), functools.partial(loss_fn, micro_batch)

        store = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=self.config.micro_batch_size,
            forward_only=False,
        )
        return list(store)  # the loss's third value per micro-batch, in order

    # -- optimizer ------------------------------------------------------------------------------

    def optim_step(self, adam_params: Mapping[int, AdamParams]) -> dict[int, StepReport]:
        """Step the requested slots (see :func:`step_slot_optimizers`)."""
        self._check_usable("optim_step")
        check_adam_requests(adam_params, num_slots=self.config.num_slots, loaded_slots=self._slots)
        with self._mutating("optim_step"):
            optimizers = {slot: self._slots[slot].optimizer for slot in adam_params}
            return step_slot_optimizers(optimizers, dict(adam_params))

    # -- checkpoints ----------------------------------------------------------------------------

    def save_slot(
        self, slot: int, directory: str, *, owner: Mapping[str, Any] | None = None
    ) -> None:
        """Save one slot (adapter masters, Adam moments, step) to ``directory`` (collective);
        ``owner``: what holds it, recorded in its manifest (see
        :func:`mizzen_train.checkpoint.check_owner`).

        Pending (not yet stepped) gradients are not part of a checkpoint."""
        self._check_usable("save_slot")
        record = self._loaded(slot, "slot")
        with self._mutating("save_slot", agreed=(SlotCheckpointError,)):
            state = record.optimizer.state_tensors()
            factors = {
                factor.name: {
                    "split_dim": factor.split_dim,
                    "rank_axis_from_end": factor.rank_axis_from_end,
                    **{entry: state[entry][index] for entry in checkpoint.STATE_ENTRIES},
                }
                for index, factor in enumerate(self.layout)
            }
            checkpoint.save_slot_checkpoint(
                directory,
                step=record.optimizer.step,
                spec=record.spec,
                max_rank=self.config.max_rank,
                factors=factors,
                owner=owner,
            )

    def restore_slot(self, slot: int, directory: str) -> LoraSlotSpec:
        """Load a committed slot checkpoint into the free ``slot`` (collective); returns its spec.

        Every rank validates its shard first and all ranks agree before any state changes."""
        self._check_usable("restore_slot")
        check_slot_index(slot, num_slots=self.config.num_slots)
        if slot in self._slots:
            raise SlotConfigError("slot", slot, "slot is in use", f"unload_slot({slot}) first")
        with self._mutating("restore_slot", agreed=(SlotCheckpointError,)):
            shard, error = None, None
            try:
                shard = checkpoint.read_slot_shard(
                    directory,
                    expected_shapes={f.name: f.local_shape for f in self.layout},
                    max_rank=self.config.max_rank,
                )
            except SlotCheckpointError as exc:
                error = str(exc)
            except Exception as exc:  # e.g. an unreadable shard: still agree, never hang peers
                error = f"{directory}: {type(exc).__name__}: {exc}"
            checkpoint.agree(error, what=f"restoring slot {slot} from {directory}")
            assert shard is not None
            adapter = SlotAdapter(self.layout, dtype=self.dtype, device=self.device)
            record = self._build_slot(slot, shard.spec, adapter)
            names = [factor.name for factor in self.layout]
            record.optimizer.load_state(
                {entry: [shard.state[entry][n] for n in names] for entry in shard.state},
                shard.step,
            )
            self._slots[slot] = record
            return shard.spec


def _activations_always_require_grad(model: torch.nn.Module) -> None:
    """Under context parallelism: the embedding's output requires grad while grad is enabled
    (detached first: the base is frozen), so every CP rank runs every collective of the backward
    (the key/value all-gathers' gradient reduction) even when its share of the stream holds no
    slot token and so no LoRA delta -- else that rank would skip the collective its peers wait
    in."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return

    def require_grad(_module, _inputs, output):
        if torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_(True)
        return output

    embedding.register_forward_hook(require_grad)


def _check_packed_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose attention would ignore the packed segments (megatron's dense
    DotProductAttention needs a ``[b, 1, s, s]`` mask, which the executor never builds)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for name, module in model.named_modules():
        if isinstance(module, DotProductAttention) and not isinstance(module, PackedCoreAttention):
            raise SlotConfigError(
                "model",
                f"{name}: {type(module).__name__}",
                "the slot executor hands attention packed streams (cu_seqlens), not dense masks",
                "build the model with mizzen_train.gpt.build_gpt (attention='packed')",
            )
