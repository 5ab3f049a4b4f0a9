"""mizzen-plugins: model definitions for mizzen, found by name through entry points.

Each model family (the Nemotron-H-style hybrid in :mod:`mizzen_plugins.nemotron_h`, …) is a plugin:
a :class:`ModelPlugin` naming its family, its config class (built from a Hugging Face-style config
dict) and a builder, declared in the ``mizzen.plugins`` entry-point group::

    import mizzen_plugins

    plugin = mizzen_plugins.get("nemotron_h")        # imports that plugin's module only
    config = plugin.config_from_hf(hf_config_dict)
    model = plugin.build(config)

Invariants:
- Importing ``mizzen_plugins`` imports no model module (and not torch): only the stdlib-only
  :mod:`mizzen_plugins.discovery`.  Model modules load when a plugin is requested.
- Model modules may import torch at module scope, never a GPU-only library (triton, mamba_ssm,
  causal_conv1d, flash_attn, transformer_engine, …): those are imported inside the functions that
  use them, so every module imports on a CPU machine.
"""

from mizzen_plugins.discovery import (
    ENTRY_POINT_GROUP,
    HFMapping,
    ModelPlugin,
    PluginLoadError,
    PluginNotFoundError,
    available,
    get,
)

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "HFMapping",
    "ModelPlugin",
    "PluginLoadError",
    "PluginNotFoundError",
    "__version__",
    "available",
    "get",
]
