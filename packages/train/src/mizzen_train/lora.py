"""Slotted LoRA on megatron-core's tensor-parallel linears (and on plain ``nn.Linear``).

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
on every TP rank (no extra reduction).

A plain ``torch.nn.Linear`` (the layers of plugin models, :mod:`mizzen_train.plugin_models`) is
wrapped in ``"local"`` mode: no tensor parallelism (both factors whole), its output a tensor (not
megatron's ``(output, bias)`` pair); it reads the same packed stream (``[T, in]``) and runs the
same kernels as the parallel path.  megatron-core's local GPT spec holds no plain ``nn.Linear``,
so its models wrap exactly as before.  Factors are initialised or imported as *full* tensors from
a seeded host generator and then sliced, so a slot is the same adapter at TP=1 and TP=2.

Invariants:
- The base layer's parameters are untouched; its forward runs unchanged and the delta is added to
  its output (a skipped bias stays skipped).  Without a current routing a slotted layer is exactly
  its base layer.
- Slot ``k``'s factors see only slot ``k``'s tokens (see :mod:`mizzen_train.routing`): each run
  of the stream multiplies by its own slot's factors -- one group of a grouped GEMM per run
  (:meth:`SlottedLoRALinear._add_grouped_runs_delta`, a base-only run's group multiplies by zero
  factors, so its tokens get an exact-zero delta unless their own activations are non-finite)
  or one GEMM per run (:class:`_RunsDelta`, where the grouped kernel does not apply) -- and in
  backward a slot's factor gradients are summed over that slot's runs only, in stream order: no
  atomic scatter-add, so gradients are deterministic and the TP-replicated factors cannot drift
  apart between ranks through reduction order.
- Gradient delivery: the *single* kind and the grouped runs path are plain autograd (``.grad``,
  a slot's runs summed in the factor's dtype, reduced by DDP's hooks into ``main_grad``).
  :class:`_RunsDelta` sums a slot's runs in fp32 and adds the sum straight into the factor's
  ``main_grad`` when it has one (no ``.grad``; megatron's gradient accumulation fusion does the
  same), every slot of the micro-batch in one multi-tensor add; this is sound because
  ``overlap_grad_reduce`` is refused (:mod:`mizzen_train.validation`), so the buffers are
  reduced only after the whole backward.  A factor without ``main_grad`` gets an ordinary
  gradient.
- The runs kind refuses activations whose token count is not the routing's (``ValueError``
  naming the layer): the stream and its routing come from the same micro-batch.
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


def _slottable_types() -> tuple[type, ...]:
    return (ColumnParallelLinear, RowParallelLinear, torch.nn.Linear)


def check_slottable(module: torch.nn.Module, key: str) -> None:
    """Raise :class:`SlotConfigError` (field ``target_modules``) unless ``module`` can be slotted."""
    if not isinstance(module, _slottable_types()):
        raise SlotConfigError(
            "target_modules",
            key,
            f"{type(module).__name__} is not a megatron-core ColumnParallelLinear or "
            "RowParallelLinear, nor a torch.nn.Linear",
            "target only linears (the local layer spec's tensor-parallel ones, or a plugin "
            "model's nn.Linear)",
        )
    if isinstance(module, torch.nn.Linear):
        return
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
        base: ColumnParallelLinear | RowParallelLinear | torch.nn.Linear,
        *,
        key: str,
        max_rank: int,
        routing: RoutingState,
    ) -> None:
        super().__init__()
        check_slottable(base, key)
        if isinstance(base, torch.nn.Linear):
            self._init_local(base, key=key, max_rank=max_rank, routing=routing)
            return
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

    def _init_local(
        self, base: torch.nn.Linear, *, key: str, max_rank: int, routing: RoutingState
    ) -> None:
        """A plain linear: no tensor parallelism, both factors whole on this rank."""
        self.parallel_mode = "local"
        self.a_split_dim = self.b_split_dim = None
        self.base = base
        self.key = key
        self.max_rank = max_rank
        self.tp_group, self.tp_size, self.tp_rank = None, 1, 0
        self.a_full_shape = self.a_local_shape = (max_rank, base.in_features)
        self.b_full_shape = self.b_local_shape = (base.out_features, max_rank)
        self._routing = routing
        self._adapters = {}

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
        if self.parallel_mode == "local":
            output = self.base(input_)
            return self._with_delta(output, input_)
        output, bias = self.base(input_, *args, **kwargs)
        return self._with_delta(output, input_), bias

    def _with_delta(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The base output plus the routed slots' deltas (the base output alone without a
        routing).  ``x`` and ``output`` hold the micro-batch's packed stream in any leading shape
        (megatron's ``[T, 1, h]``, a plugin's ``[T, h]``): tokens are read in row-major order."""
        routing = self._routing.current
        if routing is None:
            return output
        if routing.runs is None:
            return self._add_single_delta(output, x, routing)
        tokens = x.numel() // x.shape[-1]
        if tokens != routing.runs[-1].stop:
            raise ValueError(
                f"{self.key}: the routing covers {routing.runs[-1].stop} stream tokens but the "
                f"layer got {tokens} (input shape {tuple(x.shape)}); route the micro-batch the "
                "model runs on"
            )
        if _grouped_gemms_apply(x, output):
            return self._add_grouped_runs_delta(output, x, routing)
        factors = [self._adapters[slot] for slot in routing.slots]
        a = [lora_a for lora_a, _ in factors]
        b = [lora_b for _, lora_b in factors]
        return _RunsDelta.apply(output, x, self, routing, len(a), *a, *b)

    def _add_grouped_runs_delta(
        self, output: torch.Tensor, x: torch.Tensor, routing: SlotRouting
    ) -> torch.Tensor:
        """The runs kind as two grouped GEMMs (one group per run, each with its own slot's
        factors; a base-only run's factors are zeros), the rank padded to a multiple of
        :data:`RANK_ALIGNMENT` with zeros; autograd gives the backward."""
        from torch.nn.functional import grouped_mm

        rank = -(-self.max_rank // RANK_ALIGNMENT) * RANK_ALIGNMENT
        pad = rank - self.max_rank
        padded = {
            slot: (
                torch.nn.functional.pad(lora_a.t(), (0, pad)),  # [in, rank]
                torch.nn.functional.pad(lora_b.t(), (0, 0, 0, pad)),  # [rank, out]
            )
            for slot, (lora_a, lora_b) in self._adapters.items()
            if slot in routing.slots
        }
        zeros = None
        a_runs, b_runs = [], []
        for run in routing.runs:
            if run.block < 0:
                if zeros is None:
                    zeros = (
                        x.new_zeros(x.shape[-1], rank),
                        x.new_zeros(rank, output.shape[-1]),
                    )
                a_run, b_run = zeros
            else:
                a_run, b_run = padded[routing.slots[run.block]]
            a_runs.append(a_run)
            b_runs.append(b_run)
        x2 = x.reshape(-1, x.shape[-1])
        out2 = output.reshape(-1, output.shape[-1])
        hidden = grouped_mm(x2, torch.stack(a_runs), offs=routing.run_stops)  # [T, rank]
        hidden = self._tp_region(hidden) * routing.token_scales
        delta = grouped_mm(hidden, torch.stack(b_runs), offs=routing.run_stops)  # [T, out]
        return (out2 + delta).view(output.shape)

    def _add_single_delta(
        self, output: torch.Tensor, x: torch.Tensor, routing: SlotRouting
    ) -> torch.Tensor:
        """``output + scale * (x A^T) B^T`` for the single kind (one slot, every token), the add
        done in the second GEMM's epilogue (``addmm``): no ``[tokens, out]`` delta is written and
        read back for a separate add (a full pass over the layer's output saved per call)."""
        lora_a, lora_b = self._adapters[routing.slots[0]]
        hidden = self._tp_region(torch.matmul(x, lora_a.t())) * routing.scales[0]
        summed = torch.addmm(
            output.reshape(-1, output.shape[-1]), hidden.reshape(-1, hidden.shape[-1]), lora_b.t()
        )
        return summed.view(output.shape)

    def _tp_region(self, hidden: torch.Tensor) -> torch.Tensor:
        """``h = A x`` across tensor parallelism (see the module docstring's table)."""
        if self.parallel_mode == "local":
            return hidden
        if self.parallel_mode == "column":
            return tensor_parallel.copy_to_tensor_model_parallel_region(hidden, self.tp_group)
        return tensor_parallel.reduce_from_tensor_model_parallel_region(hidden, self.tp_group)

    def extra_repr(self) -> str:
        return f"key={self.key}, mode={self.parallel_mode}, max_rank={self.max_rank}"


#: The grouped GEMMs read factors padded to a rank that is a multiple of this (16-byte rows).
RANK_ALIGNMENT = 8


def _grouped_gemms_apply(x: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether the runs kind takes :meth:`SlottedLoRALinear._add_grouped_runs_delta`: rows of
    the stream's activations 16-byte aligned (the grouped GEMM's rule), and bf16 on CUDA (the
    only dtype with a grouped kernel there; others would loop over the groups after a
    device-to-host read of the offsets).  Else :class:`_RunsDelta` (one GEMM per run)."""
    size = x.element_size()
    aligned = (x.shape[-1] * size) % 16 == 0 and (output.shape[-1] * size) % 16 == 0
    if not aligned or x.dtype != output.dtype:
        return False
    return x.device.type == "cpu" or x.dtype == torch.bfloat16


class _RunsDelta(torch.autograd.Function):
    """``output[run] + scale_k * (x[run] A_k^T) B_k^T`` for every run of the stream, each with its
    own slot's factors; base-only runs pass the base output through.

    One node: ``h = A x`` is one GEMM per run written into one ``[T, r]`` buffer (so the
    tensor-parallel communication of the module docstring's table is one collective over all
    runs), the token scales one multiply, and the second GEMM an ``addmm`` per run writing the
    result's rows directly.  Backward computes the input gradient run by run into one buffer and
    each factor's gradient as the fp32 sum over its slot's runs only (see
    :func:`_deliver_factor_grads`).
    """

    @staticmethod
    def forward(ctx, output, x, layer, routing: SlotRouting, count: int, *factors):
        a_factors, b_factors = factors[:count], factors[count:]
        x2 = x.reshape(-1, x.shape[-1])
        out2 = output.reshape(-1, output.shape[-1])
        hidden = _run_products(routing, x2, [a.t() for a in a_factors])
        if layer.parallel_mode == "row" and layer.tp_size > 1:
            torch.distributed.all_reduce(hidden, group=layer.tp_group)
        scaled = hidden * routing.token_scales
        result = torch.empty_like(out2)
        for run in routing.runs:
            rows = slice(run.start, run.stop)
            if run.block < 0:
                result[rows].copy_(out2[rows])
            else:
                torch.addmm(out2[rows], scaled[rows], b_factors[run.block].t(), out=result[rows])
        ctx.save_for_backward(x2, scaled)
        ctx.layer, ctx.routing, ctx.factors, ctx.x_shape = layer, routing, factors, x.shape
        return result.view(output.shape)

    @staticmethod
    def backward(ctx, grad_output):
        x2, scaled = ctx.saved_tensors
        layer, routing, factors = ctx.layer, ctx.routing, ctx.factors
        count = len(factors) // 2
        a_factors, b_factors = factors[:count], factors[count:]
        grad2 = grad_output.reshape(-1, grad_output.shape[-1])
        grad_hidden = _run_products(routing, grad2, b_factors)
        grad_hidden.mul_(routing.token_scales)
        if layer.parallel_mode == "column" and layer.tp_size > 1:
            torch.distributed.all_reduce(grad_hidden, group=layer.tp_group)
        grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = _run_products(routing, grad_hidden, a_factors).view(ctx.x_shape)
        needs = ctx.needs_input_grad[5:]
        sums_a = _per_slot_sums(routing, needs[:count], lambda r: grad_hidden[r].t() @ x2[r])
        sums_b = _per_slot_sums(routing, needs[count:], lambda r: grad2[r].t() @ scaled[r])
        grads_a = _deliver_factor_grads(a_factors, sums_a)
        grads_b = _deliver_factor_grads(b_factors, sums_b)
        return (grad_output, grad_x, None, None, None, *grads_a, *grads_b)


def _run_products(
    routing: SlotRouting, left: torch.Tensor, rights: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``left[run] @ rights[run.block]`` for every run, one GEMM each, written into one
    ``[tokens, width]`` buffer; a base-only run's rows are zero (no GEMM)."""
    out = left.new_empty(left.shape[0], rights[0].shape[1])
    for run in routing.runs:
        rows = slice(run.start, run.stop)
        if run.block < 0:
            out[rows].zero_()
        else:
            torch.mm(left[rows], rights[run.block], out=out[rows])
    return out


def _per_slot_sums(routing: SlotRouting, needs, product) -> list[torch.Tensor | None]:
    """Per slot, ``product(rows)`` summed over the slot's runs only, in stream order (fp32 when
    a slot has several runs); None for a factor that needs no gradient."""
    sums: list[torch.Tensor | None] = []
    for block, need in enumerate(needs):
        total = None
        if need:
            for run in routing.block_runs(block):
                part = product(slice(run.start, run.stop))
                total = part if total is None else total.float() + part
        sums.append(total)
    return sums


def _deliver_factor_grads(
    factors: Sequence[torch.Tensor], sums: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Each slot's factor gradient: added (fp32) into its ``main_grad`` when it has one, all of
    them in one multi-tensor add, else returned as its ``.grad`` (in the factor's dtype)."""
    into_main, into_sums, grads = [], [], []
    for factor, total in zip(factors, sums, strict=True):
        main_grad = getattr(factor, "main_grad", None)
        if total is not None and main_grad is not None:
            into_main.append(main_grad)
            into_sums.append(total.float())
            grads.append(None)
        else:
            grads.append(None if total is None else total.to(factor.dtype))
    if into_main:
        torch._foreach_add_(into_main, into_sums)
    return grads


def apply_slotted_lora(
    model: torch.nn.Module,
    target_modules: Sequence[str],
    *,
    max_rank: int,
    routing: RoutingState,
) -> dict[str, SlottedLoRALinear]:
    """Wrap every linear whose last name is in ``target_modules``; returns layers by key.

    Linears are megatron-core's parallel ones, or plain ``torch.nn.Linear`` ("local" mode).

    Keys use global layer numbers (``decoder.layers.<layer_number - 1>....``) so they name the
    same layer at any pipeline split.  Raises :class:`SlotConfigError` naming
    ``target_modules`` when a name matches nothing or matches a module that cannot be slotted;
    every target is checked before the first is wrapped, so a refusal leaves the model as it was.
    """
    parallel_linears = {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, _slottable_types())
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
