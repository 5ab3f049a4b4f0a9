"""Hugging Face Llama checkpoints in and out of megatron-core.

- :mod:`.mapping` -- the one megatron <-> HF name and fused-layout table (q/k/v, gate/up).
- :mod:`.config` -- ``config.json`` validated into a :class:`~mizzen_train.gpt.GPTSpec`.
- :mod:`.convert` -- :func:`import_hf_llama` (directory -> megatron model) and
  :func:`export_hf_snapshot` (base or base + one slot's merged LoRA -> directory).
- :mod:`.peft` -- :func:`export_peft_adapter` (one slot's adapter -> a PEFT adapter directory).
- :mod:`.tiny` -- :func:`write_tiny_llama`, small random Llamas created by code.

Invariant: importing this package loads torch at most; transformers and safetensors are imported
inside the functions that use them.
"""

from mizzen_train.hf.config import HFLlamaConfig, read_llama_config
from mizzen_train.hf.convert import (
    ImportedModel,
    export_hf_snapshot,
    import_hf_llama,
    megatron_to_hf_state,
    read_hf_weights,
)
from mizzen_train.hf.mapping import LINEARS, LlamaLayout, hf_linear_names, hf_param_names
from mizzen_train.hf.peft import export_peft_adapter
from mizzen_train.hf.tiny import LLAMA_100M, tiny_llama_config, write_tiny_llama

__all__ = [
    "LINEARS",
    "LLAMA_100M",
    "HFLlamaConfig",
    "ImportedModel",
    "LlamaLayout",
    "export_hf_snapshot",
    "export_peft_adapter",
    "hf_linear_names",
    "hf_param_names",
    "import_hf_llama",
    "megatron_to_hf_state",
    "read_hf_weights",
    "read_llama_config",
    "tiny_llama_config",
    "write_tiny_llama",
]
