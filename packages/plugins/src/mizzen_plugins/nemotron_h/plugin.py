"""The ``nemotron_h`` entry of the ``mizzen.plugins`` entry-point group.

Invariant: this module only assembles the :class:`~mizzen_plugins.ModelPlugin`; everything it names
imports on a CPU machine (GPU kernels load lazily inside the scan backend).
"""

from __future__ import annotations

from mizzen_plugins.discovery import ModelPlugin
from mizzen_plugins.nemotron_h.config import MODEL_TYPE, NemotronHConfig
from mizzen_plugins.nemotron_h.model import build_model

__all__ = ["PLUGIN"]

PLUGIN = ModelPlugin(
    name="nemotron_h",
    family=MODEL_TYPE,
    config_class=NemotronHConfig,
    build=build_model,
    description="Nemotron-H-style hybrid: Mamba-2 mixers, causal attention and MLPs from a pattern",
)
