"""GPTModel's call signature over a plugin model, so the slot executor drives it unchanged.

:class:`PluginGPT` holds a plugin's causal LM (``forward(input_ids [T], cu_seqlens)`` ->
``[T, vocab]``, each packed sequence as if alone) as ``lm`` and answers what the executor asks of
megatron-core's ``GPTModel``:

- ``forward(input_ids [b, s], position_ids [b, s], attention_mask, packed_seq_params=None)``
  returns logits ``[b, s, vocab]``, as ``GPTModel.forward`` does with ``labels=None``;
- ``config`` (a megatron ``TransformerConfig``: dtype, the parallel sizes the executor checks, the
  config the per-slot DDP reads), ``vocab_size``, ``max_sequence_length``, and what megatron's
  forward-backward schedule reads on CUDA (``model_type``, ``set_input_tensor``).

Which sequences a batch holds:

- ``packed_seq_params`` (megatron's ``PackedSeqParams``, ``qkv_format="thd"``): ``input_ids`` is
  ``[1, T]`` and ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) delimits the sequences;
- otherwise the dense mask (``[b or 1, 1, s, s]``, True = masked): a token starts a sequence when it
  may not see the token before it; the mask must then be exactly the document-causal mask of
  those sequences (causal inside a sequence, nothing across), else the call is refused -- a plugin
  model cannot express any other mask, and approximating it would train on wrong logits.  Rows are
  laid end to end (row-major), so a row boundary always ends a sequence.
- ``position_ids`` must be the in-sequence positions (0 at each start): the plugins derive
  positions from the sequences themselves, so other positions are refused rather than ignored.

Invariants: the logits are exactly the plugin model's on the derived packed stream; nothing is
approximated; tensor parallelism is not supported (plain ``nn.Linear`` layers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PluginGPT", "cu_seqlens_from_mask", "transformer_config"]


def transformer_config(dtype: torch.dtype, hidden_size: int):
    """The megatron config of a plugin model: one rank of every parallel kind, ``dtype``."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
    )


class PluginGPT(nn.Module):
    """A plugin causal LM behind GPTModel's call signature (see the module docstring)."""

    def __init__(
        self, lm: nn.Module, *, vocab_size: int, max_sequence_length: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.lm = lm
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        hidden = getattr(getattr(lm, "embedding", None), "embedding_dim", 1)
        self.config = transformer_config(dtype, hidden)
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder  # what megatron's schedules read

    def set_input_tensor(self, input_tensor: Any) -> None:
        """megatron's schedules call it; without pipeline parallelism there is nothing to set."""
        del input_tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        packed_seq_params: Any = None,
        **unused: Any,
    ) -> torch.Tensor:
        if unused.get("labels") is not None:
            raise ValueError("PluginGPT returns logits only; call it with labels=None")
        rows, seq = input_ids.shape
        if packed_seq_params is not None:
            cu_seqlens = _packed_cu_seqlens(packed_seq_params, rows, seq)
        else:
            cu_seqlens = cu_seqlens_from_mask(attention_mask, rows, seq)
        if position_ids is not None:
            _check_positions(position_ids, cu_seqlens, rows, seq)
        logits = self.lm(input_ids.reshape(-1), cu_seqlens)
        return logits.view(rows, seq, -1)


def _packed_cu_seqlens(params: Any, rows: int, seq: int) -> torch.Tensor:
    qkv_format = getattr(params, "qkv_format", "thd")
    if qkv_format != "thd":
        raise ValueError(
            f"packed_seq_params.qkv_format={qkv_format!r}: only 'thd' (a [1, T] packed stream)"
        )
    if rows != 1:
        raise ValueError(f"packed (THD) input_ids must be [1, T], got [{rows}, {seq}]")
    padded = getattr(params, "cu_seqlens_q_padded", None)
    cu_seqlens = padded if padded is not None else params.cu_seqlens_q
    if int(cu_seqlens[-1]) != seq or int(cu_seqlens[0]) != 0:
        raise ValueError(
            f"packed_seq_params.cu_seqlens spans {int(cu_seqlens[0])}..{int(cu_seqlens[-1])} "
            f"but input_ids holds {seq} tokens"
        )
    return cu_seqlens.to(torch.int64)


def cu_seqlens_from_mask(mask: torch.Tensor | None, rows: int, seq: int) -> torch.Tensor:
    """``cu_seqlens`` of the rows laid end to end, from a document-causal dense mask (True =
    masked); refused unless the mask is exactly that of the sequences it implies."""
    device = mask.device if mask is not None else torch.device("cpu")
    starts = torch.zeros(rows, seq, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:] != (1, seq, seq):
            raise ValueError(
                f"attention_mask must be a bool [b, 1, {seq}, {seq}] mask, got {mask.dtype} "
                f"{tuple(mask.shape)}"
            )
        square = mask[:, 0].expand(rows, seq, seq)
        index = torch.arange(1, seq, device=device)
        starts[:, 1:] = square[:, index, index - 1]
        segments = starts.cumsum(dim=1)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        allowed = (segments.unsqueeze(2) == segments.unsqueeze(1)) & causal
        if not torch.equal(square, ~allowed):
            raise ValueError(
                "attention_mask is not a document-causal mask (causal within each sequence, "
                "nothing across sequences); a plugin model runs only those"
            )
    offsets = starts.reshape(-1).nonzero().flatten()
    end = torch.tensor([rows * seq], device=offsets.device)
    return torch.cat([offsets, end]).to(torch.int64)


def _check_positions(position_ids: torch.Tensor, cu_seqlens: torch.Tensor, rows: int, seq: int):
    flat = torch.arange(rows * seq, device=cu_seqlens.device)
    starts = cu_seqlens[:-1]
    owner = torch.searchsorted(starts, flat, right=True) - 1
    expected = (flat - starts[owner]).view(rows, seq)
    if not torch.equal(position_ids.to(expected.device, torch.int64).expand(rows, seq), expected):
        raise ValueError(
            "position_ids must restart at 0 at every sequence start: a plugin model derives "
            "positions from its sequences"
        )
