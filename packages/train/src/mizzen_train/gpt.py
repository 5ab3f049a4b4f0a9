"""Build a megatron-core GPT with the local layer spec, for the slot executor.

One builder for tests, benchmarks and small jobs, so every caller gets the configuration the
executor supports: dropout-free (the CPU RNG stand-in never draws), no fused bias-dropout (which
would cost a 17 s ``torch.compile`` on the CPU), bf16 or fp32 weights, tensor parallelism taken
from the already-initialised ``megatron.core.parallel_state``.

Invariants:
- With ``cpu_initialization=True`` the weights are drawn in full on the host from ``seed`` and
  then sliced (megatron's CPU init), so the model is the same function at every TP size.
- The model is cast to its dtype as a whole (norms included), as megatron's ``Float16Module``
  would, and moved to ``device``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class GPTSpec:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    vocab_size: int = 128
    max_sequence_length: int = 64
    dtype: str = "fp32"

    def parameter_count(self) -> int:
        """Parameters of the full (unsharded) model, learned positions and untied output."""
        hidden, ffn = self.hidden_size, self.ffn_hidden_size or 4 * self.hidden_size
        per_layer = 4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden + 4 * hidden
        embeddings = (self.vocab_size + self.max_sequence_length) * hidden
        return self.num_layers * per_layer + embeddings + 2 * hidden + self.vocab_size * hidden


def build_gpt(
    spec: GPTSpec,
    *,
    device: str | torch.device,
    seed: int = 1234,
    cpu_initialization: bool | None = None,
) -> torch.nn.Module:
    """A ``GPTModel`` (local spec) for the current megatron parallel state, on ``device``."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if spec.dtype not in DTYPES:
        raise ValueError(f"GPTSpec.dtype={spec.dtype!r}: use one of {sorted(DTYPES)}")
    device = torch.device(device)
    if cpu_initialization is None:
        cpu_initialization = device.type == "cpu"
    dtype = DTYPES[spec.dtype]
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=cpu_initialization,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_sequence_length,
        parallel_output=True,
    )
    return model.to(device=device, dtype=dtype)
