"""Hugging Face Llama ``config.json`` <-> :class:`~mizzen_train.gpt.GPTSpec`.

Invariants:
- The file is read as untrusted JSON and every field the conversion needs is type- and
  range-checked with the file and the field named; Hugging Face's own ``LlamaConfig`` then
  supplies its documented defaults for absent keys (so a missing ``num_key_value_heads`` means
  what it means to ``transformers``) and normalises the rope fields across versions.
- What the Llama shape on megatron cannot express is refused, never approximated: another
  ``model_type``, an activation other than SiLU, attention or MLP biases, rope scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mizzen_train.errors import HFModelError
from mizzen_train.gpt import GPTSpec
from mizzen_train.input_files import MAX_MODEL_CONFIG_BYTES, read_json_file

CONFIG_FILE = "config.json"
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_OPTIONAL_POSITIVE_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class HFLlamaConfig:
    """A validated Llama config: the megatron spec it builds and the raw JSON (for export)."""

    path: Path
    spec: GPTSpec
    raw: dict[str, Any]


def _fail(path: Path, field: str, value: Any, rule: str, fix: str) -> HFModelError:
    return HFModelError(f"{path}: {field}={value!r}: {rule}. Fix: {fix}")


def read_llama_config(directory: str | Path, *, dtype: str = "fp32") -> HFLlamaConfig:
    """Validate ``<directory>/config.json`` and derive the megatron :class:`GPTSpec`."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise HFModelError(
            f"{path}: no such file; a Hugging Face model directory holds config.json and "
            "*.safetensors. Fix: point model.path at such a directory (or 'tiny')"
        )
    try:
        raw = read_json_file(path, MAX_MODEL_CONFIG_BYTES)
    except (OSError, ValueError) as exc:
        raise HFModelError(f"{path}: unreadable ({exc}). Fix: restore the file") from None
    if not isinstance(raw, dict):
        raise _fail(path, "<root>", type(raw).__name__, "must be a JSON object", "restore it")
    if raw.get("model_type") != "llama":
        raise _fail(
            path,
            "model_type",
            raw.get("model_type"),
            "mizzen_train.hf imports the Llama family only",
            "use a checkpoint with model_type 'llama' (LlamaForCausalLM)",
        )
    for field in _POSITIVE_INTS:
        value = raw.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _fail(path, field, value, "must be a positive integer", "fix config.json")
    for field in _OPTIONAL_POSITIVE_INTS:
        value = raw.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise _fail(path, field, value, "must be a positive integer or absent", "fix it")
    if raw.get("hidden_act", "silu") != "silu":
        raise _fail(
            path, "hidden_act", raw["hidden_act"], "the Llama shape is SwiGLU (silu)", "use silu"
        )
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field, False) is not False:
            raise _fail(
                path,
                field,
                raw[field],
                "biases are not part of the Llama shape mizzen builds",
                f"use a checkpoint with {field}=false",
            )
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise _fail(path, "rms_norm_eps", eps, "must be a number in (0, 1)", "fix config.json")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise _fail(path, "tie_word_embeddings", tie, "must be true or false", "fix config.json")

    import transformers

    try:
        config = transformers.LlamaConfig.from_dict(dict(raw))
    except Exception as exc:
        raise HFModelError(
            f"{path}: transformers' LlamaConfig refuses it ({type(exc).__name__}: {exc}). "
            "Fix: correct config.json"
        ) from None
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not rope and getattr(config, "rope_theta", None) is not None:  # transformers < 5
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
        if getattr(config, "rope_scaling", None):
            rope.update(config.rope_scaling)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _fail(
            path,
            "rope_scaling",
            rope_type,
            "scaled rotary embeddings are not converted yet",
            "use a checkpoint with plain rotary embeddings (rope_type 'default')",
        )
    theta = rope.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta):
        raise _fail(path, "rope_theta", theta, "must be a finite number", "fix config.json")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = config.num_key_value_heads or heads
    if heads % kv_heads:
        raise _fail(
            path, "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}", "fix"
        )
    spec = GPTSpec.llama(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        ffn_hidden_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_sequence_length=int(config.max_position_embeddings),
        norm_epsilon=float(config.rms_norm_eps),
        rotary_base=float(theta),
        tie_embeddings=bool(config.tie_word_embeddings),
        dtype=dtype,
    )
    try:
        spec.check()
    except ValueError as exc:
        raise HFModelError(f"{path}: {exc}") from None
    return HFLlamaConfig(path=path, spec=spec, raw=raw)


def export_config(source: HFLlamaConfig, *, dtype: str) -> dict[str, Any]:
    """The config.json of an exported snapshot: the source's, with the weights' dtype."""
    config = dict(source.raw)
    config["architectures"] = ["LlamaForCausalLM"]
    torch_name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    config["dtype"] = torch_name
    if "torch_dtype" in config:
        config["torch_dtype"] = torch_name
    return config
