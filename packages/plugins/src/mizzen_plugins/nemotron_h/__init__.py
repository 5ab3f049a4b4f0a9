"""Nemotron-H-style hybrid model plugin: Mamba-2 mixers, attention and MLPs from a layer pattern.

Modules, one concern each:

- :mod:`.pattern`: the layer pattern (``M-M*-M-``) and its parsing.
- :mod:`.config`: :class:`NemotronHConfig`, to and from a Hugging Face-style dict.
- :mod:`.ssd`: the selective scan (step-by-step definition and chunked form), pure torch.
- :mod:`.scan_backend`: which scan runs on a device (reference / torch.compile / mamba_ssm).
- :mod:`.conv`: the causal depthwise convolution with per-sequence restart.
- :mod:`.mixer`, :mod:`.self_attention`, :mod:`.model`: the layers and the model (packed batches
  through :class:`mizzen_plugins.thd.PackedLayout`, attention through
  :func:`mizzen_plugins.attention.causal_thd_attention`).
- :mod:`.weights`: the weight-name table to and from the Hugging Face NemotronH layout.
- :mod:`.plugin`: the ``nemotron_h`` entry point.

Invariant: nothing in this package imports a GPU-only library at module scope.
"""

from mizzen_plugins.nemotron_h.config import ModelConfigError, NemotronHConfig
from mizzen_plugins.nemotron_h.model import HybridCausalLM, build_model
from mizzen_plugins.nemotron_h.pattern import LayerKind, PatternError, parse_pattern
from mizzen_plugins.nemotron_h.weights import WeightMappingError, from_hf, to_hf

__all__ = [
    "HybridCausalLM",
    "LayerKind",
    "ModelConfigError",
    "NemotronHConfig",
    "PatternError",
    "WeightMappingError",
    "build_model",
    "from_hf",
    "parse_pattern",
    "to_hf",
]
