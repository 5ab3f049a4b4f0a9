"""Small Llama models created by code (never downloaded), as Hugging Face directories.

:func:`write_tiny_llama` builds ``transformers``' ``LlamaForCausalLM`` from the embedded engine's
packaged tiny config (``tiny_llama.json``: hidden 64, 2 layers, byte vocabulary of 259) with any
field overridden, draws its weights from ``seed``, and saves it with the byte tokenizer
(:func:`mizzen_rollout.api.hf_byte_tokenizer`).  Tests, the README's demo
(``model.path = "tiny"``) and the GPU e2e tests and benchmarks (:data:`LLAMA_100M`, a
~100M-parameter override) all use it.

Invariants:
- The same ``(seed, overrides)`` writes the same weights (bit for bit) on every machine.
- The directory appears whole or not at all (written to a temporary sibling, then renamed).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

#: The ~101M-parameter Llama of the GPU e2e tests and benchmarks (with the byte vocabulary):
#: 16 x (attention 1.57M + SwiGLU 4.72M) + embeddings.
LLAMA_100M: dict[str, int] = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
}


#: Fields transformers' ``LlamaConfig`` takes that the packaged tiny config leaves out, each with
#: the value it has for the packaged model (its type is the field's): a ``[model.tiny]`` table
#: may set them too (:func:`mizzen_train.run.sections.check_tiny`).
LLAMA_EXTRA_FIELDS: dict[str, Any] = {"head_dim": 16, "rope_theta": 10000.0}


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    """The embedded engine's tiny Llama config with ``overrides`` applied (a plain dict)."""
    from mizzen_rollout.api import load_tiny_config

    config = load_tiny_config()
    unknown = sorted(set(overrides) - set(config) - set(LLAMA_EXTRA_FIELDS))
    if unknown:
        raise ValueError(
            f"tiny llama overrides {unknown} are not fields of the tiny config; use some of "
            f"{sorted(config)}"
        )
    config.update(overrides)
    return config


def write_tiny_llama(directory: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Create a randomly initialised Llama (HF format, byte tokenizer) at ``directory``."""
    import torch
    import transformers

    from mizzen_rollout.api import hf_byte_tokenizer

    target = Path(directory)
    if target.exists():
        raise FileExistsError(f"{target} exists; write_tiny_llama creates a fresh directory")
    config_dict = tiny_llama_config(**overrides)
    model_type = config_dict.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **config_dict)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(str(tmp))
        hf_byte_tokenizer().save_pretrained(str(tmp))
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
