"""Packed (THD) core attention for the trainers' megatron GPT: no dense masks, no cross-sample mixing.

:class:`PackedCoreAttention` is the ``core_attention`` submodule of the layer spec
:func:`mizzen_train.gpt.build_gpt` builds.  It receives megatron's query/key/value either as a
packed stream (``qkv_format="thd"``: ``[tokens, heads, dim]``, the model's input ``[1, T]``) or as
rows (``[s, b, heads, dim]``), and runs document-causal attention over the segments that
``packed_seq_params`` describes, through :func:`mizzen_plugins.attention.causal_thd_attention`
(``"reference"`` on the CPU, ``"auto"`` -- cuDNN ragged / the length-bucketed fast path / flash
varlen -- on CUDA), or through :func:`mizzen_plugins.context_parallel.context_parallel_causal_attention`
when the stream is split over context-parallel ranks.

Rotary embeddings are applied here, per token, at the token's position *inside its segment*
(megatron's model is built with ``position_embedding_type="none"`` for the rope shape): megatron's
own THD rope loops over segments in Python with a host sync per layer and splits sequences for
context parallelism its own way, which is neither fast nor the load-balanced stream split used
here.  The arithmetic is megatron's unfused rope (``inv_freq`` from its ``RotaryEmbedding``,
``cos``/``sin`` cast to the activations' dtype, non-interleaved halves), so weights trained either
way are the same function.

:class:`PackedStream` is megatron's ``PackedSeqParams`` (``qkv_format``, ``cu_seqlens_q/kv``,
``max_seqlen_q/kv``) plus what the kernels reuse across layers: the host-side
:class:`~mizzen_plugins.thd.PackedLayout` (bucket plans are cached on it), the rope positions, and
the context-parallel shard.  A plain ``PackedSeqParams`` works too (layout and positions are derived from
``cu_seqlens_q``, one host read).

Invariants:
- A query attends only to earlier-or-equal tokens of its own segment.  Rows
  (``[s, b, heads, dim]``) are read row-major as one stream whose segments must cover every
  token (the executor hands the packed stream; rows are for callers without one).
- Rotary positions restart at 0 at every segment start (under context parallelism: the positions
  of the rank's tokens in the global stream's segments).
- No dense ``[s, s]`` mask is ever built; ``attention_mask`` must be ``None``.
- ``mizzen_plugins`` is imported inside functions only (the lazy-import invariant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

#: Implementation names accepted by :class:`PackedStream` (``None``: by device).
IMPLS = ("auto", "reference", "fast", "varlen", "cudnn", "flex")


def default_impl(device: torch.device) -> str:
    """``"auto"`` (fast kernels) on CUDA, the plain ``"reference"`` loop elsewhere."""
    return "auto" if device.type == "cuda" else "reference"


@dataclass
class PackedStream(PackedSeqParams):
    """megatron's packed-sequence carrier plus the host-side facts every layer reuses."""

    #: Segments of the stream this rank's attention sees (the global padded stream under CP).
    layout: Any = None
    #: ``[local tokens]`` rotary position of each token (restarting per segment).
    positions: torch.Tensor | None = None
    #: :class:`mizzen_plugins.context_parallel.CPShard` of this rank, ``None`` without CP.
    cp_shard: Any = None
    #: Attention implementation (see :data:`IMPLS`); ``None`` = :func:`default_impl`.
    impl: str | None = None
    _rotary_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.impl is not None and self.impl not in IMPLS:
            raise ValueError(
                f"PackedStream.impl={self.impl!r}: use one of {IMPLS}, or None for the "
                "device's default (the fast kernels on CUDA, the reference loop on the CPU)"
            )

    def stream_layout(self):
        from mizzen_plugins.thd import PackedLayout

        if self.layout is None:
            self.layout = PackedLayout.from_cu_seqlens(self.cu_seqlens_q)
        return self.layout

    def rotary_positions(self, device: torch.device) -> torch.Tensor:
        if self.positions is None:
            self.positions = self.stream_layout().to(device).positions
        return self.positions.to(device)

    def rotary_cos_sin(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        """``(cos, sin)`` ``[tokens, 1, dim]`` in ``dtype``, built once per stream (all layers)."""
        # one stream serves one model, whose layers share one rope (base and head dim)
        key = (tuple(inv_freq.shape), dtype, inv_freq.device)
        cached = self._rotary_cache.get(key)
        if cached is None:
            positions = self.rotary_positions(inv_freq.device).to(inv_freq.dtype)
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
            cached = (torch.cos(emb).to(dtype), torch.sin(emb).to(dtype))
            self._rotary_cache[key] = cached
        return cached


def packed_stream(
    layout,
    *,
    device: torch.device | str,
    positions: torch.Tensor | None = None,
    qkv_format: str = "thd",
    cp_shard: Any = None,
    cp_group: Any = None,
    impl: str | None = None,
) -> PackedStream:
    """The :class:`PackedStream` of a host :class:`~mizzen_plugins.thd.PackedLayout` on
    ``device`` (rope positions: restarting per segment unless given)."""
    device = torch.device(device)
    cu_seqlens = layout.cu_seqlens.to(device=device, dtype=torch.int32)
    on_device = layout.to(device)
    return PackedStream(
        qkv_format=qkv_format,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
        layout=on_device,
        positions=(on_device.positions if positions is None else positions.to(device)),
        cp_shard=cp_shard,
        cp_group=cp_group,
        impl=impl,
    )


def rows_stream(rows: int, seq_len: int) -> PackedStream:
    """Every row one causal segment (what an unpacked ``[b, s]`` batch means)."""
    from mizzen_plugins.thd import PackedLayout

    layout = PackedLayout.from_lengths([seq_len] * rows)
    return PackedStream(
        qkv_format="sbhd",
        cu_seqlens_q=layout.cu_seqlens,
        cu_seqlens_kv=layout.cu_seqlens,
        max_seqlen_q=seq_len,
        max_seqlen_kv=seq_len,
        layout=layout,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's unfused non-interleaved rope on ``[tokens, heads, dim]``."""
    rot = cos.shape[-1]
    if rot == t.shape[-1]:
        return t * cos + _rotate_half(t) * sin
    head, tail = t[..., :rot], t[..., rot:]
    return torch.cat((head * cos + _rotate_half(head) * sin, tail), dim=-1)


class PackedCoreAttention(MegatronModule):
    """megatron ``core_attention`` over packed streams (see the module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        rotary_base: float | None = None,
    ) -> None:
        super().__init__(config=config)
        del attn_mask_type, attention_type, cp_comm_type, pg_collection
        if (attention_dropout or config.attention_dropout) not in (0, 0.0, None):
            raise ValueError(
                f"PackedCoreAttention: attention_dropout={config.attention_dropout}; the packed "
                "kernels run without dropout: set attention_dropout=0.0"
            )
        self.layer_number = max(1, layer_number)
        self.softmax_scale = softmax_scale
        # megatron's RotaryEmbedding.inv_freq: a plain fp32 attribute (never cast with the model)
        self.inv_freq = None
        if rotary_base is not None:
            dim = config.kv_channels
            steps = torch.arange(0, dim, 2, dtype=torch.float32)
            self.inv_freq = 1.0 / (rotary_base ** (steps / dim))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        del attn_mask_type
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "PackedCoreAttention takes no dense attention mask or bias: describe the "
                "segments with packed_seq_params (cu_seqlens) and pass attention_mask=None"
            )
        rows = query.dim() == 4  # [s, b, heads, dim]; else the [tokens, heads, dim] stream
        if rows:
            seq_len, batch = query.shape[:2]
            params = packed_seq_params or rows_stream(batch, seq_len)
            query, key, value = (self._rows_to_stream(t) for t in (query, key, value))
        else:
            if packed_seq_params is None:
                raise ValueError("a [tokens, heads, dim] input needs packed_seq_params")
            params = packed_seq_params
        if not isinstance(params, PackedStream):
            params = _as_stream(params)
        if rows and params.stream_layout().num_tokens != query.shape[0]:
            raise ValueError(
                f"packed_seq_params' segments cover {params.stream_layout().num_tokens} tokens "
                f"but the [s, b] rows hold {query.shape[0]}: rows are one stream, row-major, "
                "so the segments must cover every token (pack the real tokens into a [1, T] "
                "stream to leave padding out)"
            )
        if self.inv_freq is not None:
            if self.inv_freq.device != query.device:
                self.inv_freq = self.inv_freq.to(query.device)
            cos, sin = params.rotary_cos_sin(self.inv_freq, query.dtype)
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        out = self._attend(query, key, value, params)
        if rows:
            return self._stream_to_rows(out, seq_len, batch)
        return out.reshape(out.shape[0], -1)

    def _attend(self, q, k, v, params: PackedStream) -> torch.Tensor:
        impl = params.impl or default_impl(q.device)
        if params.cp_shard is not None and params.cp_shard.cp_size > 1:
            from mizzen_plugins.context_parallel import context_parallel_causal_attention

            piece_impl = "reference" if impl == "reference" else "fast"
            return context_parallel_causal_attention(
                q,
                k,
                v,
                params.cp_shard,
                params.cp_group,
                scale=self.softmax_scale,
                impl=piece_impl,
            )
        from mizzen_plugins.attention import causal_thd_attention

        layout = params.stream_layout()
        if layout.device != q.device:
            layout = params.layout = layout.to(q.device)
        return causal_thd_attention(q, k, v, layout, scale=self.softmax_scale, impl=impl)

    @staticmethod
    def _rows_to_stream(t: torch.Tensor) -> torch.Tensor:
        seq_len, batch = t.shape[:2]
        return t.transpose(0, 1).reshape(batch * seq_len, *t.shape[2:])

    @staticmethod
    def _stream_to_rows(out: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
        width = out.shape[1] * out.shape[2]
        return out.reshape(batch, seq_len, width).transpose(0, 1).contiguous()


def _as_stream(params: PackedSeqParams) -> PackedStream:
    """A plain megatron ``PackedSeqParams`` as a :class:`PackedStream` (same segments), built
    once per params object (every layer reuses it)."""
    cached = getattr(params, "_mizzen_stream", None)
    if cached is not None:
        return cached
    if params.cu_seqlens_q is None:
        raise ValueError("packed_seq_params needs cu_seqlens_q ([0, L0, L0+L1, ...])")
    if params.cu_seqlens_kv is not None and not torch.equal(
        params.cu_seqlens_kv.cpu(), params.cu_seqlens_q.cpu()
    ):
        raise ValueError("self-attention over a packed stream needs cu_seqlens_kv == cu_seqlens_q")
    stream = PackedStream(
        qkv_format=params.qkv_format,
        cu_seqlens_q=params.cu_seqlens_q,
        cu_seqlens_kv=params.cu_seqlens_kv,
        max_seqlen_q=params.max_seqlen_q,
        max_seqlen_kv=params.max_seqlen_kv,
        cp_group=params.cp_group,
    )
    params._mizzen_stream = stream
    return stream
