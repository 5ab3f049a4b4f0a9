"""Plugin models (``[model] plugin = "nemotron_h" | "deepseek_v4"``) trained by the slot executor.

A model plugin (:mod:`mizzen_plugins`, found through the ``mizzen.plugins`` entry points) that
offers ``causal_lm`` is a plain torch module on packed (THD) token streams.  This package makes
it what the slot executor drives in place of megatron-core's ``GPTModel``:

- :mod:`.base` -- the base model directory: read and validated (``config.json`` + weights), or
  written once per tiny configuration (``model.path = "tiny"``); :class:`~.base.PluginSource`
  and :class:`~.base.PluginSpec` describe it.
- :mod:`.model` -- :class:`~.model.PluginGPT`, GPTModel's call signature over the plugin model.
- :mod:`.export` -- a slot as a PEFT adapter, and the merged model (Hugging Face layout where the
  plugin maps to one, the plugin's own layout otherwise); :class:`~.export.PluginExportSource`
  is the base as the exporters' ``source`` (imports run base <- export <- build, never back).
- :mod:`.build` -- :func:`~.build.import_plugin_model` (directory -> wrapped model with its LoRA
  targets) and the rules a run with a plugin model follows (:func:`~.build.plugin_run_problems`).

Invariants:
- Importing this package imports no torch, megatron or plugin module; they load inside the
  functions that use them.
- Nothing here imports :mod:`mizzen_train.run` (the run framework calls this package).
- Tensor parallelism is refused for plugin models (their linears are plain ``nn.Linear``).
"""

from mizzen_train.plugin_models.build import (
    ImportedPluginModel,
    import_plugin_model,
    plugin_run_problems,
)

__all__ = ["ImportedPluginModel", "import_plugin_model", "plugin_run_problems"]
