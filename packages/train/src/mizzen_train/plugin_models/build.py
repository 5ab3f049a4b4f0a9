"""A plugin base directory as the slot executor's model, and the rules of a run with one.

:func:`import_plugin_model` reads the base (:mod:`.base`), moves it to the run's device and dtype
and wraps it in :class:`~mizzen_train.plugin_models.model.PluginGPT`; its LoRA targets are the
plugin's table (``ModelPlugin.lora_targets``: which ``nn.Linear`` leaves LoRA adapts).

:func:`plugin_run_problems` lists what a run configuration asks that a plugin model cannot do,
as ``(field, value, rule, fix)`` for the run framework to raise as its ``ConfigError``:

- tensor parallelism (the plugins' linears are plain ``nn.Linear``: no TP sharding);
- RL with embedded or Ray engines on a plugin without a Hugging Face architecture (the engines
  serve ``transformers`` models; give ``rollout.engines = "urls"`` of a server that serves it);
- SFT eval snapshots (merged models) for engines or loss evaluators on such a plugin (its merged
  model is in the plugin's own layout, which ``transformers`` cannot load).

Invariant: validation happens before megatron's parallel state exists; the import refuses a TP
world anyway (defence in depth), naming the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mizzen_train.errors import HFModelError
from mizzen_train.plugin_models.base import PluginSource, PluginSpec, load_plugin, read_plugin_base
from mizzen_train.plugin_models.export import PluginExportSource

__all__ = ["ImportedPluginModel", "import_plugin_model", "plugin_run_problems"]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ImportedPluginModel:
    model: Any  # PluginGPT
    source: PluginSource
    target_modules: tuple[str, ...]

    @property
    def spec(self) -> PluginSpec:
        return self.source.spec


def import_plugin_model(
    name: str, directory: str | Path, *, device: str = "cpu", dtype: str = "fp32"
) -> ImportedPluginModel:
    """Plugin ``name``'s base at ``directory`` as a :class:`PluginGPT` on ``device``/``dtype``."""
    import torch
    from megatron.core import parallel_state

    from mizzen_train.plugin_models.model import PluginGPT

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp > 1:
            raise HFModelError(
                f"plugin {name!r} at tensor parallel size {tp}: plugin models have no tensor "
                "parallel layers. Fix: run them with tensor parallel size 1"
            )
    torch_dtype = getattr(torch, _DTYPES[dtype])
    source, lm = read_plugin_base(name, directory)
    lm = lm.to(device=device, dtype=torch_dtype)
    model = PluginGPT(
        lm,
        vocab_size=source.spec.vocab_size,
        max_sequence_length=source.spec.max_sequence_length,
        dtype=torch_dtype,
    )
    exportable = PluginExportSource.of(source)
    return ImportedPluginModel(model, exportable, tuple(load_plugin(name).lora_targets))


def plugin_spec(name: str, directory: str | Path) -> PluginSpec:
    """The spec of plugin ``name``'s base at ``directory`` (validates the whole directory)."""
    return read_plugin_base(name, directory)[0].spec


def plugin_run_problems(config: Any, command: str) -> list[tuple[str, Any, str, str]]:
    """What ``config`` (a run configuration with ``model.plugin`` set) asks that the plugin
    cannot do: ``(field, value, rule, fix)`` each (see the module docstring)."""
    name = config.model.plugin
    problems = []
    tensor = getattr(getattr(config, "parallel", None), "tensor", 1)
    if tensor != 1:
        problems.append((
            "parallel.tensor", tensor, f"plugin model {name!r} has no tensor parallel layers",
            "use parallel.tensor = 1 (data parallel ranks still scale it)",
        ))  # fmt: skip
    if load_plugin(name).hf is not None:
        return problems
    rollout = getattr(config, "rollout", None)
    if command == "rl" and rollout is not None and rollout.engines != "urls":
        problems.append((
            "rollout.engines", rollout.engines,
            f"plugin {name!r} has no Hugging Face architecture, so the embedded engines cannot "
            "serve it", 'use rollout.engines = "urls" with a server that serves this model',
        ))  # fmt: skip
    if command == "sft":
        for i, ev in enumerate(config.evaluators):
            if ev.kind != "python":
                problems.append((
                    f"eval.evaluators[{i}].kind", ev.kind,
                    f"evaluates a merged snapshot, and plugin {name!r}'s is in its own layout "
                    "(no Hugging Face architecture loads it)",
                    'use kind = "python" with an evaluator that loads the plugin model',
                ))  # fmt: skip
    return problems
