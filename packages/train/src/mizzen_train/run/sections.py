"""The configuration sections every run command shares, and their rules.

``[run]`` (the run directory, steps, checkpoints, device), ``[model]`` (the base model),
``[parallel]`` (tensor / context sizes under torchrun, :mod:`mizzen_train.run.parallel`),
``[eval]`` with its ``[[eval.evaluators]]``, and the LoRA / AdamW / schedule fields every tenant
has (:class:`AdapterTrainingConfig`, which each command's tenant section extends).
:class:`RunLayout` is what a configuration derives from ``[run]`` and ``[eval]``: the run
directory, the snapshot root and the eval points.

Invariants:
- Each field is declared once, here, with :func:`~mizzen_train.run.config.opt`; SFT and RL
  compose these sections into their own tables (:mod:`mizzen_train.sft.config`,
  :mod:`mizzen_train.rl.config`) and never import each other's.
- The checks below raise :class:`~mizzen_train.run.config.ConfigError` naming the field.
- The eval points of a run are defined once, by :meth:`RunLayout.eval_points`.
- A ``[model.tiny]`` table has one rule, :func:`check_tiny`: a training run's ``[model]`` and the
  server's (:mod:`mizzen_train.serve.config`) both call it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from mizzen_rollout.api import ENGINE_MAX_BATCH, MIN_SECRET_LENGTH, SecretError, register_url
from mizzen_train.eval_engines import ENGINE_LIFETIMES
from mizzen_train.run.config import (
    MAX_LORA_RANK,
    MAX_ROWS,
    MAX_SEED,
    MAX_THREADS,
    ConfigError,
    Presence,
    Section,
    build_config,
    check_input_files,
    config_help,
    opt,
    read_config_source,
)
from mizzen_train.run.layout import owned_entry
from mizzen_train.run.loggers import check_loggers
from mizzen_train.run.parallel import ParallelConfig
from mizzen_train.specs import MAX_LORA_SEED

__all__ = [
    "ENGINE_MAX_BATCH",
    "EVALUATOR_KINDS",
    "AdapterTrainingConfig",
    "EvalConfig",
    "EvaluatorConfig",
    "ModelConfig",
    "RunConfig",
    "RunLayout",
    "check_adapter_training",
    "check_eval",
    "check_model",
    "check_run_and_tenants",
    "check_tenant_names",
    "check_tiny",
    "run_sections",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class RunConfig:
    dir: str = opt(kind="str", help="run directory: checkpoints, snapshots, metrics.jsonl")
    steps: int = opt(kind="int", low=1, help="optimizer steps to train")
    checkpoint_interval: int = opt(
        kind="int", low=1, help="save a checkpoint every N steps (and always at the last step)"
    )
    keep_checkpoints: int = opt(2, kind="int", low=1, help="newest checkpoints kept on disk")
    seed: int = opt(0, kind="int", low=0, high=MAX_SEED, help="seed of the trainer's RNGs")
    device: str = opt(
        "auto", kind="str", choices=("auto", "cpu", "cuda"), help="auto: cuda when available"
    )
    dtype: str = opt(
        "auto", kind="str", choices=("auto", "fp32", "bf16"), help="auto: bf16 on cuda, else fp32"
    )
    micro_batch_size: int = opt(4, kind="int", low=1, high=MAX_ROWS, help="rows per micro-batch")
    threads: int = opt(
        0, kind="int", low=0, high=MAX_THREADS, help="torch CPU threads (0: torch's default)"
    )
    log_interval: int = opt(1, kind="int", low=1, help="print a progress line every N steps")
    plot: bool = opt(True, kind="bool", help="draw curves.png at the end (needs matplotlib)")
    export_merged: bool = opt(
        False, kind="bool", help="the final export adds each tenant's merged HF model"
    )
    loggers: tuple = opt(
        ("jsonl",), kind="list[str]", help="metric loggers: jsonl (always), tensorboard, wandb"
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt(
        kind="str", help='a local Hugging Face Llama directory (or a plugin base), or "tiny"'
    )
    plugin: str = opt(
        "", kind="str",
        help='a model plugin of the "mizzen.plugins" entry points (e.g. "nemotron_h", '
        '"deepseek_v4"); empty: the Llama on megatron-core',
    )  # fmt: skip
    tokenizer: str = opt(
        "model", kind="str", help='"model" (the model directory\'s), "byte", or a directory'
    )
    tiny: Mapping = opt(
        {},
        kind="table",
        help='with path = "tiny": "seed" and fields of the tiny Llama (or the plugin\'s tiny) '
        "config to override",
    )


@dataclass(frozen=True, kw_only=True)
class AdapterTrainingConfig:
    """A tenant's LoRA shape, AdamW settings and schedule: the fields SFT and RL tenants share."""

    lr: float = opt(kind="float", low=0.0, help="peak learning rate (AdamW), > 0")
    lora_rank: int = opt(16, kind="int", low=1, high=MAX_LORA_RANK, help="LoRA rank")
    lora_alpha: float = opt(32.0, kind="float", low=0.0, help="LoRA alpha (scale alpha/rank)")
    lora_init: str = opt(
        "kaiming_uniform", kind="str", choices=("kaiming_uniform", "gaussian"), help="A init"
    )
    lora_seed: int = opt(
        0, kind="int", low=0, high=MAX_LORA_SEED, help="seed of the A initialisation"
    )
    lr_schedule: str = opt(
        "constant", kind="str", choices=("constant", "cosine", "linear"), help="after warmup"
    )
    warmup_steps: int = opt(0, kind="int", low=0, help="linear warmup steps")
    min_lr_ratio: float = opt(0.0, kind="float", low=0.0, high=1.0, help="decayed lr floor")
    weight_decay: float = opt(0.0, kind="float", low=0.0, help="AdamW weight decay")
    betas: tuple = opt((0.9, 0.999), kind="list[float]", help="AdamW betas")
    eps: float = opt(1e-8, kind="float", low=0.0, help="AdamW eps")
    max_grad_norm: float = opt(1.0, kind="float", low=0.0, help="clip norm (0: no clipping)")
    data_seed: int = opt(0, kind="int", low=0, high=MAX_SEED, help="seed of the data order")


EVALUATOR_KINDS = ("generate", "loss", "python")


@dataclass(frozen=True)
class EvaluatorConfig:
    kind: str = opt(kind="str", choices=EVALUATOR_KINDS, help="generate | loss | python")
    name: str = opt("", kind="str", help="unique name of its results (default: the kind)")
    tenants: tuple = opt((), kind="list[str]", help="tenants it evaluates (default: all)")
    data: str = opt(
        "", kind="str", input_file=True, help="generate/loss: the eval set (JSON lines or example:)"
    )
    limit: int = opt(0, kind="int", low=0, help="generate/loss: first N records (0: all)")
    reward: str = opt("", kind="str", help="generate: math | f1 | module:function")
    max_new_tokens: int = opt(64, kind="int", low=1, help="generate: tokens per answer")
    temperature: float = opt(0.0, kind="float", low=0.0, help="generate: 0 = greedy")
    engine_urls: tuple = opt((), kind="list[str]", help="generate: SGLang/embedded server URLs")
    num_engines: int = opt(1, kind="int", low=1, high=64, help="generate: embedded engines")
    engine_threads: int = opt(
        1, kind="int", low=1, high=MAX_THREADS, help="generate: torch threads per engine"
    )
    startup_timeout_s: float = opt(300.0, kind="float", low=0.001, help="generate: engine start")
    request_timeout_s: float = opt(300.0, kind="float", low=0.001, help="generate: per engine call")
    batch_size: int = opt(
        8, kind="int", low=1,
        help="generate: prompts per engine call (one batched /generate, at most "
        "ENGINE_MAX_BATCH); loss: examples per forward",
    )  # fmt: skip
    device: str = opt(
        "cpu", kind="str", choices=("cpu", "cuda"),
        help="generate: where its embedded engines run; loss: where it runs",
    )  # fmt: skip
    engine_lifetime: str = opt(
        "run", kind="str", choices=ENGINE_LIFETIMES,
        help="generate: its embedded engines kept from the first point to the run's end (run; "
        "they hold their memory between points) or started and stopped at each point (point)",
    )  # fmt: skip
    factory: str = opt("", kind="str", help="python: module:factory building the evaluator")
    options: Mapping = opt({}, kind="table", help="python: keyword arguments of the factory")


@dataclass(frozen=True)
class EvalConfig:
    interval: int = opt(kind="int", low=1, help="evaluate every N steps (the last step always)")
    snapshot_dir: str = opt(
        "",
        kind="str",
        help="required: where snapshots are exported (a directory of its own under run.dir)",
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
    evaluators: tuple = opt(
        (), kind="tables", item=EvaluatorConfig, help="[[eval.evaluators]] tables"
    )


class RunLayout:
    """What a run's configuration derives from its ``run`` and ``eval`` sections, for SFT and RL
    alike: the run directory, the snapshot root and the eval points."""

    run: RunConfig
    model: ModelConfig
    parallel: ParallelConfig
    tenants: tuple[AdapterTrainingConfig, ...]
    eval: EvalConfig | None
    source: str
    #: The command's one table of sections (``run_sections(...)``) and what a missing
    #: ``[[tenants]]`` list needs: set by each command's configuration class.
    SECTIONS: ClassVar[dict[str, Section]]
    MANY_FIX: ClassVar[str]

    @classmethod
    def parse(cls, raw: Mapping[str, Any], *, source: str = "<config>") -> Self:
        """Validate a configuration table: its sections, then :meth:`check`; raises
        ConfigError."""
        config = build_config(cls, dict(raw), cls.SECTIONS, source=source, many_fix=cls.MANY_FIX)
        config.check()
        return config

    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Self:
        """Read ``path`` (TOML, ``example:NAME``; None: overrides only), apply the ``--set``
        overrides, validate."""
        raw, source = read_config_source(path, overrides)
        return cls.parse(raw, source=source)

    @classmethod
    def help_text(cls) -> str:
        """Every field of the command's sections (``--help-config``)."""
        return config_help(cls.SECTIONS)

    def check(self) -> None:
        """The command's rules across sections (after each section's own)."""
        raise NotImplementedError

    def check_input_files(self) -> None:
        """Every data file the run will read exists (before a model is built: a run's first
        step, not an export's or a service's, which read none)."""
        check_input_files(self, self.source)

    @property
    def evaluators(self) -> tuple[EvaluatorConfig, ...]:
        return tuple(self.eval.evaluators) if self.eval is not None else ()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    @property
    def snapshot_root(self) -> Path | None:
        """Where eval snapshots go: under the run directory (check_eval confines it)."""
        if self.eval is None:
            return None
        return self.run_dir / self.eval.snapshot_dir

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (tuples as lists), as run.json stores them."""
        out = dataclasses.asdict(self)  # type: ignore[call-overload]
        out.pop("source")
        if not out["model"]["plugin"]:  # a Llama run's run.json stays as it was before plugins
            del out["model"]["plugin"]
        return json.loads(json.dumps(out))

    def eval_points(self) -> list[int]:
        """The steps evaluated: every ``interval`` and the last step (forced)."""
        if self.eval is None:
            return []
        points = list(range(self.eval.interval, self.run.steps + 1, self.eval.interval))
        if not points or points[-1] != self.run.steps:
            points.append(self.run.steps)
        return points


def run_sections(**own: Section) -> dict[str, Section]:
    """A command's one table of sections: ``[run]``, ``[model]``, ``[parallel]``
    (:mod:`mizzen_train.run.parallel`; its defaults when absent), the command's ``own`` (in
    order), then ``[eval]`` and its ``[[eval.evaluators]]``."""
    return {
        "run": Section(RunConfig, Presence.REQUIRED),
        "model": Section(ModelConfig, Presence.REQUIRED),
        "parallel": Section(ParallelConfig, Presence.DEFAULTED),
        **own,
        "eval": Section(EvalConfig, Presence.OPTIONAL),
        "eval.evaluators": Section(EvaluatorConfig, Presence.MANY),
    }


def check_run_and_tenants(config: RunLayout) -> list[str]:
    """The shared rules of ``[run]`` and every tenant (names, LoRA / AdamW / schedule fields);
    returns the tenant names."""
    run = config.run
    if not run.dir:
        raise ConfigError("run.dir", run.dir, "must not be empty", "name a directory for the run",
                          source=config.source)  # fmt: skip
    check_loggers(run.loggers, config.source)
    names = [t.name for t in config.tenants]
    check_tenant_names(names, config.source)
    for i, tenant in enumerate(config.tenants):
        check_adapter_training(tenant, f"tenants[{i}]", run, config.source)
    return names


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


def check_model(model: ModelConfig, source: str, *, tensor_parallel: int = 1) -> None:
    """``[model]``'s rules; ``tensor_parallel``: the run's TP size (plugin models need 1).
    ``[model.tiny]`` is checked by :func:`check_tiny` (its table kept as written: its digest
    names the tiny base model a run directory holds)."""
    if model.plugin:
        _check_plugin(model, source, tensor_parallel)
    check_tiny(model.tiny, source, path=model.path, plugin=model.plugin)


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
    snapshot_dir = Path(evaluation.snapshot_dir)
    if snapshot_dir.is_absolute() or ".." in snapshot_dir.parts:
        raise fail(
            "eval.snapshot_dir", evaluation.snapshot_dir,
            "must stay inside run.dir (a relative path without '..')",
            'use e.g. snapshot_dir = "snapshots"',
        )  # fmt: skip
    if not snapshot_dir.parts:
        raise fail(
            "eval.snapshot_dir", evaluation.snapshot_dir,
            "is run.dir itself: each snapshot is deleted once evaluated, and the engines may "
            "read everything under the snapshot directory",
            'use a directory of its own, e.g. snapshot_dir = "snapshots"',
        )  # fmt: skip
    owner = owned_entry(snapshot_dir.parts[0])
    if owner is not None:
        raise fail(
            "eval.snapshot_dir", evaluation.snapshot_dir,
            f"is inside {snapshot_dir.parts[0]!r}, where the run keeps {owner}: snapshots are "
            "named by step like checkpoints and exports, and each is deleted once evaluated",
            'use a directory of its own, e.g. snapshot_dir = "snapshots"',
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
        if ev.engine_urls and ev.engine_lifetime != "run":
            raise fail(f"{where}.engine_lifetime", ev.engine_lifetime,
                       "applies to the embedded engines the evaluator starts, and with "
                       "engine_urls it starts none",
                       "remove engine_lifetime or engine_urls")  # fmt: skip
        for url in ev.engine_urls:
            register_engine_url(url, f"{where}.engine_urls", fail)
            if not url.startswith(("http://", "https://")):
                raise fail(f"{where}.engine_urls", url, "is not an http(s) URL",
                           'write e.g. "http://127.0.0.1:30000"')  # fmt: skip


def register_engine_url(url: str, field: str, fail: Any) -> None:
    """Register the credentials an engine URL carries in rollout's process-wide mask set (no
    output shows them); a password too short to mask is a ConfigError (its value not shown)."""
    try:
        register_url(url, source=field)
    except SecretError:
        refused = True
    else:
        refused = False
    if refused:  # raised outside the except: nothing chained
        raise fail(
            field, "***", f"carries a credential shorter than {MIN_SECRET_LENGTH} characters, "
            "too short to be masked in output", f"use one of {MIN_SECRET_LENGTH} or more",
        )  # fmt: skip


def _check_plugin(model: ModelConfig, source: str, tensor_parallel: int) -> None:
    """A known, trainable plugin, without tensor parallelism."""
    import mizzen_plugins

    installed = mizzen_plugins.available()
    if model.plugin not in installed:
        raise ConfigError(
            "model.plugin", model.plugin, "names no installed model plugin (entry-point group "
            f"{mizzen_plugins.ENTRY_POINT_GROUP!r})", f"use one of {list(installed)}, or install "
            "the distribution that declares it", source=source,
        )  # fmt: skip
    try:
        plugin = mizzen_plugins.get(model.plugin)
    except (mizzen_plugins.PluginLoadError, mizzen_plugins.PluginNotFoundError) as exc:
        raise ConfigError(
            "model.plugin", model.plugin, f"does not load ({exc})", "fix or reinstall the plugin",
            source=source,
        ) from None  # fmt: skip
    if plugin.causal_lm is None:
        trainable = [n for n in installed if mizzen_plugins.get(n).causal_lm is not None]
        raise ConfigError(
            "model.plugin", model.plugin, "offers no causal language model to train",
            f"use one of {trainable}", source=source,
        )  # fmt: skip
    if tensor_parallel != 1:
        raise ConfigError(
            "parallel.tensor", tensor_parallel,
            f"plugin model {model.plugin!r} has no tensor parallel layers (plain nn.Linear)",
            "use tensor parallel size 1 with a plugin model", source=source,
        )  # fmt: skip


#: The tiny model's ranges (a plugin's tiny field of the same name has the same): a size or id
#: past these fails allocating.  Any other integer field is in [1, MAX_TINY_SIZE] when it counts
#: something (``*_size``, ``num_*``), else in [0, MAX_TINY_SIZE]; any other float in (0, 1e12].
MAX_TINY_SIZE = 2**20
MAX_TINY_VOCAB = 262_144
MAX_TINY_WIDTH = 65_536
_TINY_RANGES: dict[str, tuple[float, float]] = {
    "vocab_size": (259, MAX_TINY_VOCAB),
    "hidden_size": (1, MAX_TINY_WIDTH),
    "intermediate_size": (1, MAX_TINY_WIDTH),
    "num_hidden_layers": (1, 256),
    "num_attention_heads": (1, MAX_TINY_WIDTH),
    "num_key_value_heads": (1, MAX_TINY_WIDTH),
    "head_dim": (1, MAX_TINY_WIDTH),
    "max_position_embeddings": (1, MAX_TINY_SIZE),
    "bos_token_id": (0, MAX_TINY_VOCAB - 1),
    "eos_token_id": (0, MAX_TINY_VOCAB - 1),
    "pad_token_id": (0, MAX_TINY_VOCAB - 1),
    "seed": (0, MAX_LORA_SEED),
    "rms_norm_eps": (1e-12, 1.0),
    "initializer_range": (0.0, 10.0),  # floats are positive: (0, 10]
    "rope_theta": (1.0, 1e12),
}
#: Why a range is what it is, shown with its rule.
_TINY_WHY = {"vocab_size": " (the byte tokenizer uses 259 token ids)"}
#: The string fields with a fixed set of values (a plugin's tiny config has no model_type field:
#: the plugin decides it).
_TINY_CHOICES = {"model_type": ("llama",)}


def check_tiny(
    tiny: Mapping[str, Any], source: str, *, path: str, plugin: str = "", seed: bool = True
) -> dict[str, Any]:
    """The one rule of a ``[model.tiny]`` table (overrides of the packaged tiny Llama's config,
    or of ``plugin``'s tiny config), for a training run's ``[model]`` and the server's alike.

    - It applies to ``path == "tiny"`` only.
    - Its keys are fields of that config (a Llama's also ``head_dim`` and ``rope_theta``), and
      ``seed`` where ``seed`` says the table carries the weights' seed; any other is refused
      naming the fields there are.
    - Each value has the type of the field's default (a bool, an integer, a float, a string),
      is in the field's range (``_TINY_RANGES``: ``vocab_size`` >= 259, the byte
      tokenizer's) and among its choices (``model_type``: "llama").
    - A Llama's attention heads divide its hidden size (unless ``head_dim`` is set), its
      key/value heads divide its attention heads, a head's width is even (rotary embeddings
      turn pairs) and the whole has at most :data:`MAX_TINY_PARAMETERS` (it is drawn in memory).
    - A plugin's table, merged into its tiny config, is a config its config class accepts.

    Returns the table with each float field a float (an integer ``1`` as ``1.0``); raises
    :class:`~mizzen_train.run.config.ConfigError` naming ``model.tiny.<field>``."""
    if path != "tiny":
        if tiny:
            raise ConfigError(
                "model.tiny", tiny, 'applies to model.path = "tiny" only',
                "remove [model.tiny], or set model.path = \"tiny\"", source=source,
            )  # fmt: skip
        return {}
    defaults = _tiny_defaults(plugin, seed)
    _check_tiny_keys(tiny, defaults, source, plugin=plugin, seed=seed)
    typed = {name: _tiny_value(name, v, defaults[name], source) for name, v in tiny.items()}
    if plugin:  # a plugin's head size may be its own: its config class checks the whole
        _check_plugin_tiny(plugin, typed, source)
    else:
        _check_tiny_heads({**defaults, **typed}, "head_dim" in typed, source)
        _check_tiny_size({**defaults, **typed}, "head_dim" in typed, source)
    return typed


def _check_plugin_tiny(plugin: str, typed: Mapping[str, Any], source: str) -> None:
    """``plugin``'s tiny config with ``typed`` merged in is one its config class accepts."""
    import mizzen_plugins

    model = mizzen_plugins.get(plugin)
    merged = {**(model.tiny_config or {}), **{k: v for k, v in typed.items() if k != "seed"}}
    try:
        model.config_from_hf(merged)
    except (ValueError, TypeError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise ConfigError(
            "model.tiny", dict(typed), f"makes no valid {plugin} config ({reason})",
            f"change the fields it names, or leave them as {plugin}'s tiny config has them",
            source=source,
        ) from None  # fmt: skip


#: The largest tiny Llama (about 8 GiB of fp32 weights): it is drawn in memory from code.
MAX_TINY_PARAMETERS = 2**31


def _check_tiny_size(merged: Mapping[str, Any], head_dim_set: bool, source: str) -> None:
    hidden, heads = merged["hidden_size"], merged["num_attention_heads"]
    groups = merged["num_key_value_heads"]
    width = merged["head_dim"] if head_dim_set else hidden // heads
    attention = hidden * width * (2 * heads + 2 * groups)  # q and o, k and v
    per_layer = attention + 3 * hidden * merged["intermediate_size"]
    embeddings = merged["vocab_size"] * hidden * (1 if merged["tie_word_embeddings"] else 2)
    parameters = merged["num_hidden_layers"] * per_layer + embeddings
    if parameters > MAX_TINY_PARAMETERS:
        raise ConfigError(
            "model.tiny", {k: merged[k] for k in ("hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "vocab_size")},
            f"makes a model of {parameters:,} parameters; a tiny one has at most "
            f"{MAX_TINY_PARAMETERS:,}", "use smaller sizes, or a model directory as model.path",
            source=source,
        )  # fmt: skip


def _check_tiny_keys(
    tiny: Mapping[str, Any], defaults: Mapping[str, Any], source: str, *, plugin: str, seed: bool
) -> None:
    unknown = sorted(set(tiny) - set(defaults))
    if unknown:
        name = unknown[0]
        fix = f"use some of {sorted(defaults)}"
        if name == "seed" and not seed:
            fix = "set the weights' seed as model.seed"
        raise ConfigError(
            f"model.tiny.{name}", tiny[name],
            f"is not a field of the tiny {plugin or 'Llama'} config", fix, source=source,
        )  # fmt: skip


def _tiny_value(name: str, value: Any, default: Any, source: str) -> Any:
    """``value`` of ``[model.tiny]``'s field ``name`` checked against the field's type (its
    ``default``'s), range and choices; a float field's as a float."""

    def fail(rule: str, fix: str = f"use e.g. {name} = {json.dumps(default)}") -> ConfigError:
        return ConfigError(f"model.tiny.{name}", value, rule, fix, source=source)

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise fail("must be true or false", "write true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("must be an integer")
        counts = name.endswith("_size") or name.startswith("num_")
        low, high = _TINY_RANGES.get(name, (1 if counts else 0, MAX_TINY_SIZE))
        if not low <= value <= high:
            raise fail(f"must be in [{low}, {high}]{_TINY_WHY.get(name, '')}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail("must be a finite number")
        low, high = _TINY_RANGES.get(name, (0.0, 1e12))
        if not (value > 0 and low <= value <= high):  # NaN fails every comparison
            raise fail(f"must be in {'(0' if low <= 0 else f'[{low:g}'}, {high:g}]")
        value = float(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise fail("must be a string")
        choices = list(_TINY_CHOICES.get(name, (value,)))
        if value not in choices:
            raise fail(f"must be one of {choices}", f"use one of {choices}, or leave it out")
    return value  # a list or table field: the plugin's config class checks it


def _check_tiny_heads(merged: Mapping[str, Any], head_dim_set: bool, source: str) -> None:
    """The attention heads divide the hidden size (unless ``head_dim`` is set: a head's own
    width), and the key/value heads divide the attention heads."""
    hidden, heads = merged["hidden_size"], merged["num_attention_heads"]
    groups = merged["num_key_value_heads"]
    if heads % groups or (not head_dim_set and hidden % heads):
        raise ConfigError(
            "model.tiny.num_attention_heads", heads,
            f"must divide hidden_size={hidden}, and num_key_value_heads={groups} must divide "
            "it", "choose heads that divide the hidden size (e.g. hidden_size = 64, "
            "num_attention_heads = 4, num_key_value_heads = 2)", source=source,
        )  # fmt: skip
    width = merged["head_dim"] if head_dim_set else hidden // heads
    if width % 2:
        field = "head_dim" if head_dim_set else "num_attention_heads"
        raise ConfigError(
            f"model.tiny.{field}", merged[field],
            f"makes heads {width} wide; rotary embeddings need an even width",
            "choose sizes whose head width is even (e.g. hidden_size = 64, "
            "num_attention_heads = 4: 16)", source=source,
        )  # fmt: skip


def _tiny_defaults(plugin: str, seed: bool) -> dict[str, Any]:
    """The fields a ``[model.tiny]`` table may set, each with its value when unset (``seed``:
    with the weights' seed, 0)."""
    if plugin:
        import mizzen_plugins

        packaged = dict(mizzen_plugins.get(plugin).tiny_config or {})
        packaged.pop("model_type", None)  # the plugin's, not a field to override
    else:
        from mizzen_rollout.api import load_tiny_config
        from mizzen_train.hf.tiny import LLAMA_EXTRA_FIELDS

        packaged = {**load_tiny_config(), **LLAMA_EXTRA_FIELDS}
    return {**packaged, "seed": 0} if seed else packaged
