"""LoRA adapters as the unit of weight sync: the PEFT directory format and the engine-side name.

A trainer publishes each version of a tenant's adapter as a PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``, the format ``peft`` writes with
``save_pretrained``) and loads it into every engine under a versioned name
(:class:`AdapterRef`); requests reach it through SGLang's ``lora_path`` (``/generate``) or the
``model`` field (``/v1/chat/completions``).  This module is the one place the format is written
down: the trainer's exporter (``mizzen_train.hf.peft``) writes with it, the embedded engine reads
with it.

The format (what ``peft`` 0.21 saves for a ``LoraConfig`` on a causal LM and loads back):

- ``adapter_config.json``: ``peft_type = "LORA"``, ``task_type = "CAUSAL_LM"``, ``r``,
  ``lora_alpha`` (the delta is scaled by ``lora_alpha / r``; by ``lora_alpha / sqrt(r)`` with
  ``use_rslora``), ``target_modules`` (module leaf names such as ``q_proj``), ``lora_dropout``,
  ``bias = "none"``, ``fan_in_fan_out = false``, ``base_model_name_or_path``, and the keys of
  features mizzen never uses (``use_dora``, ``rank_pattern``, ``alpha_pattern``,
  ``modules_to_save``, ...) at their off values;
- ``adapter_model.safetensors``: per target module ``base_model.model.<module path>.lora_A.weight``
  (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``), e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

Invariants:
- Standard library only (the engine reads the tensors with safetensors inside its backend).
- :func:`read_adapter_config` treats the file as untrusted: everything the reader needs is
  type- and range-checked, and every feature the embedded engine cannot apply exactly (DoRA,
  per-module rank/alpha patterns, trained biases, extra saved modules, fan-in-fan-out layouts)
  is refused with the field named, never approximated.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "AdapterConfig",
    "AdapterFormatError",
    "AdapterRef",
    "adapter_config_dict",
    "peft_weight_key",
    "read_adapter_config",
    "split_peft_weight_key",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: The prefix peft gives every weight of a causal-LM adapter (``PeftModel.base_model.model``).
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<factor>lora_[AB])\.weight$")
#: Names an engine may register (SGLang takes any string; mizzen keeps them path- and URL-safe).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")


class AdapterFormatError(ValueError):
    """An adapter directory is not a PEFT LoRA adapter this reader applies exactly; names the
    file, the field, the rule and the fix."""


@dataclass(frozen=True)
class AdapterRef:
    """One published version of a tenant's adapter: where it lies and the name engines know it
    by.  Names are versioned (``colours@v12``): SGLang refuses to load a name twice, and a
    request routed to a name always meets exactly that version."""

    tenant: str
    version: int
    path: str

    @property
    def name(self) -> str:
        return f"{self.tenant}@v{self.version}"

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"AdapterRef name {self.name!r}: use a tenant name of letters, digits, '_', '-' "
                "and '.'"
            )
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"AdapterRef.version is {self.version!r}; use an integer >= 0")


def check_adapter_name(name: Any) -> str:
    """``name`` when it is a valid engine-side adapter name, else ValueError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"adapter name {name!r}: 1-128 letters, digits, '_', '.', '@' or '-' (starting with a "
            "letter or digit)"
        )
    return name


def peft_weight_key(module_path: str, factor: str) -> str:
    """The safetensors key of one factor: ``peft_weight_key("model.layers.0.self_attn.q_proj",
    "lora_A")`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    if factor not in ("lora_A", "lora_B"):
        raise ValueError(f"factor {factor!r}: use 'lora_A' or 'lora_B'")
    return f"{PEFT_PREFIX}{module_path}.{factor}.weight"


def split_peft_weight_key(key: str) -> tuple[str, str]:
    """The inverse of :func:`peft_weight_key`: ``(module path, "lora_A" | "lora_B")``."""
    match = _KEY.match(key)
    if match is None:
        raise AdapterFormatError(
            f"tensor {key!r} is not a PEFT LoRA factor ('{PEFT_PREFIX}<module>.lora_A.weight' or "
            "'.lora_B.weight'); fix: export the adapter with peft or mizzen_train.hf.peft"
        )
    return match.group("module"), match.group("factor")


def adapter_config_dict(
    *, rank: int, alpha: float, target_modules: list[str], base_model_name_or_path: str
) -> dict[str, Any]:
    """The ``adapter_config.json`` of a plain LoRA (every optional feature off)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


@dataclass(frozen=True)
class AdapterConfig:
    """What a reader needs from ``adapter_config.json`` (validated)."""

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    base_model_name_or_path: str

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(directory: str | Path) -> AdapterConfig:
    """Validate ``<directory>/adapter_config.json`` (see the module docstring)."""
    path = Path(directory) / ADAPTER_CONFIG_FILE

    def fail(field: str, value: Any, rule: str, fix: str) -> AdapterFormatError:
        return AdapterFormatError(f"{path}: {field}={value!r}: {rule}. Fix: {fix}")

    if not (Path(directory) / ADAPTER_WEIGHTS_FILE).is_file():
        raise AdapterFormatError(
            f"{directory}: no {ADAPTER_WEIGHTS_FILE}; a PEFT adapter directory holds "
            f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}. Fix: point at such a directory"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(
            f"{path}: unreadable ({exc}). Fix: re-export the adapter"
        ) from None
    if not isinstance(raw, dict):
        raise fail("<root>", type(raw).__name__, "must be a JSON object", "re-export the adapter")
    if raw.get("peft_type") != "LORA":
        raise fail("peft_type", raw.get("peft_type"), "only LoRA adapters", "export a LoRA")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise fail("r", rank, "must be a positive integer", "re-export the adapter")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise fail("lora_alpha", alpha, "must be a finite number", "re-export the adapter")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise fail("use_rslora", rslora, "must be true or false", "re-export the adapter")
    off = {
        "use_dora": (False, None),
        "fan_in_fan_out": (False, None),
        "bias": ("none", None),
        "modules_to_save": (None, []),
        "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None),
        "layers_to_transform": (None,),
    }
    for field, allowed in off.items():
        if raw.get(field, allowed[0]) not in allowed:
            raise fail(
                field,
                raw[field],
                "is a PEFT feature the embedded engine does not apply",
                f"export a plain LoRA ({field}={allowed[0]!r})",
            )
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise fail(
            "target_modules", targets, "a regular expression is not supported here",
            "list the module names, e.g. [\"q_proj\", \"v_proj\"]",
        )  # fmt: skip
    if (
        not isinstance(targets, list)
        or not targets
        or not all(isinstance(t, str) and t for t in targets)
    ):
        raise fail("target_modules", targets, "must be a non-empty list of names", "list them")
    base = raw.get("base_model_name_or_path") or ""
    if not isinstance(base, str):
        raise fail("base_model_name_or_path", base, "must be a string", "re-export the adapter")
    return AdapterConfig(
        path=path,
        rank=rank,
        alpha=float(alpha),
        use_rslora=rslora,
        target_modules=tuple(targets),
        base_model_name_or_path=base,
    )
