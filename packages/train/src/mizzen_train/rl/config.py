"""The configuration of an RL run: RL's sections composed with the shared ones of
:mod:`mizzen_train.run.sections`, in the table machinery of :mod:`mizzen_train.run.config`.

Sections (``[run]``, ``[model]`` and ``[eval]`` are the shared ones, field for field)::

    [run]              dir, steps, checkpoint_interval (required), seed, device, dtype, ...
    [model]            path (an HF Llama directory, or "tiny"), tokenizer, [model.tiny]
    [parallel]         tensor, context (under torchrun; data parallel = the rest), timeout_s
    [rollout]          engines (embedded | urls | ray), sampling, off_policy, old_logprobs, ...
    [algo]             advantage estimator, clip range, kl_coef
    [[tenants]]        name, data (prompts), reward, lr, prompts_per_step, n_samples, join/leave
                       steps, and the shared LoRA / AdamW / schedule fields
    [eval]             the shared one: interval, snapshot_dir, ...; evaluators of kind "generate" (on the
                       tenant's adapter snapshot, served by the run's engines) or "python"

Invariants:
- :data:`SECTIONS` is RL's one table: every field is declared once, below or in the shared
  sections; ``--set``, the reader, the flags and ``mizzen-train rl --help-config`` read it.
  Errors are :class:`~mizzen_train.run.config.ConfigError` naming the file and field, before
  anything runs.
- :attr:`RlConfig.engines_needed` is ``train+eval``: rollouts need engines.
- Reading a configuration imports no code: ``algo.advantage`` is checked for its form (a built-in
  name or ``module:function``) only, so a stored one (``run.json`` of a run directory someone
  handed over, read by ``mizzen-train export``) is data.  The training command alone resolves
  it (:func:`load_advantage`), as it alone resolves the tenants' rewards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mizzen_train.run.config import (
    MAX_THREADS,
    ConfigError,
    Presence,
    Section,
    opt,
)
from mizzen_train.run.engines_needed import EnginesNeeded, engines_needed
from mizzen_train.run.parallel import ParallelConfig
from mizzen_train.run.sections import (
    ENGINE_MAX_BATCH,
    AdapterTrainingConfig,
    EvalConfig,
    EvaluatorConfig,
    ModelConfig,
    RunConfig,
    RunLayout,
    check_eval,
    check_model,
    check_run_and_tenants,
    register_engine_url,
    run_sections,
)

if TYPE_CHECKING:
    from mizzen_train.rl.advantages import AdvantageFn

__all__ = [
    "AlgoConfig",
    "RlConfig",
    "RlTenantConfig",
    "RolloutSection",
    "load_advantage",
    "load_rl_config",
    "parse_rl_config",
    "rl_config_help",
]

ENGINE_KINDS = ("embedded", "urls", "ray")
#: The engine fields of a generate evaluator (in SFT it starts its own engines) that RL refuses,
#: since RL evaluates on the run's engines, and what to do instead.
RL_EVAL_ENGINE_FIELDS = {
    "engine_urls": "set [rollout] engines and engine_urls instead",
    "num_engines": "set rollout.num_engines instead",
    "engine_threads": "set rollout.engine_threads instead",
    "device": "set rollout.engine_device instead",
    "engine_lifetime": "the run's engines serve every point",
}

#: RL evaluators: generation on the tenant's adapter snapshot, or a user's.
RL_EVALUATOR_KINDS = ("generate", "python")


@dataclass(frozen=True)
class RolloutSection:
    engines: str = opt(
        "embedded", kind="str", choices=ENGINE_KINDS,
        help="embedded: engines started by the run; urls: running SGLang servers; ray: the "
        "Ray rollout manager's embedded engines",
    )  # fmt: skip
    num_engines: int = opt(1, kind="int", low=1, high=64, help="embedded / ray: engines")
    engine_urls: tuple = opt((), kind="list[str]", help="urls: SGLang (or embedded) servers")
    engine_threads: int = opt(
        1, kind="int", low=1, high=MAX_THREADS, help="torch threads per embedded engine"
    )
    engine_device: str = opt(
        "auto", kind="str", choices=("auto", "cpu", "cuda"), help="embedded: auto = run.device"
    )
    ray_address: str = opt("", kind="str", help="ray: cluster address (default: local)")
    startup_timeout_s: float = opt(300.0, kind="float", low=0.001, help="engine start deadline")
    request_timeout_s: float = opt(300.0, kind="float", low=0.001, help="per engine call")
    max_new_tokens: int = opt(16, kind="int", low=1, help="tokens per response (default)")
    temperature: float = opt(1.0, kind="float", low=0.0, help="sampling temperature (> 0)")
    top_p: float = opt(1.0, kind="float", low=0.0, high=1.0, help="nucleus sampling")
    top_k: int = opt(-1, kind="int", low=-1, help="sample among the k likeliest tokens (-1: off)")
    max_concurrency: int = opt(64, kind="int", low=1, help="engine calls in flight per tenant")
    batch_size: int = opt(
        8, kind="int", low=1, high=ENGINE_MAX_BATCH,
        help="samples per engine call (one batched /generate; 1: a request per sample)",
    )  # fmt: skip
    off_policy: bool = opt(
        False, kind="bool",
        help="rollout of step t+1 overlaps training of step t (samples one version behind)",
    )  # fmt: skip
    old_logprobs: str = opt(
        "trainer", kind="str", choices=("trainer", "engine"),
        help="trainer: the executor's forward_logprobs; engine: the rollout's own, used when "
        "their mean |difference| is within max_logprob_mismatch",
    )  # fmt: skip
    max_logprob_mismatch: float = opt(
        0.05, kind="float", low=0.0, help="engine old log-probs: the bound (nats per token)"
    )
    keep_adapters: int = opt(
        2, kind="int", low=0, help="published adapter versions kept per tenant (0: all)"
    )


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = opt("grpo", kind="str", help="grpo | mean | module:function")
    clip_low: float = opt(0.2, kind="float", low=0.0, high=0.999, help="ratio >= 1 - clip_low")
    clip_high: float = opt(0.2, kind="float", low=0.0, help="ratio <= 1 + clip_high")
    kl_coef: float = opt(0.0, kind="float", low=0.0, help="weight of KL(policy || base)")


@dataclass(frozen=True, kw_only=True)
class RlTenantConfig(AdapterTrainingConfig):
    name: str = opt(kind="str", help="tenant name (its slot, adapters and metrics)")
    data: str = opt(
        kind="str",
        input_file=True,
        help="prompts: a JSON-lines file ('prompt', 'label') or example:",
    )
    reward: str = opt(kind="str", help="math | f1 | module:function | file.py:function")
    prompts_per_step: int = opt(kind="int", low=1, help="prompts per step")
    n_samples: int = opt(4, kind="int", low=2, help="samples per prompt (one group)")
    max_new_tokens: int = opt(0, kind="int", low=0, help="0: [rollout] max_new_tokens")
    join_step: int = opt(1, kind="int", low=1, help="first step the tenant trains")
    leave_step: int = opt(0, kind="int", low=0, help="last step it trains (0: to the end)")


@dataclass(frozen=True)
class RlConfig(RunLayout):
    run: RunConfig
    model: ModelConfig
    parallel: ParallelConfig
    rollout: RolloutSection
    algo: AlgoConfig
    tenants: tuple[RlTenantConfig, ...]
    eval: EvalConfig | None
    source: str = ""
    SECTIONS: ClassVar[dict[str, Section]] = run_sections(
        rollout=Section(RolloutSection, Presence.DEFAULTED),
        algo=Section(AlgoConfig, Presence.DEFAULTED),
        tenants=Section(RlTenantConfig, Presence.MANY),
    )
    MANY_FIX: ClassVar[str] = "add [[tenants]] with name, data, reward, lr and prompts_per_step"

    @property
    def engines_needed(self) -> EnginesNeeded:
        return engines_needed(train_needs_engines=True, eval_needs_engines=bool(self.evaluators))

    def check(self) -> None:
        _check(self)

    def active(self, step: int) -> list[RlTenantConfig]:
        """The tenants that train at ``step`` (joined, not yet left), in table order."""
        return [
            t
            for t in self.tenants
            if t.join_step <= step and (t.leave_step == 0 or step <= t.leave_step)
        ]


#: RL's one table of sections, and the command's reader (:class:`RunLayout`'s).
SECTIONS = RlConfig.SECTIONS
parse_rl_config = RlConfig.parse
load_rl_config = RlConfig.load
rl_config_help = RlConfig.help_text


def _check_advantage_form(spec: str, fail: Any) -> None:
    """A built-in estimator's name or ``module:function``, by the loader's rule
    (:func:`mizzen_rollout.api.check_spec_form`), never imported."""
    from mizzen_rollout.api import ObjectSpecError, check_spec_form
    from mizzen_train.rl.advantages import ESTIMATORS

    try:
        check_spec_form(spec, what="advantage estimator", builtins=ESTIMATORS)
    except ObjectSpecError as exc:
        rule, _, fix = str(exc).partition(" Fix: ")
        rule = rule.removeprefix(f"advantage estimator {spec!r} ").removesuffix(".")
        raise fail("algo.advantage", spec, rule, fix or "use grpo or mean") from None


def load_advantage(config: RlConfig) -> AdvantageFn:
    """The estimator ``algo.advantage`` names, imported: for the command that trains (given its
    configuration by the operator), never for one that reads a stored configuration."""
    from mizzen_train.rl.advantages import load_estimator

    try:
        return load_estimator(config.algo.advantage)
    except ValueError as exc:
        raise ConfigError(
            "algo.advantage", config.algo.advantage, str(exc), "use grpo or mean, or name a "
            "function that loads", source=config.source,
        ) from None  # fmt: skip


def _check(config: RlConfig) -> None:
    source, run, rollout = config.source, config.run, config.rollout

    def fail(field: str, value: Any, rule: str, fix: str) -> ConfigError:
        return ConfigError(field, value, rule, fix, source=source)

    names = check_run_and_tenants(config)
    for i, tenant in enumerate(config.tenants):
        where = f"tenants[{i}]"
        rows = tenant.prompts_per_step * tenant.n_samples
        if rows % run.micro_batch_size:
            raise fail(
                f"{where}.prompts_per_step", tenant.prompts_per_step,
                f"prompts_per_step x n_samples = {rows} rows must be a multiple of "
                f"run.micro_batch_size={run.micro_batch_size} (a micro-batch holds one "
                "tenant's rows)",
                "change prompts_per_step, n_samples or run.micro_batch_size",
            )  # fmt: skip
        if not tenant.reward or tenant.reward == "none":
            raise fail(f"{where}.reward", tenant.reward, "RL needs a reward", 'e.g. "math"')
        if tenant.join_step > run.steps:
            raise fail(
                f"{where}.join_step", tenant.join_step,
                f"is after the last step (run.steps={run.steps})", "join earlier",
            )  # fmt: skip
        if tenant.leave_step and tenant.leave_step < tenant.join_step:
            raise fail(
                f"{where}.leave_step", tenant.leave_step,
                f"is before join_step={tenant.join_step}", "leave after joining (0: never)",
            )  # fmt: skip
    if not config.active(1) and not any(t.join_step > 1 for t in config.tenants):
        raise fail("tenants", names, "no tenant trains", "set join_step / leave_step")
    if rollout.temperature <= 0:
        raise fail(
            "rollout.temperature", rollout.temperature,
            "must be > 0: a policy gradient needs samples of the policy (greedy is one answer)",
            "use e.g. temperature = 1.0",
        )  # fmt: skip
    if rollout.top_k == 0:
        raise fail("rollout.top_k", 0, "0 keeps no token", "use -1 (off) or k >= 1")
    if rollout.engines == "urls" and not rollout.engine_urls:
        raise fail(
            "rollout.engine_urls", [], 'engines = "urls" needs the servers',
            'list them, e.g. ["http://127.0.0.1:30000"]',
        )  # fmt: skip
    if rollout.engines != "urls" and rollout.engine_urls:
        raise fail(
            "rollout.engine_urls", list(rollout.engine_urls),
            f'applies to engines = "urls", not {rollout.engines!r}', "remove it, or use urls",
        )  # fmt: skip
    for url in rollout.engine_urls:
        register_engine_url(url, "rollout.engine_urls", fail)
        if not url.startswith(("http://", "https://")):
            raise fail("rollout.engine_urls", url, "is not an http(s) URL", "fix it")
    _check_advantage_form(config.algo.advantage, fail)
    check_model(config.model, source)
    check_eval(config.eval, run, names, source, kinds=RL_EVALUATOR_KINDS)
    defaults = {f.name: f.default for f in dataclasses.fields(EvaluatorConfig)}
    for i, ev in enumerate(config.evaluators):
        for name, instead in RL_EVAL_ENGINE_FIELDS.items():
            value = getattr(ev, name)
            if ev.kind == "generate" and value != defaults[name]:
                raise fail(
                    f"eval.evaluators[{i}].{name}",
                    list(value) if isinstance(value, tuple) else value,
                    "RL evaluates adapter snapshots on the run's own engines",
                    f"remove {name} ({instead})",
                )  # fmt: skip
