"""Configuration of the Nemotron-H-style hybrid, read from and written to a Hugging Face-style dict.

Invariants:
- The dataclass fields are the one table: each field's metadata names its Hugging Face
  ``config.json`` key (and the legacy aliases HF still accepts); :meth:`NemotronHConfig.from_hf_dict`
  and :meth:`NemotronHConfig.to_hf_dict` are derived from it, so ``from_hf_dict(c.to_hf_dict()) == c``.
- A config object is always consistent: construction validates every field and raises one
  :class:`ModelConfigError` listing *all* problems, each naming the HF key, the rule and the fix.
- The layer pattern comes from ``hybrid_override_pattern`` (string) or ``layers_block_type`` (list);
  if both (or ``num_hidden_layers``) are given they must agree.
- HF keys that change the architecture in ways this plugin does not implement (MoE layers, MTP
  layers, attention bias, fp32 residual) are rejected when set, not ignored.  Other keys (token ids,
  dtype, ``architectures``, MoE sizes when no MoE layer exists, …) are ignored and listed in the log.
- The Mamba width is ``mamba_num_heads * mamba_head_dim``, as in HF's NemotronH; ``expand`` is not
  used (published configs do not always satisfy ``expand * hidden_size == heads * head_dim``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mizzen_plugins.nemotron_h.pattern import (
    LayerKind,
    PatternError,
    format_pattern,
    kinds_from_block_types,
    parse_pattern,
)

__all__ = ["MODEL_TYPE", "ModelConfigError", "NemotronHConfig"]

MODEL_TYPE = "nemotron_h"
ARCHITECTURE = "NemotronHForCausalLM"

logger = logging.getLogger(__name__)


class ModelConfigError(ValueError):
    """An inconsistent or unsupported Nemotron-H config; the message lists every problem."""


def _hf(key: str, *aliases: str, **kwargs: Any) -> Any:
    return field(metadata={"hf": key, "aliases": aliases}, **kwargs)


# HF keys that would change the architecture in a way this plugin does not implement:
# key -> (value that is fine, why).
_UNSUPPORTED_WHEN_SET: dict[str, tuple[Any, str]] = {
    "attention_bias": (False, "attention projections have no bias in NemotronH"),
    "residual_in_fp32": (False, "the residual stream is kept in the model dtype"),
    "num_nextn_predict_layers": (0, "multi-token-prediction layers are out of scope"),
}


@dataclass(frozen=True)
class NemotronHConfig:
    """A validated Nemotron-H-style hybrid config (our field names; HF keys in the metadata)."""

    vocab_size: int = _hf("vocab_size")
    hidden_size: int = _hf("hidden_size")
    layers: tuple[LayerKind, ...] = _hf("hybrid_override_pattern")
    # Mamba-2 mixer
    ssm_state_size: int = _hf("ssm_state_size", default=128)
    ssm_num_heads: int = _hf("mamba_num_heads", default=128)
    ssm_head_dim: int = _hf("mamba_head_dim", default=64)
    ssm_num_groups: int = _hf("n_groups", "mamba_n_groups", default=8)
    conv_kernel: int = _hf("conv_kernel", "mamba_d_conv", default=4)
    conv_bias: bool = _hf("use_conv_bias", "mamba_conv_bias", default=True)
    chunk_size: int = _hf("chunk_size", "mamba_chunk_size", default=128)
    ssm_activation: str = _hf("mamba_hidden_act", default="silu")
    proj_bias: bool = _hf("use_bias", default=False)
    dt_min: float = _hf("time_step_min", "mamba_dt_min", default=0.001)
    dt_max: float = _hf("time_step_max", "mamba_dt_max", default=0.1)
    dt_init_floor: float = _hf("time_step_floor", "mamba_dt_init_floor", default=1e-4)
    dt_limit: tuple[float, float] = _hf(
        "time_step_limit", "mamba_dt_limit", default=(0.0, float("inf"))
    )
    # attention
    num_attention_heads: int = _hf("num_attention_heads", default=32)
    num_key_value_heads: int = _hf("num_key_value_heads", default=8)
    attention_head_dim: int = _hf("head_dim", default=128)
    # MLP
    intermediate_size: int = _hf("intermediate_size", default=21504)
    mlp_activation: str = _hf("mlp_hidden_act", default="relu2")
    mlp_bias: bool = _hf("mlp_bias", default=False)
    # model
    norm_eps: float = _hf("layer_norm_epsilon", default=1e-5)
    tie_word_embeddings: bool = _hf("tie_word_embeddings", default=False)
    initializer_range: float = _hf("initializer_range", default=0.02)
    rescale_prenorm_residual: bool = _hf("rescale_prenorm_residual", default=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "dt_limit", tuple(self.dt_limit))
        problems = _validate(self)
        if problems:
            raise ModelConfigError(
                "NemotronH config is inconsistent:\n" + "\n".join(f"- {p}" for p in problems)
            )

    # ----------------------------------------------------------------------- derived sizes
    @property
    def pattern(self) -> str:
        return format_pattern(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def ssm_inner_size(self) -> int:
        """Width of the mixer's scanned stream: ``ssm_num_heads * ssm_head_dim``."""
        return self.ssm_num_heads * self.ssm_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the depthwise convolution: x, B and C."""
        return self.ssm_inner_size + 2 * self.ssm_num_groups * self.ssm_state_size

    @property
    def in_proj_size(self) -> int:
        """Output width of the mixer's input projection: gate z, x/B/C and dt (one per head)."""
        return self.ssm_inner_size + self.conv_channels + self.ssm_num_heads

    # ------------------------------------------------------------------------ HF dicts
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> NemotronHConfig:
        """Build from a Hugging Face ``config.json`` dict (NemotronH layout)."""
        if not isinstance(hf, Mapping):
            raise ModelConfigError(f"expected a config dict, got {type(hf).__name__}")
        problems: list[str] = []
        used: set[str] = set()
        model_type = hf.get("model_type", MODEL_TYPE)
        used.add("model_type")
        if model_type != MODEL_TYPE:
            problems.append(
                f"'model_type' = {model_type!r}: this plugin reads {MODEL_TYPE!r} configs. "
                "Fix: use the plugin for that model type."
            )
        for key, (fine, why) in _UNSUPPORTED_WHEN_SET.items():
            used.add(key)
            if key in hf and hf[key] not in (None, fine):
                problems.append(
                    f"{key!r} = {hf[key]!r} is not supported ({why}). Fix: set {fine!r}."
                )

        kwargs: dict[str, Any] = {}
        layers = _layers_from_hf(hf, problems, used)
        if layers is not None:
            kwargs["layers"] = layers
        for f in dataclasses.fields(cls):
            if f.name == "layers":
                continue
            keys = (f.metadata["hf"], *f.metadata["aliases"])
            present = [k for k in keys if k in hf]
            used.update(keys)
            if len(present) > 1 and len({_freeze(hf[k]) for k in present}) > 1:
                values = ", ".join(f"{k!r} = {hf[k]!r}" for k in present)
                problems.append(
                    f"{values} name the same setting with different values. Fix: keep one."
                )
                continue
            if not present:
                if f.default is dataclasses.MISSING:
                    problems.append(f"{keys[0]!r} is required but missing. Fix: add it.")
                continue
            value = hf[present[0]]
            if value is None and f.name == "num_key_value_heads":
                value = hf.get("num_attention_heads", f.default)  # HF: None means MHA
            if value is None and f.name == "attention_head_dim":
                heads = hf.get("num_attention_heads", _field_default(cls, "num_attention_heads"))
                value = hf.get("hidden_size", 0) // heads if heads else None
            if value is None:
                continue  # HF: None means "use the default"
            if f.name == "dt_limit" and isinstance(value, list | tuple):
                value = tuple(_decode_float(v) for v in value)
            kwargs[f.name] = _decode_float(value)
        if problems:
            raise ModelConfigError(
                "NemotronH config is inconsistent:\n" + "\n".join(f"- {p}" for p in problems)
            )
        ignored = sorted(set(hf) - used)
        if ignored:
            logger.info("NemotronH config: ignoring HF keys this plugin does not use: %s", ignored)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict of this config (hub NemotronH layout)."""
        hf: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE]}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "layers":
                hf["hybrid_override_pattern"] = format_pattern(value)
                hf["num_hidden_layers"] = len(value)
            elif f.name == "dt_limit":
                hf[f.metadata["hf"]] = list(value)
            else:
                hf[f.metadata["hf"]] = value
        for key, (fine, _) in _UNSUPPORTED_WHEN_SET.items():
            hf[key] = fine
        return hf


def _decode_float(value: Any) -> Any:
    """transformers >= 5 writes non-finite floats as ``{"__float__": "Infinity"}`` in JSON."""
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        return float(value["__float__"])
    return value


def _field_default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _layers_from_hf(
    hf: Mapping[str, Any], problems: list[str], used: set[str]
) -> tuple[LayerKind, ...] | None:
    used.update({"hybrid_override_pattern", "layers_block_type", "num_hidden_layers"})
    num_layers = hf.get("num_hidden_layers")
    if num_layers is not None and (not isinstance(num_layers, int) or isinstance(num_layers, bool)):
        problems.append(f"'num_hidden_layers' = {num_layers!r} must be an integer.")
        num_layers = None
    from_pattern = from_list = None
    try:
        if hf.get("hybrid_override_pattern") is not None:
            from_pattern = parse_pattern(hf["hybrid_override_pattern"], num_layers=num_layers)
        if hf.get("layers_block_type") is not None:
            from_list = kinds_from_block_types(hf["layers_block_type"], num_layers=num_layers)
    except PatternError as exc:
        problems.append(str(exc))
        return None
    if from_pattern is None and from_list is None:
        problems.append(
            "the layer pattern is missing. Fix: set 'hybrid_override_pattern' (e.g. 'M-M*-M-') "
            "or 'layers_block_type'."
        )
        return None
    if from_pattern is not None and from_list is not None and from_pattern != from_list:
        pairs = zip(from_pattern, from_list, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(from_list))
        first = min(first, len(from_pattern))
        problems.append(
            f"'hybrid_override_pattern' {format_pattern(from_pattern)!r} and 'layers_block_type' "
            f"(= {format_pattern(from_list)!r}) disagree from position {first}. Fix: keep one."
        )
        return None
    return from_pattern if from_pattern is not None else from_list


_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "ssm_state_size",
    "ssm_num_heads",
    "ssm_head_dim",
    "ssm_num_groups",
    "conv_kernel",
    "chunk_size",
    "num_attention_heads",
    "num_key_value_heads",
    "attention_head_dim",
    "intermediate_size",
)
_BOOLS = ("conv_bias", "proj_bias", "mlp_bias", "tie_word_embeddings", "rescale_prenorm_residual")


def _validate(config: NemotronHConfig) -> list[str]:
    """Every rule a config must satisfy; each problem names the HF key and the fix."""
    key = {f.name: f.metadata["hf"] for f in dataclasses.fields(config)}
    problems: list[str] = []
    if not config.layers or not all(isinstance(k, LayerKind) for k in config.layers):
        problems.append(
            f"{key['layers']!r} must be a non-empty sequence of layer kinds, got {config.layers!r}."
        )
    for name in _POSITIVE_INTS:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            problems.append(f"{key[name]!r} = {value!r} must be a positive integer.")
    for name in _BOOLS:
        value = getattr(config, name)
        if not isinstance(value, bool):
            problems.append(f"{key[name]!r} = {value!r} must be true or false.")
    if problems:
        return problems  # the relations below assume well-typed fields

    kinds = set(config.layers)
    if LayerKind.SSM in kinds and config.ssm_num_heads % config.ssm_num_groups:
        problems.append(
            f"'n_groups' = {config.ssm_num_groups} must divide 'mamba_num_heads' = "
            f"{config.ssm_num_heads} (remainder {config.ssm_num_heads % config.ssm_num_groups}): "
            "each group of B/C is shared by the same number of heads. Fix: pick a divisor."
        )
    if LayerKind.ATTENTION in kinds and config.num_attention_heads % config.num_key_value_heads:
        problems.append(
            f"'num_key_value_heads' = {config.num_key_value_heads} must divide "
            f"'num_attention_heads' = {config.num_attention_heads} (remainder "
            f"{config.num_attention_heads % config.num_key_value_heads}). Fix: pick a divisor."
        )
    if config.ssm_activation != "silu":
        problems.append(
            f"'mamba_hidden_act' = {config.ssm_activation!r} is not supported. Fix: use 'silu'."
        )
    if config.mlp_activation != "relu2":
        problems.append(
            f"'mlp_hidden_act' = {config.mlp_activation!r} is not supported (NemotronH MLPs use "
            "squared ReLU). Fix: use 'relu2'."
        )
    if not (0 < config.dt_min <= config.dt_max):
        problems.append(
            f"'time_step_min' = {config.dt_min!r} and 'time_step_max' = {config.dt_max!r} must "
            "satisfy 0 < min <= max. Fix: e.g. 0.001 and 0.1."
        )
    if not config.dt_init_floor >= 0:
        problems.append(f"'time_step_floor' = {config.dt_init_floor!r} must be >= 0.")
    low_high = config.dt_limit
    if (
        len(low_high) != 2
        or not all(isinstance(v, int | float) and not math.isnan(v) for v in low_high)
        or not (0 <= low_high[0] < low_high[1])
    ):
        problems.append(
            f"'time_step_limit' = {list(low_high)!r} must be [low, high] with 0 <= low < high. "
            "Fix: e.g. [0.0, Infinity]."
        )
    if not (isinstance(config.norm_eps, int | float) and config.norm_eps > 0):
        problems.append(f"'layer_norm_epsilon' = {config.norm_eps!r} must be > 0.")
    if not (isinstance(config.initializer_range, int | float) and config.initializer_range > 0):
        problems.append(f"'initializer_range' = {config.initializer_range!r} must be > 0.")
    return problems
