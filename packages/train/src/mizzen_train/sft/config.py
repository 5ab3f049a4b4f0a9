"""The configuration of an SFT run: one table of fields, read from TOML and the command line.

A run is described by ``run.toml`` (read with :mod:`tomllib`) and ``--set KEY=VALUE`` overrides
(``run.steps=60``, ``tenants.0.lr=1e-3``, ``eval.evaluators.1.limit=16``; the value is read as a
TOML value, and as a plain string when it is not one).  Sections::

    [run]              dir, steps, checkpoint_interval (required), seed, device, dtype, ...
    [model]            path (an HF Llama directory, or "tiny"), tokenizer, [model.tiny]
    [data]             seq_len (required), on_overlong
    [[tenants]]        name, data, rows, lr (required), LoRA and AdamW settings, schedule
    [eval]             interval, snapshot_dir (required with [eval]), max_in_flight, overflow,
                       keep_snapshots, runner
    [[eval.evaluators]] kind = "generate" | "loss" | "python" and its fields

Invariants:
- Every field is declared once, in the dataclasses below (type, default or required, allowed
  values, bounds, help); the reader, the ``--set`` parser and ``mizzen-train sft --help-config``
  read that one declaration.
- Everything read is untrusted: an unknown key, a wrong type, a value out of range, a missing
  required field, or a combination that cannot work (eval without a snapshot source, an eval
  interval longer than the run, ...) raises :class:`SftConfigError` naming the file and the field,
  the rule and the fix -- before anything is built.  Nothing meaningful is defaulted silently:
  fields without a safe default are required.
- :attr:`SftConfig.engines_needed` is derived once here, and every other module reads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from mizzen_train.runplan import EnginesNeeded, engines_needed

__all__ = [
    "AdapterTrainingConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "EvaluatorConfig",
    "ModelConfig",
    "RunConfig",
    "SftConfig",
    "SftConfigError",
    "TenantConfig",
    "apply_overrides",
    "config_help",
    "load_config",
    "parse_config",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ConfigError(ValueError):
    """A configuration value breaks a rule; names the source, the field, the rule and the fix.

    The one error of every configuration table of mizzen-train (``sft`` and ``rl``)."""

    def __init__(self, field: str, value: Any, rule: str, fix: str, *, source: str = "") -> None:
        self.field, self.value, self.rule, self.fix, self.source = field, value, rule, fix, source
        where = f"{source}: " if source else ""
        shown = "<missing>" if value is MISSING else repr(value)
        super().__init__(f"{where}{field}={shown}: {rule}. Fix: {fix}")


#: The name the SFT code and its tests have always used for :class:`ConfigError` (same type).
SftConfigError = ConfigError


def opt(default: Any = MISSING, *, kind: str, help: str, choices=None, low=None, high=None):
    """Declare a config field: ``kind`` in int|float|str|bool|list[str]|list[float]|table."""
    meta = {"kind": kind, "help": help, "choices": choices, "low": low, "high": high}
    if isinstance(default, dict):  # lists are stored as tuples: a config is immutable
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RunConfig:
    dir: str = opt(kind="str", help="run directory: checkpoints, snapshots, metrics.jsonl")
    steps: int = opt(kind="int", low=1, help="optimizer steps to train")
    checkpoint_interval: int = opt(
        kind="int", low=1, help="save a checkpoint every N steps (and always at the last step)"
    )
    keep_checkpoints: int = opt(2, kind="int", low=1, help="newest checkpoints kept on disk")
    seed: int = opt(0, kind="int", low=0, help="seed of the trainer's RNGs")
    device: str = opt(
        "auto", kind="str", choices=("auto", "cpu", "cuda"), help="auto: cuda when available"
    )
    dtype: str = opt(
        "auto", kind="str", choices=("auto", "fp32", "bf16"), help="auto: bf16 on cuda, else fp32"
    )
    micro_batch_size: int = opt(4, kind="int", low=1, help="rows per micro-batch")
    threads: int = opt(0, kind="int", low=0, help="torch CPU threads (0: torch's default)")
    log_interval: int = opt(1, kind="int", low=1, help="print a progress line every N steps")
    plot: bool = opt(True, kind="bool", help="draw curves.png at the end (needs matplotlib)")


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt(kind="str", help='a local Hugging Face Llama directory, or "tiny"')
    tokenizer: str = opt(
        "model", kind="str", help='"model" (the model directory\'s), "byte", or a directory'
    )
    tiny: Mapping = opt(
        {},
        kind="table",
        help='with path = "tiny": "seed" and fields of the tiny Llama config to override',
    )


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = opt(kind="int", low=8, help="positions per packed row")
    on_overlong: str = opt(
        "error", kind="str", choices=("error", "drop"), help="an example longer than seq_len"
    )


@dataclass(frozen=True, kw_only=True)
class AdapterTrainingConfig:
    """A tenant's LoRA shape, AdamW settings and schedule: the fields SFT and RL tenants share."""

    lr: float = opt(kind="float", low=0.0, help="peak learning rate (AdamW), > 0")
    lora_rank: int = opt(16, kind="int", low=1, help="LoRA rank")
    lora_alpha: float = opt(32.0, kind="float", low=0.0, help="LoRA alpha (scale alpha/rank)")
    lora_init: str = opt(
        "kaiming_uniform", kind="str", choices=("kaiming_uniform", "gaussian"), help="A init"
    )
    lora_seed: int = opt(0, kind="int", low=0, help="seed of the A initialisation")
    lr_schedule: str = opt(
        "constant", kind="str", choices=("constant", "cosine", "linear"), help="after warmup"
    )
    warmup_steps: int = opt(0, kind="int", low=0, help="linear warmup steps")
    min_lr_ratio: float = opt(0.0, kind="float", low=0.0, high=1.0, help="decayed lr floor")
    weight_decay: float = opt(0.0, kind="float", low=0.0, help="AdamW weight decay")
    betas: tuple = opt((0.9, 0.999), kind="list[float]", help="AdamW betas")
    eps: float = opt(1e-8, kind="float", low=0.0, help="AdamW eps")
    max_grad_norm: float = opt(1.0, kind="float", low=0.0, help="clip norm (0: no clipping)")
    data_seed: int = opt(0, kind="int", low=0, help="seed of the data order")


@dataclass(frozen=True, kw_only=True)
class TenantConfig(AdapterTrainingConfig):
    name: str = opt(kind="str", help="tenant name (its slot, snapshots and metrics)")
    data: str = opt(kind="str", help="training data: a JSON-lines file or example:NAME")
    rows: int = opt(kind="int", low=1, help="packed rows of this tenant per step")


EVALUATOR_KINDS = ("generate", "loss", "python")
#: The most prompts one engine call carries: the embedded server's ``MAX_BATCH_SIZE`` (a test
#: pins the two equal; this module does not import the rollout package).
ENGINE_MAX_BATCH = 256


@dataclass(frozen=True)
class EvaluatorConfig:
    kind: str = opt(kind="str", choices=EVALUATOR_KINDS, help="generate | loss | python")
    name: str = opt("", kind="str", help="unique name of its results (default: the kind)")
    tenants: tuple = opt((), kind="list[str]", help="tenants it evaluates (default: all)")
    data: str = opt("", kind="str", help="generate/loss: the eval set (JSON lines or example:)")
    limit: int = opt(0, kind="int", low=0, help="generate/loss: first N records (0: all)")
    reward: str = opt("", kind="str", help="generate: math | f1 | module:function")
    max_new_tokens: int = opt(64, kind="int", low=1, help="generate: tokens per answer")
    temperature: float = opt(0.0, kind="float", low=0.0, help="generate: 0 = greedy")
    engine_urls: tuple = opt((), kind="list[str]", help="generate: SGLang/embedded server URLs")
    num_engines: int = opt(1, kind="int", low=1, high=64, help="generate: embedded engines")
    engine_threads: int = opt(1, kind="int", low=1, help="generate: torch threads per engine")
    startup_timeout_s: float = opt(300.0, kind="float", low=0.0, help="generate: engine start")
    request_timeout_s: float = opt(300.0, kind="float", low=0.0, help="generate: per engine call")
    batch_size: int = opt(
        8, kind="int", low=1,
        help="generate: prompts per engine call (one batched /generate, at most "
        "ENGINE_MAX_BATCH); loss: examples per forward",
    )  # fmt: skip
    device: str = opt(
        "cpu", kind="str", choices=("cpu", "cuda"),
        help="generate: where its embedded engines run; loss: where it runs",
    )  # fmt: skip
    factory: str = opt("", kind="str", help="python: module:factory building the evaluator")
    options: Mapping = opt({}, kind="table", help="python: keyword arguments of the factory")


@dataclass(frozen=True)
class EvalConfig:
    interval: int = opt(kind="int", low=1, help="evaluate every N steps (the last step always)")
    snapshot_dir: str = opt(
        "", kind="str", help="required: where snapshots are exported (relative: under run.dir)"
    )
    max_in_flight: int = opt(1, kind="int", low=1, help="eval points evaluated at once")
    overflow: str = opt(
        "skip", kind="str", choices=("skip", "wait"), help="a point beyond max_in_flight"
    )
    keep_snapshots: int = opt(1, kind="int", low=0, help="newest settled snapshots kept")
    runner: str = opt("thread", kind="str", choices=("thread", "ray"), help="where evals run")
    ray_address: str = opt("", kind="str", help="ray runner: cluster address (default: local)")
    export_dtype: str = opt(
        "auto", kind="str", choices=("auto", "fp32", "bf16"), help="snapshot weights' dtype"
    )
    evaluators: tuple = opt((), kind="evaluators", help="[[eval.evaluators]] tables")


class RunLayout:
    """What a run's configuration derives from its ``run`` and ``eval`` sections, for SFT and RL
    alike: the run directory, the snapshot root and the eval points."""

    run: RunConfig
    eval: EvalConfig | None

    @property
    def evaluators(self) -> tuple[EvaluatorConfig, ...]:
        return tuple(self.eval.evaluators) if self.eval is not None else ()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    @property
    def snapshot_root(self) -> Path | None:
        if self.eval is None:
            return None
        path = Path(self.eval.snapshot_dir)
        return path if path.is_absolute() else self.run_dir / path

    def eval_points(self) -> list[int]:
        """The steps evaluated: every ``interval`` and the last step (forced)."""
        if self.eval is None:
            return []
        points = list(range(self.eval.interval, self.run.steps + 1, self.eval.interval))
        if not points or points[-1] != self.run.steps:
            points.append(self.run.steps)
        return points


@dataclass(frozen=True)
class SftConfig(RunLayout):
    run: RunConfig
    model: ModelConfig
    data: DataConfig
    tenants: tuple[TenantConfig, ...]
    eval: EvalConfig | None
    source: str = ""

    @property
    def engines_needed(self) -> EnginesNeeded:
        """Derived once from the configuration; SFT trains without engines."""
        return engines_needed(
            train_needs_engines=False,
            eval_needs_engines=any(e.kind == "generate" for e in self.evaluators),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (tuples as lists), as run.json stores them."""
        out = dataclasses.asdict(self)
        out.pop("source")
        return json.loads(json.dumps(out))


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "tenants": TenantConfig,
    "eval": EvalConfig,
    "eval.evaluators": EvaluatorConfig,
}


# -- reading ------------------------------------------------------------------------------------


def check_value(path: str, value: Any, meta: Mapping[str, Any], source: str) -> Any:
    kind = meta["kind"]

    def fail(rule: str, fix: str) -> SftConfigError:
        return SftConfigError(path, value, rule, fix, source=source)

    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("must be an integer", f"write e.g. {path.rsplit('.', 1)[-1]} = 1")
    elif kind == "float":
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise fail("must be a finite number", "write a number")
        value = float(value)
    elif kind == "str":
        if not isinstance(value, str):
            raise fail("must be a string", 'quote it: "..."')
    elif kind == "bool":
        if not isinstance(value, bool):
            raise fail("must be true or false", "write true or false")
    elif kind == "list[str]":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise fail("must be a list of non-empty strings", 'write e.g. ["a", "b"]')
        value = tuple(value)
    elif kind == "list[float]":
        if not isinstance(value, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value
        ):
            raise fail("must be a list of numbers", "write e.g. [0.9, 0.999]")
        value = tuple(float(v) for v in value)
    elif kind == "table":
        if not isinstance(value, dict):
            raise fail("must be a table", "write it as [section.name] or {key = value}")
        value = dict(value)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise fail(f"must be one of {list(choices)}", f"use one of {list(choices)}")
    low, high = meta.get("low"), meta.get("high")
    if low is not None and isinstance(value, int | float) and value < low:
        raise fail(f"must be >= {low}", f"use a value >= {low}")
    if high is not None and isinstance(value, int | float) and value > high:
        raise fail(f"must be <= {high}", f"use a value <= {high}")
    return value


def build_section(cls: type, table: Any, path: str, source: str) -> Any:
    if not isinstance(table, dict):
        raise SftConfigError(path, table, "must be a table", f"write it as [{path}]", source=source)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise SftConfigError(
            f"{path}.{unknown[0]}",
            table[unknown[0]],
            f"unknown key in [{path}]",
            f"use one of {sorted(known)} (mizzen-train sft --help-config lists them)",
            source=source,
        )
    values = {}
    for name, spec in known.items():
        where = f"{path}.{name}"
        if name not in table:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise SftConfigError(
                    where,
                    MISSING,
                    "is required",
                    f"set it in [{path}] ({spec.metadata['help']}) or with --set {where}=...",
                    source=source,
                )
            continue
        value = table[name]
        if spec.metadata["kind"] == "evaluators":
            if not isinstance(value, list):
                raise SftConfigError(
                    where,
                    value,
                    "must be a list of tables",
                    "write [[eval.evaluators]]",
                    source=source,
                )
            values[name] = tuple(
                build_section(EvaluatorConfig, item, f"{where}[{i}]", source)
                for i, item in enumerate(value)
            )
            continue
        values[name] = check_value(where, value, spec.metadata, source)
    return cls(**values)


def parse_config(raw: Mapping[str, Any], *, source: str = "<config>") -> SftConfig:
    """Validate a configuration table (see the module docstring); raises SftConfigError."""
    raw = dict(raw)
    unknown = sorted(set(raw) - {"run", "model", "data", "tenants", "eval"})
    if unknown:
        raise SftConfigError(
            unknown[0], raw[unknown[0]], "unknown section",
            "use [run], [model], [data], [[tenants]] and [eval]", source=source,
        )  # fmt: skip
    for section in ("run", "model", "data"):
        if section not in raw:
            raise SftConfigError(
                section, MISSING, "the section is required", f"add [{section}]", source=source
            )
    run = build_section(RunConfig, raw["run"], "run", source)
    model = build_section(ModelConfig, raw["model"], "model", source)
    data = build_section(DataConfig, raw["data"], "data", source)
    tenants_raw = raw.get("tenants")
    if not isinstance(tenants_raw, list) or not tenants_raw:
        raise SftConfigError(
            "tenants",
            tenants_raw if tenants_raw is not None else MISSING,
            "at least one [[tenants]] table is required",
            'add [[tenants]] with name, data, rows and lr (e.g. data = "example:colours_train")',
            source=source,
        )
    tenants = tuple(
        build_section(TenantConfig, t, f"tenants[{i}]", source) for i, t in enumerate(tenants_raw)
    )
    evaluation = build_section(EvalConfig, raw["eval"], "eval", source) if "eval" in raw else None
    config = SftConfig(run, model, data, tenants, evaluation, source)
    _check_combinations(config)
    return config


def _check_combinations(config: SftConfig) -> None:
    source = config.source
    run = config.run

    def fail(field: str, value: Any, rule: str, fix: str) -> SftConfigError:
        return SftConfigError(field, value, rule, fix, source=source)

    if not run.dir:
        raise fail("run.dir", run.dir, "must not be empty", "name a directory for the run")
    names = [t.name for t in config.tenants]
    check_tenant_names(names, source)
    for i, tenant in enumerate(config.tenants):
        if tenant.rows % run.micro_batch_size:
            raise fail(
                f"tenants[{i}].rows", tenant.rows,
                f"must be a multiple of run.micro_batch_size={run.micro_batch_size} (a "
                "micro-batch holds one tenant's rows)",
                f"use rows = {max(1, tenant.rows // run.micro_batch_size) * run.micro_batch_size}"
                " or change run.micro_batch_size",
            )  # fmt: skip
        check_adapter_training(tenant, f"tenants[{i}]", run, source)
    check_model(config.model, source)
    check_eval(config.eval, run, names, source, kinds=EVALUATOR_KINDS)


def check_tenant_names(names: Sequence[str], source: str) -> None:
    for i, name in enumerate(names):
        if not _NAME.match(name):
            raise ConfigError(
                f"tenants[{i}].name", name,
                "must be 1-64 letters, digits, '_', '-' or '.' (it names directories)",
                'rename it, e.g. "colours"', source=source,
            )  # fmt: skip
        if name in names[:i]:
            raise ConfigError(
                f"tenants[{i}].name", name, "is not unique", "give each tenant its own name",
                source=source,
            )  # fmt: skip


def check_adapter_training(
    tenant: AdapterTrainingConfig, where: str, run: RunConfig, source: str
) -> None:
    """The rules of the LoRA / AdamW / schedule fields of one tenant."""

    def fail(field: str, value: Any, rule: str, fix: str) -> ConfigError:
        return ConfigError(f"{where}.{field}", value, rule, fix, source=source)

    if tenant.lr <= 0:
        raise fail("lr", tenant.lr, "must be > 0", "e.g. lr = 1e-4")
    if tenant.lora_alpha <= 0:
        raise fail("lora_alpha", tenant.lora_alpha, "must be > 0", "e.g. 32")
    if tenant.eps <= 0:
        raise fail("eps", tenant.eps, "must be > 0", "e.g. 1e-8")
    if len(tenant.betas) != 2 or not all(0 <= b < 1 for b in tenant.betas):
        raise fail("betas", tenant.betas, "must be two numbers in [0, 1)", "e.g. [0.9, 0.999]")
    if tenant.warmup_steps >= run.steps and tenant.warmup_steps:
        raise fail(
            "warmup_steps", tenant.warmup_steps,
            f"is not shorter than the run (run.steps={run.steps})", "shorten the warmup",
        )  # fmt: skip


def check_model(model: ModelConfig, source: str) -> None:
    if model.path == "tiny":
        unknown = sorted(set(model.tiny) - _tiny_fields())
        if unknown:
            raise ConfigError(
                f"model.tiny.{unknown[0]}", model.tiny[unknown[0]],
                "is not a field of the tiny Llama config",
                f"use some of {sorted(_tiny_fields())}", source=source,
            )  # fmt: skip
    elif model.tiny:
        raise ConfigError(
            "model.tiny", model.tiny, 'applies to model.path = "tiny" only',
            "remove [model.tiny], or set model.path = \"tiny\"", source=source,
        )  # fmt: skip


def check_eval(
    evaluation: EvalConfig | None,
    run: RunConfig,
    names: Sequence[str],
    source: str,
    *,
    kinds: Sequence[str],
) -> None:
    """The rules of [eval] and its evaluators (``kinds``: the evaluator kinds the run offers)."""

    def fail(field: str, value: Any, rule: str, fix: str) -> ConfigError:
        return ConfigError(field, value, rule, fix, source=source)

    if evaluation is None:
        return
    if not evaluation.evaluators:
        raise fail(
            "eval.evaluators", [], "[eval] is set but lists no evaluator",
            'add [[eval.evaluators]] (kind = "generate" or "loss"), or remove [eval]',
        )  # fmt: skip
    if evaluation.interval > run.steps:
        raise fail(
            "eval.interval", evaluation.interval,
            f"is longer than the run (run.steps={run.steps}): no interval point would exist, "
            "only the forced final one",
            f"set eval.interval <= {run.steps}, or raise run.steps",
        )  # fmt: skip
    if not evaluation.snapshot_dir:
        raise fail(
            "eval.snapshot_dir", evaluation.snapshot_dir,
            "evaluation reads exported snapshots, and no snapshot source is configured",
            'set eval.snapshot_dir = "snapshots" (a directory under run.dir), or remove [eval]',
        )  # fmt: skip
    seen = set()
    for i, ev in enumerate(evaluation.evaluators):
        where = f"eval.evaluators[{i}]"
        name = ev.name or ev.kind
        if name in seen:
            raise fail(f"{where}.name", name, "is not unique", "give each evaluator a name")
        seen.add(name)
        for tenant in ev.tenants:
            if tenant not in names:
                raise fail(f"{where}.tenants", ev.tenants, f"names no tenant {tenant!r}",
                           f"use tenants of [[tenants]]: {names}")  # fmt: skip
        if ev.kind not in kinds:
            raise fail(f"{where}.kind", ev.kind, "is no evaluator kind of this command",
                       f"use one of {list(kinds)}")  # fmt: skip
        if ev.kind in ("generate", "loss") and not ev.data:
            raise fail(f"{where}.data", ev.data, f"a {ev.kind} evaluator needs an eval set",
                       'set data = "eval.jsonl" (or example:NAME)')  # fmt: skip
        if ev.kind == "generate" and ev.batch_size > ENGINE_MAX_BATCH:
            raise fail(f"{where}.batch_size", ev.batch_size,
                       f"an engine call carries at most {ENGINE_MAX_BATCH} prompts",
                       f"use batch_size <= {ENGINE_MAX_BATCH}")  # fmt: skip
        if ev.kind == "generate" and not ev.reward:
            raise fail(f"{where}.reward", ev.reward, "a generate evaluator scores its answers",
                       'set reward = "f1", "math" or "module:function"')  # fmt: skip
        if ev.kind == "python" and not ev.factory:
            raise fail(f"{where}.factory", ev.factory, "a python evaluator is built by a factory",
                       'set factory = "my_pkg.evals:make"')  # fmt: skip
        if ev.kind != "python" and (ev.factory or ev.options):
            raise fail(f"{where}.factory", ev.factory, f"applies to kind = 'python', not {ev.kind!r}",
                       "remove factory/options")  # fmt: skip
        for url in ev.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise fail(f"{where}.engine_urls", url, "is not an http(s) URL",
                           'write e.g. "http://127.0.0.1:30000"')  # fmt: skip


def _tiny_fields() -> set[str]:
    from mizzen_rollout.engines.embedded.backend import load_tiny_config

    return (set(load_tiny_config()) - {"model_type"}) | {"seed", "head_dim", "rope_theta"}


# -- overrides ----------------------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``raw`` with every ``KEY=VALUE`` applied (dotted keys; list items by index)."""
    raw = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SftConfigError(
                item, MISSING, "an override is KEY=VALUE", 'write e.g. --set run.steps=60',
                source="--set",
            )  # fmt: skip
        parts = key.split(".")
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            nxt = parts[depth + 1]
            if isinstance(node, list):
                index = _index(part, node, key)
                node = node[index]
                continue
            if part not in node:
                node[part] = [] if nxt.isdigit() else {}
            node = node[part]
        last = parts[-1]
        value = _parse_value(text.strip())
        if isinstance(node, list):
            if last.isdigit() and int(last) == len(node):
                node.append(value)
            else:
                node[_index(last, node, key)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise SftConfigError(key, value, "does not name a table field", "check the key",
                                 source="--set")  # fmt: skip
    return raw


def _index(part: str, node: list, key: str) -> int:
    if not part.isdigit() or int(part) > len(node):
        raise SftConfigError(
            key, MISSING, f"list index {part!r} does not exist (the list has {len(node)})",
            f"use an index below {len(node) + 1} (== {len(node)} appends)", source="--set",
        )  # fmt: skip
    if int(part) == len(node):
        node.append({})
    return int(part)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def read_config_source(
    path: str | os.PathLike | None, overrides: Sequence[str] = ()
) -> tuple[dict[str, Any], str]:
    """The raw table of ``path`` (TOML, or ``example:NAME`` for a shipped one; None: overrides
    only) with the overrides applied, and its source name for messages."""
    raw: dict[str, Any] = {}
    source = "--set"
    if path is not None:
        source = os.fspath(path)
        if source.startswith("example:"):
            from mizzen_train.data import example_paths

            name = source[len("example:") :]
            shipped = example_paths(".toml")
            if name not in shipped:
                raise ConfigError(
                    "--config", source, "is no shipped configuration",
                    f"use one of {sorted('example:' + n for n in shipped)} or a file",
                )  # fmt: skip
            path = shipped[name]
        try:
            with open(path, "rb") as handle:
                raw = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError("--config", source, "no such file", "give a TOML file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                "--config", source, f"is not valid TOML ({exc})", "fix the syntax"
            ) from None
        except OSError as exc:
            raise ConfigError("--config", source, f"cannot be read ({exc})", "check it") from None
    if overrides:
        raw = apply_overrides(raw, overrides)
        source = f"{source} + --set"
    return raw, source


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> SftConfig:
    """Read ``path`` (TOML; None: overrides only), apply overrides, validate."""
    raw, source = read_config_source(path, overrides)
    return parse_config(raw, source=source)


def config_help(sections: Mapping[str, type] | None = None) -> str:
    """Every field of ``sections`` (default: SFT's): section, name, type, default or required,
    and what it is for."""
    lines = []
    for section, cls in (sections or SECTIONS).items():
        header = f"[[{section}]]" if section in ("tenants", "eval.evaluators") else f"[{section}]"
        lines.append(header)
        for spec in dataclasses.fields(cls):
            meta = spec.metadata
            if meta["kind"] == "evaluators":
                continue
            if spec.default is not MISSING:
                default = f"default {spec.default!r}"
            elif spec.default_factory is not MISSING:
                default = f"default {spec.default_factory()!r}"
            else:
                default = "required"
            choices = f" {list(meta['choices'])}" if meta["choices"] else ""
            lines.append(
                f"  {spec.name:<20} {meta['kind']:<11} {default:<26} {meta['help']}{choices}"
            )
    return "\n".join(lines)
