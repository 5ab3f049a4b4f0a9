"""Weight names between :class:`~mizzen_plugins.nemotron_h.model.HybridCausalLM` and Hugging Face.

The Hugging Face NemotronH checkpoint layout (hub ``model.safetensors``) is::

    backbone.embeddings.weight                      backbone.norm_f.weight        lm_head.weight
    backbone.layers.{i}.norm.weight
    backbone.layers.{i}.mixer.{in_proj.weight, conv1d.weight, conv1d.bias, dt_bias, A_log, D,
                               norm.weight, out_proj.weight}                         (M layers)
    backbone.layers.{i}.mixer.{q_proj, k_proj, v_proj, o_proj}.weight              (* layers)
    backbone.layers.{i}.mixer.{up_proj, down_proj}.weight                          (- layers)

(``transformers`` >= 5 holds the same tensors under ``model.`` instead of ``backbone.``; pass
``prefix="model."`` for that in-memory layout.)

Invariants:
- :data:`WEIGHT_RULES` is the one table; both directions are derived from it, so
  ``from_hf(to_hf(sd)) == sd`` for every config.
- Conversions are exact (reshapes, concatenation and splits only; no dtype change).
- A conversion either returns a complete state dict or raises naming every missing, unexpected or
  mis-shaped key; it never returns a partial result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mizzen_plugins.nemotron_h.config import NemotronHConfig
from mizzen_plugins.nemotron_h.pattern import LayerKind

__all__ = [
    "HUB_PREFIX",
    "MEMORY_PREFIX",
    "WEIGHT_RULES",
    "WeightMappingError",
    "WeightRule",
    "from_hf",
    "hf_linear_modules",
    "to_hf",
]

HUB_PREFIX = "backbone."
#: Where ``transformers`` >= 5 holds the backbone in memory (module paths of a loaded model).
MEMORY_PREFIX = "model."


class WeightMappingError(KeyError):
    """A state dict that does not match the config's layout."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class WeightRule:
    """Our key <-> Hugging Face key(s) for one tensor.

    ``layer``: the layer kind the rule applies to (``{i}`` in the keys is the layer index), or None
    for model-level tensors.  ``when``: the name of a boolean config field that must be true for
    the tensor to exist (biases, untied head), or None.  ``op``: ``"same"`` (one tensor, same
    shape), ``"conv"`` (ours ``[C, K]`` <-> HF ``[C, 1, K]``) or ``"qkv"`` (ours is the row-wise
    concatenation of HF's q, k, v).  ``hf`` keys are relative to the ``backbone.`` prefix unless
    they start with ``/`` (top-level, e.g. ``lm_head``).
    """

    ours: str
    hf: tuple[str, ...]
    layer: LayerKind | None = None
    when: str | None = None
    op: str = "same"


_M, _A, _L = LayerKind.SSM, LayerKind.ATTENTION, LayerKind.MLP
_MIX = "layers.{i}.mixer."

WEIGHT_RULES: tuple[WeightRule, ...] = (
    WeightRule("embedding.weight", ("embeddings.weight",)),
    WeightRule("final_norm.weight", ("norm_f.weight",)),
    WeightRule("lm_head.weight", ("/lm_head.weight",), when="untied_head"),
    *(
        WeightRule("layers.{i}.norm.weight", ("layers.{i}.norm.weight",), layer=k)
        for k in (_M, _A, _L)
    ),
    # Mamba-2 mixer
    WeightRule("layers.{i}.ssm.in_proj.weight", (_MIX + "in_proj.weight",), _M),
    WeightRule("layers.{i}.ssm.in_proj.bias", (_MIX + "in_proj.bias",), _M, when="proj_bias"),
    WeightRule("layers.{i}.ssm.conv_weight", (_MIX + "conv1d.weight",), _M, op="conv"),
    WeightRule("layers.{i}.ssm.conv_bias", (_MIX + "conv1d.bias",), _M, when="conv_bias"),
    WeightRule("layers.{i}.ssm.dt_bias", (_MIX + "dt_bias",), _M),
    WeightRule("layers.{i}.ssm.A_log", (_MIX + "A_log",), _M),
    WeightRule("layers.{i}.ssm.D", (_MIX + "D",), _M),
    WeightRule("layers.{i}.ssm.norm.weight", (_MIX + "norm.weight",), _M),
    WeightRule("layers.{i}.ssm.out_proj.weight", (_MIX + "out_proj.weight",), _M),
    WeightRule("layers.{i}.ssm.out_proj.bias", (_MIX + "out_proj.bias",), _M, when="proj_bias"),
    # attention
    WeightRule(
        "layers.{i}.attention.qkv_proj.weight",
        (_MIX + "q_proj.weight", _MIX + "k_proj.weight", _MIX + "v_proj.weight"),
        _A,
        op="qkv",
    ),
    WeightRule("layers.{i}.attention.out_proj.weight", (_MIX + "o_proj.weight",), _A),
    # MLP
    WeightRule("layers.{i}.mlp.up_proj.weight", (_MIX + "up_proj.weight",), _L),
    WeightRule("layers.{i}.mlp.up_proj.bias", (_MIX + "up_proj.bias",), _L, when="mlp_bias"),
    WeightRule("layers.{i}.mlp.down_proj.weight", (_MIX + "down_proj.weight",), _L),
    WeightRule("layers.{i}.mlp.down_proj.bias", (_MIX + "down_proj.bias",), _L, when="mlp_bias"),
)


@dataclass(frozen=True)
class _Concrete:
    ours: str
    hf: tuple[str, ...]
    op: str


def _concrete_rules(config: NemotronHConfig, prefix: str) -> list[_Concrete]:
    """The table expanded for ``config``'s layers and optional tensors."""
    flags = {
        "untied_head": not config.tie_word_embeddings,
        "proj_bias": config.proj_bias,
        "conv_bias": config.conv_bias,
        "mlp_bias": config.mlp_bias,
    }

    def hf_key(template: str, i: int | None) -> str:
        key = template.format(i=i)
        return key[1:] if key.startswith("/") else prefix + key

    out = []
    for rule in WEIGHT_RULES:
        if rule.when is not None and not flags[rule.when]:
            continue
        layers = (
            [None]
            if rule.layer is None
            else [i for i, k in enumerate(config.layers) if k is rule.layer]
        )
        for i in layers:
            out.append(
                _Concrete(rule.ours.format(i=i), tuple(hf_key(h, i) for h in rule.hf), rule.op)
            )
    return out


def _qkv_sizes(config: NemotronHConfig) -> list[int]:
    q = config.num_attention_heads * config.attention_head_dim
    kv = config.num_key_value_heads * config.attention_head_dim
    return [q, kv, kv]


def to_hf(
    state_dict: Mapping[str, torch.Tensor], config: NemotronHConfig, *, prefix: str = HUB_PREFIX
) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face NemotronH names (``prefix="model."`` for transformers>=5)."""
    rules = _concrete_rules(config, prefix)
    _check_keys(state_dict, [r.ours for r in rules], "our", "to_hf")
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        tensor = state_dict[rule.ours]
        if rule.op == "conv":
            out[rule.hf[0]] = tensor.unsqueeze(1)
        elif rule.op == "qkv":
            for key, part in zip(rule.hf, tensor.split(_qkv_sizes(config), dim=0), strict=True):
                out[key] = part
        else:
            out[rule.hf[0]] = tensor
    return out


def from_hf(
    hf_state_dict: Mapping[str, torch.Tensor],
    config: NemotronHConfig,
    *,
    prefix: str = HUB_PREFIX,
) -> dict[str, torch.Tensor]:
    """Hugging Face NemotronH names -> our state dict (load it with ``load_state_dict``)."""
    rules = _concrete_rules(config, prefix)
    _check_keys(hf_state_dict, [k for r in rules for k in r.hf], "Hugging Face", "from_hf")
    out: dict[str, torch.Tensor] = {}
    bad_shapes = []
    for rule in rules:
        parts = [hf_state_dict[k] for k in rule.hf]
        if rule.op == "conv":
            if parts[0].dim() != 3 or parts[0].shape[1] != 1:
                bad_shapes.append(f"{rule.hf[0]}: {tuple(parts[0].shape)}, expected [C, 1, K]")
                continue
            out[rule.ours] = parts[0].squeeze(1)
        elif rule.op == "qkv":
            rows = [p.shape[0] for p in parts]
            if rows != _qkv_sizes(config):
                bad_shapes.append(f"{rule.hf}: rows {rows}, expected {_qkv_sizes(config)}")
                continue
            out[rule.ours] = torch.cat(parts, dim=0)
        else:
            out[rule.ours] = parts[0]
    if bad_shapes:
        raise WeightMappingError(
            "from_hf: tensors with the wrong shape for this config:\n  " + "\n  ".join(bad_shapes)
        )
    return out


def hf_linear_modules(
    path: str, config: NemotronHConfig, *, prefix: str = MEMORY_PREFIX
) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """The Hugging Face module(s) our linear at ``path`` (e.g. ``layers.3.attention.qkv_proj``)
    becomes: ``(module paths, output rows of each)``; the rows are None for a one-to-one linear.

    Derived from :data:`WEIGHT_RULES` (the rule of ``path + ".weight"``), so a LoRA factor
    ``B`` of our fused ``qkv_proj`` splits into q/k/v exactly as its base weight does.
    """
    for rule in _concrete_rules(config, prefix):
        if rule.ours == f"{path}.weight" and rule.op in ("same", "qkv"):
            modules = tuple(key.removesuffix(".weight") for key in rule.hf)
            return modules, tuple(_qkv_sizes(config)) if rule.op == "qkv" else None
    linears = sorted(
        r.ours.removesuffix(".weight")
        for r in _concrete_rules(config, prefix)
        if r.ours.endswith("proj.weight")
    )
    raise WeightMappingError(
        f"hf_linear_modules: {path!r} is not a linear of this config's layout. "
        f"Fix: name one of {linears}"
    )


def _check_keys(
    state_dict: Mapping[str, torch.Tensor], expected: list[str], whose: str, where: str
) -> None:
    missing = [k for k in expected if k not in state_dict]
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"missing {len(missing)} {whose} key(s): {missing[:20]}")
        if unexpected:
            lines.append(f"unexpected {len(unexpected)} {whose} key(s): {unexpected[:20]}")
        raise WeightMappingError(
            f"{where}: the state dict does not match the config's layout "
            f"(pattern, biases, tied head):\n  "
            + "\n  ".join(lines)
            + "\n  Fix: convert with the config the weights were made for (and the right prefix)."
        )
