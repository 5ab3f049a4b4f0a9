"""Find model plugins through the ``mizzen.plugins`` entry-point group.

A plugin is a :class:`ModelPlugin` object (model family, config class, builder) that a distribution
names in its metadata::

    [project.entry-points."mizzen.plugins"]
    nemotron_h = "mizzen_plugins.nemotron_h.plugin:PLUGIN"

The entry-point name is the plugin name; ``get("nemotron_h")`` imports
``mizzen_plugins.nemotron_h.plugin`` and returns its ``PLUGIN``.

Invariants:
- Stdlib only: importing this module (and so ``mizzen_plugins``) imports no model module and not
  torch.  Listing plugins reads distribution metadata only.
- ``get(name)`` loads exactly the entry point called ``name``; no other plugin's module is imported,
  so one broken or heavy plugin cannot break or slow down another.
- The entry points of ``mizzen-plugins`` are declared once, in ``packages/plugins/pyproject.toml``.
  When that distribution is not installed but its source tree is importable (the GPU lanes put
  ``src/`` on ``PYTHONPATH`` without installing), the same table is read from that file, and this is
  logged.  Plugins of other installed distributions are found either way.
- A loaded plugin is checked (a :class:`ModelPlugin` whose ``name`` equals its entry-point name) and
  cached; every error names the plugin, the entry point and the fix.
"""

from __future__ import annotations

import importlib.metadata
import logging
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENTRY_POINT_GROUP",
    "HFMapping",
    "ModelPlugin",
    "PluginLoadError",
    "PluginNotFoundError",
    "available",
    "get",
]

ENTRY_POINT_GROUP = "mizzen.plugins"
_DISTRIBUTION = "mizzen-plugins"
# src/mizzen_plugins/discovery.py -> packages/plugins/pyproject.toml in a source checkout.
_SOURCE_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFMapping:
    """How a trainable plugin's weights map to its Hugging Face architecture (all three take the
    Hugging Face-style config dict as their last argument).

    - ``to_hf(state_dict, hf_config)``: our state dict under the checkpoint names ``transformers``
      loads (``model.safetensors``);
    - ``from_hf(hf_state_dict, hf_config)``: the inverse;
    - ``lora_modules(path, hf_config)``: ``(modules, rows)``, the module path(s) (as a loaded
      ``transformers`` model names them) that our linear at ``path`` becomes, and the output rows
      of each when it is fused from several (None for one).
    """

    to_hf: Callable[[Mapping[str, Any], Mapping[str, Any]], dict]
    from_hf: Callable[[Mapping[str, Any], Mapping[str, Any]], dict]
    lora_modules: Callable[[str, Mapping[str, Any]], tuple[tuple[str, ...], tuple[int, ...] | None]]


@dataclass(frozen=True)
class ModelPlugin:
    """What a plugin module exports: a model family, its config class and a builder.

    ``config_class`` must offer ``from_hf_dict(mapping)`` (a Hugging Face-style ``config.json``
    dict to a config object); ``build(config)`` returns the model (a ``torch.nn.Module``).

    What a trainer needs to fine-tune the family as a language model (all optional; a plugin
    without ``causal_lm`` is not trainable by ``mizzen-train``):

    - ``causal_lm(hf_config)``: a randomly initialised causal LM for a Hugging Face-style config
      dict, a ``torch.nn.Module`` whose ``forward(input_ids [T], cu_seqlens [n + 1])`` returns
      next-token logits ``[T, vocab]`` of a packed (THD) batch, each sequence as if alone;
    - ``lora_targets``: the leaf names of the ``nn.Linear`` modules LoRA adapts by default;
    - ``tiny_config``: a small Hugging Face-style config dict that trains on a CPU in seconds;
    - ``hf``: the family's :class:`HFMapping` to a Hugging Face architecture that ``transformers``
      loads, or None when there is none (then only plugin-native checkpoints exist).
    """

    name: str
    family: str
    config_class: type
    build: Callable[[Any], Any]
    description: str = ""
    causal_lm: Callable[[Mapping[str, Any]], Any] | None = None
    lora_targets: tuple[str, ...] = ()
    tiny_config: Mapping[str, Any] | None = None
    hf: HFMapping | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(
                f"ModelPlugin.name {self.name!r} is not an identifier; "
                "use the entry-point name, e.g. 'nemotron_h'"
            )
        if not callable(getattr(self.config_class, "from_hf_dict", None)):
            raise TypeError(
                f"ModelPlugin {self.name!r}: config_class {self.config_class!r} has no callable "
                "from_hf_dict(mapping); add that classmethod"
            )
        if not callable(self.build):
            raise TypeError(f"ModelPlugin {self.name!r}: build {self.build!r} is not callable")
        if self.causal_lm is not None and not callable(self.causal_lm):
            raise TypeError(f"ModelPlugin {self.name!r}: causal_lm is not callable")
        if self.causal_lm is not None and not (
            self.lora_targets and all(isinstance(t, str) and t for t in self.lora_targets)
        ):
            raise ValueError(
                f"ModelPlugin {self.name!r}: a trainable plugin (causal_lm set) names its LoRA "
                "targets; set lora_targets to the leaf names of its nn.Linear modules"
            )

    def config_from_hf(self, hf_config: Mapping[str, Any]) -> Any:
        """The plugin's config object for a Hugging Face-style config dict."""
        return self.config_class.from_hf_dict(hf_config)


class PluginNotFoundError(LookupError):
    """No entry point of the ``mizzen.plugins`` group has the requested name."""


class PluginLoadError(RuntimeError):
    """An entry point exists but does not load to a valid :class:`ModelPlugin`."""


_loaded: dict[str, ModelPlugin] = {}


def available() -> tuple[str, ...]:
    """The names of all discoverable plugins, sorted.  Imports no plugin module."""
    return tuple(sorted(_entry_points_by_name()))


def get(name: str) -> ModelPlugin:
    """Load the plugin called ``name`` (and only it); cached after the first call."""
    if name in _loaded:
        return _loaded[name]
    by_name = _entry_points_by_name()
    candidates = by_name.get(name)
    if not candidates:
        known = "; ".join(_describe(eps[0]) for _, eps in sorted(by_name.items()))
        raise PluginNotFoundError(
            f"no mizzen plugin named {name!r} in entry-point group {ENTRY_POINT_GROUP!r}; "
            f"known plugins: {known or 'none'}. Fix: check the spelling, or install the "
            f'distribution that declares {name!r} under [project.entry-points."{ENTRY_POINT_GROUP}"]'
            " (re-install it after editing that table)."
        )
    if len(candidates) > 1:
        raise PluginLoadError(
            f"plugin name {name!r} is declared by several entry points: "
            + "; ".join(_describe(ep) for ep in candidates)
            + ". Fix: rename one of them or uninstall one of those distributions."
        )
    (entry_point,) = candidates
    try:
        plugin = entry_point.load()
    except Exception as exc:
        raise PluginLoadError(
            f"plugin {name!r}: loading entry point {_describe(entry_point)} failed with "
            f"{type(exc).__name__}: {exc}. Fix: make that module importable on this machine "
            "(GPU-only libraries must be imported inside the functions that use them)."
        ) from exc
    if not isinstance(plugin, ModelPlugin):
        raise PluginLoadError(
            f"plugin {name!r}: entry point {_describe(entry_point)} loads a "
            f"{type(plugin).__name__}, not a mizzen_plugins.ModelPlugin. Fix: point the entry "
            "point at a ModelPlugin object."
        )
    if plugin.name != name:
        raise PluginLoadError(
            f"plugin {name!r}: entry point {_describe(entry_point)} loads a ModelPlugin named "
            f"{plugin.name!r}. Fix: make ModelPlugin.name equal the entry-point name."
        )
    _loaded[name] = plugin
    return plugin


def _entry_points_by_name() -> dict[str, list[importlib.metadata.EntryPoint]]:
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        by_name.setdefault(entry_point.name, []).append(entry_point)
    if not _distribution_installed():
        for entry_point in _source_tree_entry_points():
            by_name.setdefault(entry_point.name, []).append(entry_point)
    return by_name


def _distribution_installed() -> bool:
    try:
        importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _source_tree_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The ``mizzen.plugins`` table of this source tree's pyproject.toml (not installed case)."""
    if not _SOURCE_PYPROJECT.is_file():
        return []
    with _SOURCE_PYPROJECT.open("rb") as handle:
        project = tomllib.load(handle).get("project", {})
    if project.get("name") != _DISTRIBUTION:
        return []
    table = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    logger.info(
        "%s is not installed; reading its %r entry points from %s",
        _DISTRIBUTION,
        ENTRY_POINT_GROUP,
        _SOURCE_PYPROJECT,
    )
    return [
        importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)
        for name, value in table.items()
    ]


def _describe(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    origin = f"{dist.name} {dist.version}" if dist is not None else f"source {_SOURCE_PYPROJECT}"
    return f"{entry_point.name} = {entry_point.value!r} from {origin}"
