"""The layer pattern of a Nemotron-H-style hybrid: one character per layer.

``M-M*-M-`` reads: Mamba-2 mixer, MLP, Mamba-2 mixer, attention, MLP, Mamba-2 mixer, MLP.  This is
the Hugging Face ``hybrid_override_pattern``; the newer ``layers_block_type`` list spells the same
layers as ``linear_attention`` / ``full_attention`` / ``mlp``.

Invariants:
- :data:`LAYER_KINDS` is the one table of layer kinds (character, HF block-type name, meaning);
  parsing and formatting in both spellings are derived from it.
- A rejected pattern names the offending position (0-based) and lists what is allowed.  MoE layers
  (``E`` / ``moe``) are recognised and rejected as unsupported, not as unknown.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

__all__ = [
    "LAYER_KINDS",
    "LayerKind",
    "PatternError",
    "format_pattern",
    "kinds_from_block_types",
    "kinds_to_block_types",
    "parse_pattern",
]


class LayerKind(enum.Enum):
    """A layer of the hybrid; the value is its pattern character."""

    SSM = "M"
    ATTENTION = "*"
    MLP = "-"

    @property
    def block_type(self) -> str:
        """The Hugging Face ``layers_block_type`` name of this kind."""
        return _BLOCK_TYPE[self]


# kind -> (HF layers_block_type name, meaning).  The one table.
LAYER_KINDS: dict[LayerKind, tuple[str, str]] = {
    LayerKind.SSM: ("linear_attention", "Mamba-2 selective state-space mixer"),
    LayerKind.ATTENTION: ("full_attention", "causal self-attention"),
    LayerKind.MLP: ("mlp", "MLP"),
}
_BLOCK_TYPE = {kind: block_type for kind, (block_type, _) in LAYER_KINDS.items()}
_BY_BLOCK_TYPE = {block_type: kind for kind, block_type in _BLOCK_TYPE.items()}
_UNSUPPORTED = {"E": "moe"}  # recognised, out of scope


class PatternError(ValueError):
    """A layer pattern (or block-type list) that cannot describe a supported hybrid."""


def _allowed() -> str:
    return ", ".join(f"{k.value!r} ({meaning})" for k, (_, meaning) in LAYER_KINDS.items())


def parse_pattern(
    pattern: str, *, num_layers: int | None = None, field: str = "hybrid_override_pattern"
) -> tuple[LayerKind, ...]:
    """Parse a pattern string; ``num_layers``, when given, must equal its length."""
    if not isinstance(pattern, str):
        raise PatternError(f"{field} must be a string like 'M-M*-', got {type(pattern).__name__}")
    if not pattern:
        raise PatternError(f"{field} is empty; it needs one character per layer: {_allowed()}")
    kinds = []
    for position, char in enumerate(pattern):
        if char in _UNSUPPORTED:
            raise PatternError(
                f"{field} {pattern!r}: position {position} is {char!r} "
                f"({_UNSUPPORTED[char]} layer), which this plugin does not support (MoE is out of "
                f"scope). Fix: use only {_allowed()}"
            )
        try:
            kinds.append(LayerKind(char))
        except ValueError:
            raise PatternError(
                f"{field} {pattern!r}: position {position} is {char!r}, not a layer kind. "
                f"Fix: use only {_allowed()}"
            ) from None
    _check_length(kinds, num_layers, field, pattern)
    return tuple(kinds)


def kinds_from_block_types(
    block_types: Sequence[str], *, num_layers: int | None = None, field: str = "layers_block_type"
) -> tuple[LayerKind, ...]:
    """Parse a Hugging Face ``layers_block_type`` list."""
    if isinstance(block_types, str) or not isinstance(block_types, Sequence):
        raise PatternError(
            f"{field} must be a list of block-type names, got {type(block_types).__name__}"
        )
    if not block_types:
        raise PatternError(f"{field} is empty; it needs one block type per layer")
    kinds = []
    for position, name in enumerate(block_types):
        if name in _UNSUPPORTED.values():
            raise PatternError(
                f"{field}[{position}] is {name!r}, which this plugin does not support (MoE is out "
                f"of scope). Fix: use only {sorted(_BY_BLOCK_TYPE)}"
            )
        if name not in _BY_BLOCK_TYPE:
            raise PatternError(
                f"{field}[{position}] is {name!r}, not a block type. "
                f"Fix: use only {sorted(_BY_BLOCK_TYPE)}"
            )
        kinds.append(_BY_BLOCK_TYPE[name])
    _check_length(kinds, num_layers, field, block_types)
    return tuple(kinds)


def format_pattern(kinds: Sequence[LayerKind]) -> str:
    """The pattern string of ``kinds`` (inverse of :func:`parse_pattern`)."""
    return "".join(kind.value for kind in kinds)


def kinds_to_block_types(kinds: Sequence[LayerKind]) -> list[str]:
    """The ``layers_block_type`` list of ``kinds`` (inverse of :func:`kinds_from_block_types`)."""
    return [kind.block_type for kind in kinds]


def _check_length(kinds: list[LayerKind], num_layers: int | None, field: str, raw: object) -> None:
    if num_layers is None or len(kinds) == num_layers:
        return
    if len(kinds) < num_layers:
        where = f"layer {len(kinds)} (0-based) is missing: {field} ends at position {len(kinds)}"
    else:
        where = f"position {num_layers} onwards ({len(kinds) - num_layers} extra) is beyond it"
    raise PatternError(
        f"{field} {raw!r} has {len(kinds)} layers but num_hidden_layers = {num_layers}; {where}. "
        f"Fix: make them agree (or drop num_hidden_layers: the pattern defines the depth)."
    )
