"""The configuration of an SFT run: SFT's sections composed with the shared ones of
:mod:`mizzen_train.run.sections`, in the table machinery of :mod:`mizzen_train.run.config`.

A run is described by ``run.toml`` and ``--set KEY=VALUE`` overrides (``run.steps=60``,
``tenants.0.lr=1e-3``, ``eval.evaluators.1.limit=16``; the value is read as a TOML value, and as
a plain string when it is not one).  Sections::

    [run]              dir, steps, checkpoint_interval (required), seed, device, dtype, ...
    [model]            path (an HF Llama directory, or "tiny"), tokenizer, [model.tiny]
    [parallel]         tensor, context (under torchrun; data parallel = the rest), timeout_s
    [data]             seq_len (required), on_overlong
    [[tenants]]        name, data, rows, lr (required), LoRA and AdamW settings, schedule
    [eval]             interval, snapshot_dir (required with [eval]), max_in_flight, overflow,
                       keep_snapshots, runner
    [[eval.evaluators]] kind = "generate" | "loss" | "python" and its fields

Invariants:
- :data:`SECTIONS` is SFT's one table: the reader, ``--set``, ``mizzen-train sft --help-config``
  and the command line's flags read it.
- Everything read is untrusted: a value or a combination that cannot work (eval without a
  snapshot source, an eval interval longer than the run, ...) raises
  :class:`~mizzen_train.run.config.ConfigError` naming the file and the field, the rule and the
  fix -- before anything is built.
- :attr:`SftConfig.engines_needed` is derived once here, and every other module reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mizzen_train.run.config import (
    MAX_ROWS,
    ConfigError,
    Presence,
    Section,
    opt,
)
from mizzen_train.run.engines_needed import EnginesNeeded, engines_needed
from mizzen_train.run.parallel import ParallelConfig
from mizzen_train.run.sections import (
    EVALUATOR_KINDS,
    AdapterTrainingConfig,
    EvalConfig,
    ModelConfig,
    RunConfig,
    RunLayout,
    check_eval,
    check_model,
    check_run_and_tenants,
    run_sections,
)

__all__ = [
    "SECTIONS",
    "DataConfig",
    "SftConfig",
    "TenantConfig",
    "load_config",
    "parse_config",
]


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = opt(kind="int", low=8, help="positions per packed row")
    on_overlong: str = opt(
        "error", kind="str", choices=("error", "drop"), help="an example longer than seq_len"
    )


@dataclass(frozen=True, kw_only=True)
class TenantConfig(AdapterTrainingConfig):
    name: str = opt(kind="str", help="tenant name (its slot, snapshots and metrics)")
    data: str = opt(
        kind="str", input_file=True, help="training data: a JSON-lines file or example:NAME"
    )
    rows: int = opt(kind="int", low=1, high=MAX_ROWS, help="packed rows of this tenant per step")


@dataclass(frozen=True)
class SftConfig(RunLayout):
    run: RunConfig
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    tenants: tuple[TenantConfig, ...]
    eval: EvalConfig | None
    source: str = ""
    SECTIONS: ClassVar[dict[str, Section]] = run_sections(
        data=Section(DataConfig, Presence.REQUIRED),
        tenants=Section(TenantConfig, Presence.MANY),
    )
    MANY_FIX: ClassVar[str] = (
        'add [[tenants]] with name, data, rows and lr (e.g. data = "example:colours_train")'
    )

    @property
    def engines_needed(self) -> EnginesNeeded:
        """Derived once from the configuration; SFT trains without engines."""
        return engines_needed(
            train_needs_engines=False,
            eval_needs_engines=any(e.kind == "generate" for e in self.evaluators),
        )

    def check(self) -> None:
        _check_combinations(self)


#: SFT's one table of sections, and the command's reader (:class:`RunLayout`'s).
SECTIONS = SftConfig.SECTIONS
parse_config = SftConfig.parse
load_config = SftConfig.load


def _check_combinations(config: SftConfig) -> None:
    source = config.source
    run = config.run

    def fail(field: str, value: Any, rule: str, fix: str) -> ConfigError:
        return ConfigError(field, value, rule, fix, source=source)

    names = check_run_and_tenants(config)
    for i, tenant in enumerate(config.tenants):
        if tenant.rows % run.micro_batch_size:
            raise fail(
                f"tenants[{i}].rows", tenant.rows,
                f"must be a multiple of run.micro_batch_size={run.micro_batch_size} (a "
                "micro-batch holds one tenant's rows)",
                f"use rows = {max(1, tenant.rows // run.micro_batch_size) * run.micro_batch_size}"
                " or change run.micro_batch_size",
            )  # fmt: skip
    check_model(config.model, source)
    check_eval(config.eval, run, names, source, kinds=EVALUATOR_KINDS)
