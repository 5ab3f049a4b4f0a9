"""The base model directory of a plugin model: read and validated, or written for ``"tiny"``.

A plugin base directory holds ``config.json`` (the plugin's Hugging Face-style config dict, plus
``max_position_embeddings`` and the tokenizer's special ids), ``model.safetensors`` and a
tokenizer.  Its weights use the Hugging Face checkpoint names when the plugin maps to a Hugging Face
architecture (:class:`mizzen_plugins.HFMapping`: then ``transformers`` and the embedded engine load
the directory as it is), the plugin's own state-dict names otherwise.

Invariants:
- The directory is untrusted: ``config.json`` is parsed and validated by the plugin (every problem
  an :class:`~mizzen_train.errors.HFModelError` naming the file), and the weights must be exactly
  the model's tensors (names, shapes, finite values) before any is loaded.
- A tiny base (:func:`write_tiny_base`) is a function of ``(plugin, seed, overrides)``: the same
  weights bit for bit on every machine; it appears whole or not at all (temporary sibling, rename).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mizzen_train.errors import HFModelError
from mizzen_train.input_files import MAX_MODEL_CONFIG_BYTES, read_json_file

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_POSITIONS",
    "WEIGHTS_FILE",
    "PluginSource",
    "PluginSpec",
    "load_plugin",
    "read_plugin_base",
    "write_tiny_base",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: Sequence limit of a plugin config without ``max_position_embeddings`` (the models have no
#: learned positions; the limit only bounds what a run may feed them).
DEFAULT_MAX_POSITIONS = 4096


@dataclass(frozen=True)
class PluginSpec:
    """What the run framework reads of a base model (the plugin counterpart of ``GPTSpec``)."""

    vocab_size: int
    max_sequence_length: int
    parameters: int

    def parameter_count(self) -> int:
        return self.parameters


@dataclass(frozen=True)
class PluginSource:
    """A validated plugin base directory: the plugin's name, the raw config dict, the spec.

    What the trainer hands to the exporters is its subclass
    :class:`mizzen_train.plugin_models.export.PluginExportSource` (made by
    :func:`~mizzen_train.plugin_models.build.import_plugin_model`), whose two export methods are
    how :func:`mizzen_train.hf.export_peft_adapter` and :func:`mizzen_train.hf.export_hf_snapshot`
    serve a plugin model (they dispatch on them)."""

    path: Path  # the config.json
    plugin: str
    raw: dict[str, Any] = field(repr=False)
    spec: PluginSpec

    @property
    def directory(self) -> Path:
        return self.path.parent


def load_plugin(name: str):
    """The trainable plugin ``name`` (:class:`mizzen_plugins.ModelPlugin` with ``causal_lm``)."""
    import mizzen_plugins

    plugin = mizzen_plugins.get(name)
    if plugin.causal_lm is None:
        raise HFModelError(
            f"plugin {name!r} offers no causal_lm, so mizzen-train cannot train it. Fix: use a "
            "trainable plugin, or give this one a causal_lm (mizzen_plugins.ModelPlugin)"
        )
    return plugin


def _vocab_size(raw: Mapping[str, Any], path: Path) -> int:
    value = raw.get("vocab_size")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFModelError(
            f"{path}: vocab_size={value!r}: must be a positive integer. Fix: correct config.json"
        )
    return value


def _max_positions(raw: Mapping[str, Any], path: Path) -> int:
    value = raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise HFModelError(
            f"{path}: max_position_embeddings={value!r}: must be an integer >= 2. Fix: correct "
            "config.json"
        )
    return value


def _build(plugin, raw: Mapping[str, Any], path: Path):
    """The plugin's randomly initialised model for ``raw``, or an error naming the file."""
    try:
        return plugin.causal_lm(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise HFModelError(
            f"{path}: not a valid {plugin.name} config ({type(exc).__name__}: {_one_line(exc)})."
            " Fix: correct config.json"
        ) from None


def read_plugin_base(name: str, directory: str | Path) -> tuple[PluginSource, Any]:
    """Validate ``directory`` as a base of plugin ``name``; returns its source and the model
    (fp32, on the CPU) holding exactly the directory's weights."""
    import torch

    plugin = load_plugin(name)
    path = Path(directory) / CONFIG_FILE
    raw = _read_config(path)
    _vocab_size(raw, path)
    max_positions = _max_positions(raw, path)
    model = _build(plugin, raw, path)
    weights = _read_weights(Path(directory) / WEIGHTS_FILE)
    if plugin.hf is not None:
        try:
            weights = plugin.hf.from_hf(weights, raw)
        except (KeyError, ValueError) as exc:
            raise HFModelError(f"{Path(directory) / WEIGHTS_FILE}: {_one_line(exc)}") from None
    _check_weights(model, weights, Path(directory) / WEIGHTS_FILE)
    with torch.no_grad():
        model.load_state_dict(weights, strict=True)
    spec = PluginSpec(
        vocab_size=_vocab_size(raw, path),
        max_sequence_length=max_positions,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return PluginSource(path=path, plugin=name, raw=raw, spec=spec), model


def _one_line(exc: BaseException) -> str:
    """A plugin's (possibly multi-line) message as one line: errors are printed one per line."""
    return " ".join(str(exc).split())


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFModelError(
            f"{path}: no such file; a plugin base directory holds config.json and "
            "model.safetensors. Fix: point model.path at such a directory (or 'tiny')"
        )
    try:
        raw = read_json_file(path, MAX_MODEL_CONFIG_BYTES)
    except (OSError, ValueError) as exc:
        raise HFModelError(f"{path}: unreadable ({exc}). Fix: restore the file") from None
    if not isinstance(raw, dict):
        raise HFModelError(f"{path}: must hold a JSON object. Fix: restore the file")
    return raw


def _read_weights(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise HFModelError(f"{path}: no such file. Fix: write the base model's weights there")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise HFModelError(f"{path}: unreadable safetensors ({exc}). Fix: restore it") from None


def _check_weights(model, weights: Mapping[str, Any], path: Path) -> None:
    import torch

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise HFModelError(
            f"{path}: tensors do not match the config (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}). Fix: write the weights for this config"
        )
    for key, shape in expected.items():
        tensor = weights[key]
        if tuple(tensor.shape) != shape:
            raise HFModelError(f"{path}: {key} has shape {tuple(tensor.shape)}, expected {shape}")
        if not tensor.dtype.is_floating_point or not bool(torch.isfinite(tensor).all()):
            raise HFModelError(f"{path}: {key} must hold finite floats. Fix: restore the file")


def tiny_config(name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Plugin ``name``'s tiny config with ``overrides`` (fields of that config only)."""
    plugin = load_plugin(name)
    base = dict(plugin.tiny_config or {})
    if not base:
        raise HFModelError(
            f"plugin {name!r} has no tiny config. Fix: set model.path to a base directory"
        )
    unknown = sorted(set(overrides) - set(base))
    if unknown:
        raise HFModelError(
            f"model.tiny.{unknown[0]}: not a field of plugin {name!r}'s tiny config. Fix: use "
            f"some of {sorted(base)}"
        )
    return {**base, **overrides}


def write_tiny_base(
    directory: str | Path, name: str, *, seed: int = 0, overrides: Mapping[str, Any] | None = None
) -> Path:
    """A randomly initialised plugin model (seeded), with the byte tokenizer, at ``directory``."""
    import torch
    from safetensors.torch import save_file

    from mizzen_rollout.api import hf_byte_tokenizer

    target = Path(directory)
    if target.exists():
        raise FileExistsError(f"{target} exists; write_tiny_base creates a fresh directory")
    plugin = load_plugin(name)
    tokenizer = hf_byte_tokenizer()
    raw = tiny_config(name, overrides or {})
    raw.update(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = _build(plugin, raw, target / CONFIG_FILE)
    finally:
        torch.random.set_rng_state(rng)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if plugin.hf is not None:
        # the Hugging Face architecture's own config keys (architectures, defaults), ours kept
        raw = {**raw, **plugin.config_from_hf(raw).to_hf_dict()}
        state = {k: v.contiguous() for k, v in plugin.hf.to_hf(state, raw).items()}
    raw["mizzen_plugin"] = name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
