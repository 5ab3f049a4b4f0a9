"""Slotted LoRA on megatron-core's tensor-parallel linears.

:class:`SlottedLoRALinear` wraps a ``ColumnParallelLinear`` or ``RowParallelLinear`` and adds, per
token, ``scale_k * B_k (A_k x)`` of the slot ``k`` the token is routed to (see
:mod:`mizzen_train.routing`).  Adapters live in :class:`SlotAdapter` (one per loaded slot), stored
at the executor's ``max_rank``: rows ``rank:`` of A and columns ``rank:`` of B are zero padding.

Tensor parallelism follows the base weight's split axis:

=============  ==================  ===================  =====================================
base layer     A (``[r, in]``)     B (``[out, r]``)     communication on ``h = A x``
=============  ==================  ===================  =====================================
column (out)   replicated          split on ``out``     forward identity, backward all-reduce
row (in)       split on ``in``     replicated           forward all-reduce, backward identity
=============  ==================  ===================  =====================================

so the delta is exact at any TP size, and the gradients of replicated factors come out identical
on every TP rank (no extra reduction).  Factors are initialised or imported as *full* tensors from
a seeded host generator and then sliced, so a slot is the same adapter at TP=1 and TP=2.

Invariants:
- The base layer's parameters are untouched; its forward runs unchanged and the delta is added to
  its output (a skipped bias stays skipped).  Without a current routing a slotted layer is exactly
  its base layer.
- Slot ``k``'s GEMM block sees only slot ``k``'s tokens (batched ``bmm`` over slots), so its
  gradient depends only on them.
- Tokens move between megatron's order and the packed slot blocks by gathers in both directions
  (:class:`_RouteRows`): each token has one packed row, so the backward of a gather is the gather
  by the inverse map — no atomic ``index_add``, so gradients are deterministic and the
  TP-replicated factors cannot drift apart between ranks through reduction order.
- Plain ``state_dict`` keys of a wrapped layer gain ``.base``; ``sharded_state_dict`` (megatron
  distributed checkpoints) keeps the base layer's keys.  Load base weights before wrapping.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from mizzen_train.errors import SlotConfigError
from mizzen_train.routing import RoutingState, SlotRouting
from mizzen_train.specs import LoraSlotSpec

_LAYER_PATH = re.compile(r"^decoder\.layers\.(\d+)\.")


def check_slottable(module: torch.nn.Module, key: str) -> None:
    """Raise :class:`SlotConfigError` (field ``target_modules``) unless ``module`` can be slotted."""
    if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
        raise SlotConfigError(
            "target_modules",
            key,
            f"{type(module).__name__} is not a megatron-core ColumnParallelLinear or "
            "RowParallelLinear",
            "target only tensor-parallel linears (local layer spec)",
        )
    if getattr(module, "is_expert", False):
        raise SlotConfigError(
            "target_modules",
            key,
            "expert (MoE) linears are not slotted",
            "target the dense attention/MLP linears",
        )
    if isinstance(module, ColumnParallelLinear) and module.gather_output:
        raise SlotConfigError(
            "target_modules",
            key,
            "a column-parallel linear with gather_output=True returns the full output, but its "
            "LoRA delta is computed per output shard",
            "target linears built with gather_output=False (all of the local GPT spec's)",
        )
    if isinstance(module, RowParallelLinear) and not module.input_is_parallel:
        raise SlotConfigError(
            "target_modules",
            key,
            "a row-parallel linear with input_is_parallel=False scatters its input internally; "
            "the LoRA branch needs the already-split input",
            "target linears built with input_is_parallel=True",
        )


class SlottedLoRALinear(torch.nn.Module):
    """A megatron-core parallel linear plus per-slot LoRA deltas routed per token."""

    def __init__(
        self,
        base: ColumnParallelLinear | RowParallelLinear,
        *,
        key: str,
        max_rank: int,
        routing: RoutingState,
    ) -> None:
        super().__init__()
        check_slottable(base, key)
        if isinstance(base, ColumnParallelLinear):
            self.parallel_mode = "column"
            in_local, out_local = base.input_size, base.output_size_per_partition
            self.a_split_dim, self.b_split_dim = None, 0
        else:
            self.parallel_mode = "row"
            in_local, out_local = base.input_size_per_partition, base.output_size
            self.a_split_dim, self.b_split_dim = 1, None
        self.base = base
        self.key = key
        self.max_rank = max_rank
        self.tp_group = base.tp_group
        self.tp_size = torch.distributed.get_world_size(self.tp_group)
        self.tp_rank = torch.distributed.get_rank(self.tp_group)
        self.a_full_shape = (max_rank, base.input_size)
        self.b_full_shape = (base.output_size, max_rank)
        self.a_local_shape = (max_rank, in_local)
        self.b_local_shape = (out_local, max_rank)
        self._routing = routing
        self._adapters: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}

    # -- megatron-facing surface of the wrapped layer ------------------------------------------

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def backward_dw(self) -> None:
        self.base.backward_dw()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return self.base.sharded_state_dict(prefix, sharded_offsets, metadata)

    # -- slots --------------------------------------------------------------------------------

    def attach(self, slot: int, lora_a: torch.nn.Parameter, lora_b: torch.nn.Parameter) -> None:
        if tuple(lora_a.shape) != self.a_local_shape or tuple(lora_b.shape) != self.b_local_shape:
            raise ValueError(
                f"{self.key}: adapter shapes {tuple(lora_a.shape)}/{tuple(lora_b.shape)} do not "
                f"match the layer's {self.a_local_shape}/{self.b_local_shape}"
            )
        self._adapters[slot] = (lora_a, lora_b)

    def detach(self, slot: int) -> None:
        self._adapters.pop(slot, None)

    def local_shard(self, full: torch.Tensor, split_dim: int | None) -> torch.Tensor:
        """This TP rank's part of a full factor (the whole tensor for a replicated one)."""
        if split_dim is None:
            return full
        return full.chunk(self.tp_size, dim=split_dim)[self.tp_rank]

    # -- forward ------------------------------------------------------------------------------

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        output, bias = self.base(input_, *args, **kwargs)
        routing = self._routing.current
        if routing is None:
            return output, bias
        return output + self._delta(input_, routing), bias

    def _delta(self, x: torch.Tensor, routing: SlotRouting) -> torch.Tensor:
        seq, batch = x.shape[0], x.shape[1]
        x_flat = x.reshape(seq * batch, x.shape[-1])
        factors = [self._adapters[slot] for slot in routing.slots]
        if len(factors) == 1:
            lora_a, lora_b = factors[0][0].unsqueeze(0), factors[0][1].unsqueeze(0)
        else:
            lora_a = torch.stack([a for a, _ in factors])
            lora_b = torch.stack([b for _, b in factors])

        if routing.gather_index is None:
            packed = x_flat.unsqueeze(0)
        else:
            pad_rows = None if routing.pad_mask is None else routing.pad_mask.view(-1, 1)
            packed = _RouteRows.apply(
                x_flat, routing.gather_index.view(-1), routing.scatter_index, routing.token_mask
            )
            if pad_rows is not None:
                packed = torch.where(pad_rows, packed, 0.0)
            packed = packed.view(*routing.gather_index.shape, x_flat.shape[-1])

        hidden = torch.bmm(packed, lora_a.transpose(1, 2))
        if self.parallel_mode == "column":
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, self.tp_group)
        else:
            hidden = tensor_parallel.reduce_from_tensor_model_parallel_region(hidden, self.tp_group)
        hidden = hidden * routing.scales.view(-1, 1, 1)
        delta = torch.bmm(hidden, lora_b.transpose(1, 2))

        delta_flat = delta.reshape(-1, delta.shape[-1])
        if routing.scatter_index is not None:
            pad_rows = None if routing.pad_mask is None else routing.pad_mask.view(-1, 1)
            delta_flat = _RouteRows.apply(
                delta_flat, routing.scatter_index, routing.gather_index.view(-1), pad_rows
            )
            if routing.token_mask is not None:
                delta_flat = torch.where(routing.token_mask, delta_flat, 0.0)
        return delta_flat.view(seq, batch, -1)

    def extra_repr(self) -> str:
        return f"key={self.key}, mode={self.parallel_mode}, max_rank={self.max_rank}"


class _RouteRows(torch.autograd.Function):
    """``rows[i] = x[index[i]]`` whose backward is the gather ``grad[inverse[j]]`` for every row
    ``j`` of ``x`` (zeroed where ``inverse_mask`` is False: rows no output row came from).

    Valid when every row of ``x`` that matters reaches at most one output row and ``inverse``
    names it: true for the token <-> packed-slot-row maps of :class:`SlotRouting`, whose padding
    rows and unrouted tokens are masked out on the way in and on the way back.
    """

    @staticmethod
    def forward(ctx, x, index, inverse, inverse_mask):
        ctx.save_for_backward(inverse, inverse_mask)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        inverse, inverse_mask = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse)
        if inverse_mask is not None:
            grad_x = torch.where(inverse_mask, grad_x, 0.0)
        return grad_x, None, None, None


def apply_slotted_lora(
    model: torch.nn.Module,
    target_modules: Sequence[str],
    *,
    max_rank: int,
    routing: RoutingState,
) -> dict[str, SlottedLoRALinear]:
    """Wrap every linear whose last name is in ``target_modules``; returns layers by key.

    Keys use global layer numbers (``decoder.layers.<layer_number - 1>....``) so they name the
    same layer at any pipeline split.  Raises :class:`SlotConfigError` naming
    ``target_modules`` when a name matches nothing or matches a module that cannot be slotted;
    every target is checked before the first is wrapped, so a refusal leaves the model as it was.
    """
    parallel_linears = {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, ColumnParallelLinear | RowParallelLinear)
    }
    available = sorted({path.rsplit(".", 1)[-1] for path in parallel_linears})
    matches: dict[str, list[str]] = {name: [] for name in target_modules}
    for path, _module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if leaf in matches:
            matches[leaf].append(path)
    for name, paths in matches.items():
        if not paths:
            raise SlotConfigError(
                "target_modules",
                tuple(target_modules),
                f"no module named {name!r} in {type(model).__name__}",
                f"choose from the model's parallel linears {available}",
            )

    targets = [(path, _global_key(model, path)) for paths in matches.values() for path in paths]
    for path, key in targets:  # validate every target before wrapping any
        check_slottable(model.get_submodule(path), key)
    layers: dict[str, SlottedLoRALinear] = {}
    for path, key in targets:
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapped = SlottedLoRALinear(
            getattr(parent, leaf), key=key, max_rank=max_rank, routing=routing
        )
        setattr(parent, leaf, wrapped)
        layers[key] = wrapped
    return dict(sorted(layers.items(), key=lambda item: _natural_key(item[0])))


def _global_key(model: torch.nn.Module, path: str) -> str:
    match = _LAYER_PATH.match(path)
    if match is None:
        return path
    layer = model.get_submodule(f"decoder.layers.{match.group(1)}")
    number = getattr(layer, "layer_number", int(match.group(1)) + 1)
    return f"decoder.layers.{number - 1}." + path[match.end() :]


def _natural_key(key: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in key.split("."))


@dataclass(frozen=True)
class FactorLayout:
    """Where one factor (A or B of one layer) lives and how it is split."""

    name: str  # "<layer key>.lora_A" / "<layer key>.lora_B"
    layer: SlottedLoRALinear
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    #: Dimension split across TP ranks (None: replicated on every TP rank).
    split_dim: int | None
    #: The rank axis counted from the end (A ``[.., r, in]``: 2, B ``[.., out, r]``: 1), so a
    #: leading expert axis is never mistaken for it.
    rank_axis_from_end: int

    def true_rank_shape(self, rank: int) -> tuple[int, ...]:
        """Full shape of this factor at true rank ``rank`` (what import/export exchange)."""
        shape = list(self.full_shape)
        shape[len(shape) - self.rank_axis_from_end] = rank
        return tuple(shape)


def adapter_layout(layers: Mapping[str, SlottedLoRALinear]) -> list[FactorLayout]:
    """The factors of one slot in storage order: A then B of each layer, layers in key order."""
    layout = []
    for layer in layers.values():
        layout.append(
            FactorLayout(
                f"{layer.key}.lora_A",
                layer,
                layer.a_local_shape,
                layer.a_full_shape,
                layer.a_split_dim,
                2,
            )
        )
        layout.append(
            FactorLayout(
                f"{layer.key}.lora_B",
                layer,
                layer.b_local_shape,
                layer.b_full_shape,
                layer.b_split_dim,
                1,
            )
        )
    return layout


class SlotAdapter(torch.nn.Module):
    """One slot's A and B for every slotted layer, as views into one flat storage.

    One allocation per slot keeps the allocator's rounding out of the memory budget and lets the
    optimizer publish every weight of the slot in one copy.  Parameters carry megatron's
    tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``).
    """

    def __init__(
        self, layout: Sequence[FactorLayout], *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layout = list(layout)
        total = sum(math.prod(factor.local_shape) for factor in self.layout)
        self.storage = torch.zeros(total, dtype=dtype, device=device)
        self.factors = torch.nn.ParameterList()
        offset = 0
        for factor in self.layout:
            numel = math.prod(factor.local_shape)
            param = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=device))
            param.data = self.storage[offset : offset + numel].view(factor.local_shape)
            tensor_parallel.set_tensor_model_parallel_attributes(
                param,
                is_parallel=factor.split_dim is not None,
                dim=factor.split_dim if factor.split_dim is not None else -1,
                stride=1,
            )
            self.factors.append(param)
            offset += numel

    def named_factors(self) -> Iterator[tuple[FactorLayout, torch.nn.Parameter]]:
        return zip(self.layout, self.factors, strict=True)

    def parameters_in_order(self) -> list[torch.nn.Parameter]:
        return list(self.factors)

    def attach_to_layers(self, slot: int) -> None:
        params = list(self.factors)
        for index in range(0, len(params), 2):
            self.layout[index].layer.attach(slot, params[index], params[index + 1])

    def detach_from_layers(self, slot: int) -> None:
        for factor in self.layout[0::2]:
            factor.layer.detach(slot)

    @torch.no_grad()
    def initialize(self, spec: LoraSlotSpec) -> None:
        """A from a host generator seeded by ``(spec.seed, layer index)``; B zero."""
        for index, (factor, param) in enumerate(self.named_factors()):
            if factor.rank_axis_from_end == 1:  # B
                param.zero_()
                continue
            generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + index // 2)
            full = torch.zeros(factor.full_shape, dtype=torch.float32)
            if spec.init == "kaiming_uniform":
                bound = 1.0 / math.sqrt(factor.full_shape[-1])
                full[: spec.rank].uniform_(-bound, bound, generator=generator)
            else:  # "gaussian" (validated)
                full[: spec.rank].normal_(0.0, 1.0 / spec.rank, generator=generator)
            param.copy_(factor.layer.local_shard(full, factor.split_dim))

    @torch.no_grad()
    def import_full(self, spec: LoraSlotSpec, weights: Mapping[str, torch.Tensor]) -> None:
        """Set every factor from full true-rank tensors, zero-padded to the max rank.

        Names and shapes were validated (:func:`mizzen_train.validation.check_adapter_weights`).
        """
        for factor, param in self.named_factors():
            full = torch.zeros(factor.full_shape, dtype=torch.float32)
            axis = full.dim() - factor.rank_axis_from_end
            full.narrow(axis, 0, spec.rank).copy_(weights[factor.name].to(torch.float32))
            param.copy_(factor.layer.local_shard(full, factor.split_dim))
