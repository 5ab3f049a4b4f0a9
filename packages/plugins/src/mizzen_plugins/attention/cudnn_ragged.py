"""Causal attention over a packed (THD) stream as one cuDNN kernel per direction (ragged tensors).

cuDNN's fused attention (Hopper and later) reads the packed stream in place.  The stream is
described as ``[b, heads, s, dim]`` whose batch entry ``i`` starts at a *ragged offset* (segment
``i``'s first token × heads × dim elements) and whose valid length is the padding mask's
``seq_len[i]``; a causal band (top-left aligned, right bound 0) inside each entry is exactly
document-causal attention.  One forward and one backward launch per *segment-length group*
(:data:`DEFAULT_GROUP_BOUNDS`: the segments up to 2,048 tokens, and the longer ones) run the whole
batch: no copies, no padding work, no per-segment launches.

Graphs are built once per process for a *shape class* — a group's segment count rounded up to a
power of two (extra entries have length 0), its longest segment and the stream's total tokens
rounded up to powers of two, heads, head dim, dtype, scale, device — so new length mixes reuse
built graphs.  Building takes tens to hundreds of ms per class.

Needs the optional ``nvidia-cudnn-frontend`` package (the ``cudnn`` module, imported only when
this path runs) and a cuDNN backend with ragged-offset attention; :func:`usable` says whether a
call can run here, and callers fall back to other implementations when it cannot.

Invariants:
- Output and gradients cover exactly the stream's tokens; nothing outside a segment is read for
  a segment's result, and length-0 segments contribute nothing.
- Inputs are used in place when ``[tokens, heads, dim]``-contiguous (else copied once); the
  softmax statistics are kept per padded ``[b, heads, s]`` grid (fp32) for the backward pass, so
  a very skewed mix (many short segments and one long one) keeps more statistics than tokens:
  :func:`stats_bytes` says how much, and ``causal_thd_attention(impl="auto")`` takes another path
  when they would outweigh the queries themselves.
- Ragged offsets are int32 element offsets: a stream of ``2**31`` or more elements per tensor is
  not usable here.
- Groups are disjoint sets of segments: each launch writes only its segments' rows of the
  output and the gradients, and every token belongs to exactly one group.  A group's offsets
  address the whole stream, so its backward graph is sized by the stream's total tokens (sized
  by the group's own, cuDNN's backward read out of bounds: CUDA error 700 on an H100).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import torch

from mizzen_plugins.thd import PackedLayout

__all__ = [
    "DEFAULT_GROUP_BOUNDS",
    "GROUPS_ENV",
    "cudnn_ragged_causal",
    "group_bounds",
    "segment_groups",
    "stats_bytes",
    "usable",
]

_INT32_LIMIT = 2**31


@functools.cache
def _frontend():
    """The ``cudnn`` frontend module, or None where it is not installed or cannot load."""
    try:
        import cudnn  # optional, GPU-only: never imported at module scope
    except (ImportError, OSError):
        return None
    try:
        if cudnn.backend_version() < 90300:  # ragged offsets + padding mask, Hopper kernels
            return None
    except Exception:  # a backend that cannot report its version is unusable
        return None
    return cudnn


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`cudnn_ragged_causal` can run these inputs on this machine."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.shape[-1] == v.shape[-1] == k.shape[-1]):
        return False
    if q.shape[-1] % 8 or q.shape[-1] > 128 or q.shape[1] % k.shape[1]:
        return False
    if max(q.numel(), k.numel()) >= _INT32_LIMIT:
        return False
    if torch.cuda.get_device_capability(q.device) < (9, 0):
        return False
    return _frontend() is not None


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def _padded_grid(lengths) -> tuple[int, int]:
    """(entries, rows per entry) of a layout's shape class."""
    return _pow2(len(lengths), 1), _pow2(max(lengths, default=1), 64)


def stats_bytes(layout: PackedLayout, heads_q: int) -> int:
    """Bytes of softmax statistics a forward keeps for the backward pass (fp32, each group's
    padded grid)."""
    total = 0
    for group in segment_groups(layout.lengths, group_bounds()):
        batch, seq = _padded_grid([layout.lengths[i] for i in group])
        total += 4 * batch * seq * heads_q
    return total


@dataclass(frozen=True)
class _ShapeClass:
    batch: int
    seq: int
    total: int
    heads_q: int
    heads_kv: int
    dim: int
    dtype: torch.dtype
    scale: float
    device: int


@dataclass
class _Graphs:
    forward: object
    backward: object
    nodes: dict  # name -> graph tensor, per direction: ("f", name) / ("b", name)
    workspace: int


@dataclass(frozen=True)
class _Batch:
    """Device tensors describing one layout in a shape class (cached on the layout)."""

    shape: _ShapeClass
    seq_len: torch.Tensor  # [b, 1, 1, 1] int32, 0 for the padding entries
    q_offsets: torch.Tensor  # [b + 1, 1, 1, 1] int32 element offsets of q, o, dq, do
    kv_offsets: torch.Tensor  # same for k, v, dk, dv


_GRAPHS: dict[_ShapeClass, _Graphs] = {}
_HANDLES: dict[int, object] = {}
_LOCK = threading.Lock()


def _handle(device: int):
    cudnn = _frontend()
    if device not in _HANDLES:
        with torch.cuda.device(device):
            _HANDLES[device] = cudnn.create_handle()
    return _HANDLES[device]


def _build(shape: _ShapeClass) -> _Graphs:
    nodes: dict = {}
    forward = _build_direction(shape, "f", nodes)
    backward = _build_direction(shape, "b", nodes)
    workspace = max(forward.get_workspace_size(), backward.get_workspace_size())
    return _Graphs(forward, backward, nodes, workspace)


def _build_direction(shape: _ShapeClass, direction: str, nodes: dict):
    """The forward (``"f"``) or backward (``"b"``) graph; its tensors go into ``nodes``."""
    cudnn = _frontend()
    io_type = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[
        shape.dtype
    ]
    b, s, d, hq, hk = shape.batch, shape.seq, shape.dim, shape.heads_q, shape.heads_kv
    g = cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(shape.device),
    )
    int32 = cudnn.data_type.INT32
    named = {
        name: g.tensor(name=name, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
        for name, rows in (("q_offsets", b + 1), ("kv_offsets", b + 1), ("seq_len", b))
    }
    side = {name: "q" for name in ("q", "o", "do", "dq")} | {
        n: "kv" for n in ("k", "v", "dk", "dv")
    }

    def grid(name: str) -> tuple[list[int], list[int]]:
        h = hq if side[name] == "q" else hk
        return [b, h, s, d], [s * h * d, d, h * d, 1]

    def offsets(name: str):
        return named[f"{side[name]}_offsets"]

    def packed(name: str):
        dim, stride = grid(name)
        named[name] = g.tensor(
            name=name, dim=dim, stride=stride, data_type=io_type, ragged_offset=offsets(name)
        )
        return named[name]

    def output(name: str, tensor) -> None:
        dim, stride = grid(name)
        tensor.set_output(True).set_dim(dim).set_stride(stride).set_ragged_offset(offsets(name))
        named[name] = tensor

    q, k, v = packed("q"), packed("k"), packed("v")
    mask = dict(
        attn_scale=shape.scale,
        use_padding_mask=True,
        seq_len_q=named["seq_len"],
        seq_len_kv=named["seq_len"],
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
        diagonal_band_right_bound=0,
    )
    stats_dim, stats_stride = [b, hq, s, 1], [hq * s, s, 1, 1]
    if direction == "f":
        o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **mask)
        output("o", o)
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        stats.set_dim(stats_dim).set_stride(stats_stride)
    else:
        stats = g.tensor(
            name="stats", dim=stats_dim, stride=stats_stride, data_type=cudnn.data_type.FLOAT
        )
        dq, dk, dv = g.sdpa_backward(
            name="sdpa_backward",
            q=q,
            k=k,
            v=v,
            o=packed("o"),
            dO=packed("do"),
            stats=stats,
            max_total_seq_len_q=shape.total,
            max_total_seq_len_kv=shape.total,
            **mask,
        )
        output("dq", dq)
        output("dk", dk)
        output("dv", dv)
    named["stats"] = stats
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    nodes.update({(direction, name): node for name, node in named.items()})
    return g


def _graphs(shape: _ShapeClass) -> _Graphs:
    with _LOCK:
        built = _GRAPHS.get(shape)
        if built is None:
            built = _GRAPHS[shape] = _build(shape)
        return built


#: Environment variable overriding :data:`DEFAULT_GROUP_BOUNDS`: comma-separated segment
#: lengths (``"512,2048"``), or ``none`` for one launch over every segment.
GROUPS_ENV = "MIZZEN_RAGGED_GROUPS"
#: Upper bounds of the segment-length groups: one launch per direction for the segments up to
#: 2,048 tokens and one for the longer ones.  A group's padded grid is its own (its entries x its
#: longest segment), so short segments no longer ride in the grid of the longest one, whose empty
#: tiles every entry pays for.  Measured on an H100 (bench_thd_attention's 65,536-token mix, two
#: repetitions): one group 0.819 / 0.797 of the dense-causal ceiling, ``2048`` 0.862 / 0.838,
#: ``1024`` 0.852 / 0.828, ``512,2048`` 0.849 / 0.828, ``256,1024,4096`` 0.840 / 0.819.
DEFAULT_GROUP_BOUNDS = (2048,)


def group_bounds() -> tuple[int, ...]:
    """The segment-length group bounds in force (see :data:`GROUPS_ENV`)."""
    raw = os.environ.get(GROUPS_ENV)
    if raw is None:
        return DEFAULT_GROUP_BOUNDS
    raw = raw.strip()
    if raw.lower() in ("", "none"):
        return ()
    try:
        bounds = tuple(sorted({int(part) for part in raw.split(",")}))
    except ValueError:
        bounds = (0,)
    if any(b < 1 for b in bounds):
        raise ValueError(
            f"{GROUPS_ENV}={raw!r}: give comma-separated positive segment lengths (e.g. "
            "2048), or none for one launch over every segment"
        )
    return bounds


def segment_groups(lengths, bounds: tuple[int, ...]) -> list[list[int]]:
    """Segment indices per group (stream order inside a group); length-0 segments (nothing to
    compute, nothing to write) and empty groups dropped, so no launch is all padding."""
    groups: list[list[int]] = [[] for _ in range(len(bounds) + 1)]
    for index, n in enumerate(lengths):
        if n == 0:
            continue
        groups[next((g for g, b in enumerate(bounds) if n <= b), len(bounds))].append(index)
    return [group for group in groups if group]


def _batches(layout: PackedLayout, q, k, scale: float) -> tuple[_Batch, ...]:
    bounds = group_bounds()
    return layout.cached(
        ("cudnn_ragged", bounds, q.shape[1:], k.shape[1], q.dtype, float(scale), q.device),
        lambda: tuple(
            _batch(layout, group, q, k, scale) for group in segment_groups(layout.lengths, bounds)
        ),
    )


def _batch(layout: PackedLayout, members: list[int], q, k, scale: float) -> _Batch:
    lengths = [layout.lengths[i] for i in members]
    starts = [layout.starts[i] for i in members]
    batch, seq = _padded_grid(lengths)
    shape = _ShapeClass(
        batch=batch,
        seq=seq,
        # the offsets address the whole stream: the backward's fp32 dQ workspace spans it
        total=_pow2(layout.num_tokens, 64),
        heads_q=q.shape[1],
        heads_kv=k.shape[1],
        dim=q.shape[2],
        dtype=q.dtype,
        scale=float(scale),
        device=q.device.index if q.device.index is not None else torch.cuda.current_device(),
    )
    pad = shape.batch - len(lengths)
    end = starts[-1] + lengths[-1]
    host = torch.tensor([*starts, *([end] * (pad + 1))], dtype=torch.int64)

    def device_int32(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.int32).view(-1, 1, 1, 1).to(q.device)

    seq_len = torch.tensor([*lengths, *([0] * pad)], dtype=torch.int64)
    return _Batch(
        shape=shape,
        seq_len=device_int32(seq_len),
        q_offsets=device_int32(host * (shape.heads_q * shape.dim)),
        kv_offsets=device_int32(host * (shape.heads_kv * shape.dim)),
    )


def _execute(graph, nodes: dict, direction: str, tensors: dict, device: int, size: int) -> None:
    cudnn = _frontend()
    handle = _handle(device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    workspace = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    pack = {nodes[(direction, name)]: tensor for name, tensor in tensors.items()}
    graph.execute(pack, workspace, handle=handle)


class _RaggedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, batches: tuple[_Batch, ...]):
        out = torch.empty_like(q)
        all_stats = []
        for batch in batches:  # disjoint segments: each launch writes its own rows of out
            shape = batch.shape
            graphs = _graphs(shape)
            stats = torch.empty(
                shape.batch, shape.heads_q, shape.seq, 1, dtype=torch.float32, device=q.device
            )
            tensors = {"q": q, "k": k, "v": v, "o": out, "stats": stats, **_meta(batch)}
            _execute(graphs.forward, graphs.nodes, "f", tensors, shape.device, graphs.workspace)
            all_stats.append(stats)
        ctx.save_for_backward(q, k, v, out, *all_stats)
        ctx.batches = batches
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, *all_stats = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_out = d_out.contiguous()
        for batch, stats in zip(ctx.batches, all_stats, strict=True):
            shape = batch.shape
            graphs = _graphs(shape)
            tensors = {"q": q, "k": k, "v": v, "o": out, "do": d_out, "stats": stats}
            tensors |= {"dq": dq, "dk": dk, "dv": dv, **_meta(batch)}
            _execute(graphs.backward, graphs.nodes, "b", tensors, shape.device, graphs.workspace)
        return dq, dk, dv, None


def _meta(batch: _Batch) -> dict[str, torch.Tensor]:
    return {"seq_len": batch.seq_len, "q_offsets": batch.q_offsets, "kv_offsets": batch.kv_offsets}


def cudnn_ragged_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float
) -> torch.Tensor:
    """Document-causal attention of a packed stream (shapes as ``causal_thd_attention``).

    The caller checks :func:`usable` first."""
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    q, k, v = (x.contiguous() for x in (q, k, v))
    return _RaggedCausal.apply(q, k, v, _batches(layout, q, k, scale))
