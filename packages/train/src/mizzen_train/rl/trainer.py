"""The RL trainer: K LoRA tenants on one base model, rollout -> reward -> policy step -> adapter sync.

:func:`run_rl` runs one configuration (:mod:`mizzen_train.rl.config`) in this process.  It is a
:class:`~mizzen_train.run.trainer.Trainer` (run directory, base model import, the executor,
metrics, checkpoints, the eval dispatcher) with an RL loop:

1. start the engines (embedded servers on the base model, SGLang servers by URL, or the Ray
   rollout manager's engines); give every tenant active at step 1 a slot and publish its adapter
   (version 0, the base model: B = 0);
2. per step ``t`` and active tenant: draw ``prompts_per_step`` prompts from the tenant's resumable
   cursor, generate ``n_samples`` per prompt through the router with the tenant's published
   adapter, score them with the tenant's reward, and compute group advantages (GRPO by default);
3. one batch of every tenant's samples (a row per sample, slot-contiguous, each sample its own
   segment: :mod:`mizzen_train.rl.rows`, so the executor's packed THD attention sees it as one
   sequence, positions from 0, padding never computed): old log-probs from
   the executor's ``forward_logprobs`` (or the engine's, within ``max_logprob_mismatch``), the
   adapter-free base model's log-probs for the KL term, one ``forward_backward`` with the
   clipped policy-gradient loss and one ``optim_step`` for every tenant;
4. a tenant whose step was skipped for non-finite gradients (the executor's rule) keeps its
   adapter: nothing is re-published; every other tenant's new adapter is exported
   (:func:`~mizzen_train.hf.peft.export_peft_adapter`) and loaded into every engine as
   ``<tenant>@v<version>`` before that tenant's next rollout (``version`` = the slot's optimizer
   step count); every sample carries the version that generated it;
5. tenants join (slot loaded, version 0 published) before the first step they train and leave
   (slot and adapters unloaded) after their last;
6. checkpoints (the run framework's format: slots of the active tenants, cursors, RNG, and the adapter versions)
   every ``checkpoint_interval`` steps; at eval points the dispatcher exports each active
   tenant's adapter snapshot and evaluates it on the run's engines, on the side.

``rollout.off_policy = true`` overlaps the rollout of step ``t+1`` with the training of step
``t``: its samples come from the adapter one version behind (their ``adapter_version`` says so).
The default is synchronous.

Invariants:
- Tenants never touch each other: a row holds one tenant's sample, the executor keeps slots
  apart, and a skipped tenant changes nothing of the others.
- Request ids and sampling seeds are functions of (run seed, step, tenant, prompt, sample)
  only, so a resumed run (or the same run again) draws exactly the same samples.
- A resumed run continues from the checkpoint's step with the checkpoint's slots, cursors and
  adapter versions, re-publishes exactly those adapters, and logs every step once.
- One rank, or torchrun's ranks split by ``[parallel]`` (:mod:`mizzen_train.run.parallel`):
  the writer (rank 0) alone runs the engines (embedded, URLs or Ray), draws the prompts,
  rolls out, scores and builds the step's rows, which it broadcasts to every rank
  (:meth:`RlTrainer._shared_rows`; a failed rollout fails every rank, agreed); every rank then
  trains its data-parallel share of them (:meth:`~mizzen_train.batch.SlotBatch.rows_for`, as
  SFT), so the losses are those of one rank on the same batch and a resume at the same world
  size continues bit for bit.  Every rank exports each published adapter (the export's
  collectives); the writer alone writes it, loads it into the engines, logs and evaluates.
  Each writer-only part of a publish (a stale directory removed, the files written, the engines'
  load or unload) is agreed by every rank before the next collective: a failure on one rank
  (a cancellation too) fails them all (:meth:`RlTrainer._agreed`), none is left waiting in a
  collective.
  Every step's rows must split over the data-parallel ranks into whole micro-batches, checked
  before the model is built (:meth:`RlTrainer.step_rows`).
- Fault drill: ``MIZZEN_RL_INJECT_NAN="<tenant>@<step>[,...]"`` makes that tenant's advantages
  NaN at that step (its gradients become non-finite), to show the skip rule end to end.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch

from mizzen_train.rl.config import RlConfig, RlTenantConfig
from mizzen_train.run.config import ConfigError
from mizzen_train.run.layout import ADAPTERS_DIR
from mizzen_train.run.sections import EvaluatorConfig
from mizzen_train.run.state import LoadedCheckpoint, RunStateError
from mizzen_train.run.trainer import Trainer, generation_evaluator, run_trainer

__all__ = ["RlTrainer", "run_rl"]

INJECT_NAN_ENV = "MIZZEN_RL_INJECT_NAN"


def _inject_nan_plan() -> set[tuple[str, int]]:
    plan = set()
    for item in filter(None, os.environ.get(INJECT_NAN_ENV, "").split(",")):
        tenant, _, step = item.strip().rpartition("@")
        if not tenant or not step.isdigit():
            raise ConfigError(
                INJECT_NAN_ENV, item, "is not <tenant>@<step>", "write e.g. B@12", source="env"
            )
        plan.add((tenant, int(step)))
    return plan


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


class RlTrainer(Trainer):
    """RL's step: rollout through the engines with each tenant's published adapter, reward,
    group advantages, one clipped policy-gradient step, adapter re-published."""

    command = "rl"
    SNAPSHOT_MARKER = "adapter_config.json"
    config: RlConfig

    def __init__(self, config: RlConfig, *, resume: bool, stream: TextIO | None) -> None:
        super().__init__(config, resume=resume, stream=stream)
        self.nan_plan = _inject_nan_plan()
        self.launched: list[Any] = []  # engines spawned before set-up (launch_engines)

    # -- validation and set-up --------------------------------------------------------------

    def validate_inputs(self, model_spec) -> None:
        from mizzen_rollout.api import DataError, PromptDataset, load_reward
        from mizzen_train.rl.config import load_advantage

        config = self.config
        self.max_positions = model_spec.max_sequence_length
        self.prompts, self.rewards, self.estimator = {}, {}, None
        for i, tenant in enumerate(config.tenants):
            try:
                self.prompts[tenant.name] = PromptDataset.from_jsonl(_data_path(tenant.data))
            except DataError as exc:
                raise ConfigError(
                    f"tenants[{i}].data", tenant.data, str(exc), "give a prompt data set",
                    source=config.source,
                ) from None  # fmt: skip
        if self.trains:  # an export reads a stored run.json: it imports no code the file names
            self.rewards = {t.name: load_reward(t.reward) for t in config.tenants}
            self.estimator = load_advantage(config)
        # one row width for the whole run (the longest prompt and response any tenant can
        # have), so a tenant's rows are the same tensors whatever the other tenants generate
        self.row_width = 0
        for i, tenant in enumerate(config.tenants):
            longest = max(self._prompt_tokens(r.input) for r in self.prompts[tenant.name])
            new = tenant.max_new_tokens or config.rollout.max_new_tokens
            self.row_width = max(self.row_width, longest + new)
            if longest + new > self.max_positions:
                raise ConfigError(
                    f"tenants[{i}].max_new_tokens", new,
                    f"a prompt of {longest} tokens plus {new} new tokens exceeds the model's "
                    f"{self.max_positions} positions", "lower it or shorten the prompts",
                    source=config.source,
                )  # fmt: skip
        self.width = self._row_width(self.row_width - 1)

    def _row_width(self, positions: int) -> int:
        """The rows' width: ``positions`` (a sample's longest input), cut whole into context
        parallel's chunks (the padding is segment -1: never computed)."""
        from mizzen_train.rl.rows import padded_width

        context = self.world.plan.context
        width = padded_width(positions, context)
        if width > self.max_positions:
            raise ConfigError(
                "parallel.context", context,
                f"rows of {positions} positions padded to {width} (a multiple of 2 * context) "
                f"exceed the model's {self.max_positions} positions",
                "lower max_new_tokens or parallel.context", source=self.config.source,
            )  # fmt: skip
        return width

    def _prompt_tokens(self, prompt) -> int:
        """Tokens of a prompt as the engine sees it (an upper bound: one spare for BOS)."""
        hf = self.tokenizer.hf
        if isinstance(prompt, str):
            return len(hf(prompt, add_special_tokens=True)["input_ids"]) + 1
        return len(self.tokenizer.render(prompt, generation_prompt=True)) + 1

    def build_data_evaluator(self, ev: EvaluatorConfig, index: int):
        from mizzen_rollout.api import DataError, PromptDataset

        try:
            dataset = PromptDataset.from_jsonl(_data_path(ev.data))
        except DataError as exc:
            raise ConfigError(
                f"eval.evaluators[{index}].data", ev.data, str(exc), "give a prompt data set",
                source=self.config.source,
            ) from None  # fmt: skip
        records = dataset.records[: ev.limit] if ev.limit else dataset.records
        return generation_evaluator(ev, list(records))  # served by the run's engines

    def prepare_data(self) -> None:
        from mizzen_rollout.api import DataCursor

        self.cursors = {
            t.name: DataCursor(self.prompts[t.name], seed=t.data_seed, shuffle=True)
            for t in self.config.tenants
        }
        self.cursor_before: dict[int, dict[str, Any]] = {}
        self.versions: dict[str, int] = {}
        self.published: dict[str, Any] = {}  # tenant -> AdapterRef serving its next rollout
        self.loaded_refs: dict[str, list[Any]] = {t.name: [] for t in self.config.tenants}

    def init_slots(self) -> None:
        """None: a tenant's slot is loaded when it joins (:meth:`_join`)."""

    def restore(self, checkpoint: LoadedCheckpoint) -> None:
        versions = checkpoint.extra.get("adapter_versions")
        if not isinstance(versions, dict):
            raise RunStateError(f"{checkpoint.path}: holds no adapter versions (not an RL run?)")
        for name in versions:
            if name not in self.tenant_of:
                raise RunStateError(f"{checkpoint.path}: holds tenant {name!r}, not in the config")
            self.restore_slot(name, checkpoint)
            step = self.executor.inspect_slot(self.slot_of[name])["step"]
            if step != versions[name]:
                raise RunStateError(
                    f"{checkpoint.path}: slot {name} is at optimizer step {step} but the "
                    f"checkpoint records adapter version {versions[name]}"
                )
            self.versions[name] = int(step)
        for name, state in checkpoint.streams.items():
            if name in self.cursors:
                self.cursors[name].load_state_dict(state)

    def start_fields(self) -> tuple[dict[str, Any], dict[str, Any]]:
        rollout = self.config.rollout
        return (
            {"engines": rollout.engines, "off_policy": rollout.off_policy},
            {"adapter_versions": dict(self.versions)},
        )

    def engines_text(self) -> str:
        return f"engines: {self.config.rollout.engines}"

    # -- eval -------------------------------------------------------------------------------

    def export_snapshot(self, step: int, tenant: str, directory: Path) -> None:
        """The tenant's adapter as it is now, as a PEFT directory (eval snapshots and the
        adapters the engines load)."""
        from mizzen_train.hf import export_peft_adapter

        del step  # the slot's state is the step's

        export_peft_adapter(
            directory,
            executor=self.executor,
            slot=self.slot_of[tenant],
            source=self.source,
            base_model_name_or_path=str(self.model_dir),
        )

    def step_rows(self) -> tuple[int, int]:
        """``(rows, width)`` of a step's batch, once every step's rows (tenants join and leave)
        are checked to split over the data-parallel ranks into whole micro-batches."""
        config, plan = self.config, self.world.plan
        unit = plan.data * config.run.micro_batch_size
        largest = 0
        for step in _membership_steps(config):
            active = config.active(step)
            rows = sum(t.prompts_per_step * t.n_samples for t in active)
            largest = max(largest, rows)
            if rows % unit:
                blamed = _blamed(active, unit)
                raise ConfigError(
                    f"tenants[{config.tenants.index(blamed)}].prompts_per_step",
                    blamed.prompts_per_step,
                    f"step {step} trains {rows} rows (prompts_per_step x n_samples of "
                    f"{', '.join(t.name for t in active)}), which must be a multiple of the "
                    f"data-parallel size {plan.data} x run.micro_batch_size "
                    f"{config.run.micro_batch_size} = {unit} ({plan.describe()})",
                    "change prompts_per_step or n_samples, or launch another number of ranks",
                    source=config.source,
                )  # fmt: skip
        return largest, self.width

    def tenants_at(self, step: int) -> list[str]:
        return [t.name for t in self.config.active(step)]

    def run_to_end(self) -> dict[str, Any]:
        """The engines are spawned first, so they load while set-up imports megatron and the
        base model; any that training never took over are stopped however it ends."""
        self.launch_engines()
        try:
            self.setup()
            return self.train()
        finally:
            self.stop_launched_engines()

    # -- engines ----------------------------------------------------------------------------

    def launch_engines(self) -> list[Any]:
        """Spawn the run's embedded engines without waiting for them (none for other engine
        kinds): :func:`run_rl` calls it before :meth:`setup`, so the engines load while the
        trainer imports megatron and the base model; :meth:`_start_engines` waits for them.
        Whoever calls it stops them (:meth:`stop_launched_engines`) if the run ends first."""
        from mizzen_rollout.api import launch_embedded

        rollout = self.config.rollout
        if rollout.engines != "embedded" or not self.world.is_writer:
            return []
        try:
            for _ in range(rollout.num_engines):
                self.launched.append(
                    launch_embedded(
                        model_path=str(self.model_dir),
                        num_threads=rollout.engine_threads,
                        deadline_s=rollout.startup_timeout_s,
                        device=self._engine_device(),
                        load_dirs=self._engine_load_dirs(),
                        wait=False,
                    )
                )
        except BaseException:
            self.stop_launched_engines()
            raise
        return self.launched

    def stop_launched_engines(self) -> None:
        """Stop engines :meth:`launch_engines` spawned that :meth:`_start_engines` never took
        over (a set-up that failed)."""
        for server in self.launched:
            server.stop()
            server.cleanup_logs()
        self.launched = []

    def _start_engines(self) -> None:
        from mizzen_rollout.api import EngineRouter, SGLangClient

        rollout = self.config.rollout
        self.servers, self.manager, self.dispatch = [], None, None
        if not self.world.is_writer:  # the engines are the writer's alone
            return
        if rollout.engines == "urls":
            urls = list(rollout.engine_urls)
        elif rollout.engines == "ray":
            from mizzen_rollout.api import EngineSpec, RolloutManager

            spec = EngineSpec(
                kind="embedded",
                model_path=str(self.model_dir),
                device=self._engine_device(),
                launch_deadline_s=rollout.startup_timeout_s,
                timeout_s=rollout.request_timeout_s,
                load_dirs=self._engine_load_dirs(),
            )
            self.manager = RolloutManager(
                [spec] * rollout.num_engines,
                address=rollout.ray_address or None,
                ray_init_kwargs={"num_cpus": max(2, rollout.num_engines + 1)}
                if not rollout.ray_address
                else {},
            )
            self.manager.start()
            urls = [self.manager.engine_info(i)["url"] for i in range(rollout.num_engines)]
            self.dispatch = self.manager
        else:
            self.servers = self.launched or self.launch_engines()
            self.launched = []
            for server in self.servers:  # one that fails: _train's clean-up stops them all
                server.wait_healthy(rollout.startup_timeout_s)
            urls = [s.url for s in self.servers]
            for server in self.servers:
                self.metrics.event(
                    "engine_started", purpose="train", pid=server.pid, url=server.url
                )
        if self.manager is None:
            self.dispatch = EngineRouter(
                [SGLangClient(u, timeout_s=rollout.request_timeout_s) for u in urls]
            )
        self.engine_urls = urls
        for evaluator in self.evaluators:
            if getattr(evaluator, "needs_engine", False) and hasattr(evaluator, "engine_urls"):
                evaluator.engine_urls = tuple(urls)
        self.progress.print(f"engines ({rollout.engines}): {', '.join(urls)}")

    def _engine_load_dirs(self) -> tuple[str, ...]:
        """Where the run's engines may load from: the base model's directory, and the run
        directory (the adapters it publishes, the snapshots it evaluates)."""
        return (str(self.model_dir.resolve().parent), str(self.run_dir.resolve()))

    def _engine_device(self) -> str:
        chosen = self.config.rollout.engine_device
        return self.device if chosen == "auto" else chosen

    def _stop_engines(self) -> None:
        """Stop every engine of the run; one that fails to stop does not keep the rest running
        (the first error is raised once all were tried)."""
        failed: BaseException | None = None
        for server in getattr(self, "servers", []):
            try:
                server.stop()
                server.cleanup_logs()
                self.metrics.event("engine_stopped", purpose="train", pid=server.pid)
            except Exception as exc:  # the next engines must stop too
                failed = failed or exc
        if getattr(self, "manager", None) is not None:
            self.manager.shutdown()
        if failed is not None:
            raise failed

    # -- adapters ---------------------------------------------------------------------------

    def _adapter_dir(self, tenant: str, version: int) -> Path:
        return self.run_dir / ADAPTERS_DIR / tenant / version_dir_name(version)

    async def _publish(self, tenant: str) -> None:
        """Export the tenant's current adapter (its slot's version) and load it everywhere.
        Every rank exports (the export's collectives) and records it as published; the writer
        alone writes it and loads it into the engines.  Each writer-only part's outcome is
        agreed before the next collective (:meth:`_agreed`)."""
        from mizzen_rollout.api import AdapterRef

        version = self.versions[tenant]
        directory = self._adapter_dir(tenant, version)

        def remove_stale() -> None:  # left by a killed run: replaced
            if directory.exists() and self.world.is_writer:
                shutil.rmtree(directory)

        self._agreed(remove_stale)  # before the export's collectives: all ranks or none
        self._agreed(lambda: self.export_snapshot(version, tenant, directory))
        ref = AdapterRef(tenant, version, str(directory))
        self.published[tenant] = ref
        await self._on_writer_engines(lambda: self._load_published(tenant, ref))

    def _agreed(self, action: Callable[[], object]) -> None:
        """Run ``action`` on this rank (its part of a step: writer-only work, or collectives
        every rank enters), then agree on every rank's outcome: if it failed anywhere, every rank
        fails (the failing one with its error, the others with
        :class:`~mizzen_train.run.parallel.RankFailed`), so no rank goes on to a collective a
        failed rank never reaches (it died with a peer's "connection closed" otherwise)."""
        failure: BaseException | None = None
        try:
            action()
        except (Exception, asyncio.CancelledError) as exc:  # raised below, agreed by the others
            failure = exc
        self._agree(failure)

    async def _on_writer_engines(self, action: Callable[[], Awaitable[None]]) -> None:
        """:meth:`_agreed` for a change to the writer's engines (``action``, awaited on the
        writer alone)."""
        failure: BaseException | None = None
        if self.world.is_writer:
            try:
                await action()
            except (Exception, asyncio.CancelledError) as exc:  # a cancelled load too
                failure = exc
        self._agree(failure)

    def _agree(self, failure: BaseException | None) -> None:
        def outcome() -> None:
            if failure is not None:
                raise failure

        self.world.agreed(outcome)

    async def _load_published(self, tenant: str, ref) -> None:
        """The writer's engines serve ``ref`` (and the version before it, no older)."""
        await self.dispatch.load_lora_adapter(ref.name, ref.path)
        loaded = self.loaded_refs[tenant]
        # keep the one an in-flight (off-policy) rollout may still use, and the new one
        for old in loaded[:-1]:
            await self.dispatch.unload_lora_adapter(old.name)
        self.loaded_refs[tenant] = [*loaded[-1:], ref]
        self._trim_adapter_dirs(tenant)

    def _trim_adapter_dirs(self, tenant: str) -> None:
        keep = self.config.rollout.keep_adapters
        root = self.run_dir / ADAPTERS_DIR / tenant
        if not keep or not root.is_dir():
            return
        loaded = {Path(ref.path).name for ref in self.loaded_refs[tenant]}
        versions = sorted(p.name for p in root.iterdir() if p.name.startswith("v"))
        for name in versions[:-keep]:
            if name not in loaded:
                shutil.rmtree(root / name, ignore_errors=True)

    async def _join(self, tenant: RlTenantConfig) -> None:
        slot = self.slot_of[tenant.name]
        if slot not in self.executor.loaded_slots:
            self.executor.load_slot(
                slot,
                tenant.lora_rank,
                tenant.lora_alpha,
                init=tenant.lora_init,
                seed=tenant.lora_seed,
            )
            self.versions[tenant.name] = 0
        await self._publish(tenant.name)
        self.metrics.event("tenant_joined", tenant=tenant.name, version=self.versions[tenant.name])
        self.progress.print(f"tenant {tenant.name} serves adapter v{self.versions[tenant.name]}")

    async def _leave(self, name: str, step: int) -> None:
        async def unload() -> None:
            for ref in self.loaded_refs[name]:
                await self.dispatch.unload_lora_adapter(ref.name)

        await self._on_writer_engines(unload)
        self.loaded_refs[name] = []
        self.published.pop(name, None)
        self.executor.unload_slot(self.slot_of[name])
        version = self.versions.pop(name)
        self.metrics.event("tenant_left", tenant=name, step=step, version=version)
        self.progress.print(f"tenant {name} left after step {step} (adapter v{version})")

    async def _joins(self, step: int) -> None:
        """Before ``step``'s rollout: the tenants that start training at ``step`` join."""
        for tenant in self.config.active(step):
            if tenant.name not in self.published:
                await self._join(tenant)

    async def _leaves(self, step: int) -> None:
        """After the step before ``step`` trained: tenants that do not train at ``step`` leave."""
        active = {t.name for t in self.config.active(step)}
        for name in [n for n in self.published if n not in active]:
            await self._leave(name, step - 1)

    # -- rollout ----------------------------------------------------------------------------

    async def _rollout(self, step: int) -> dict[str, Any]:
        """The writer's rollout of ``step`` (the other ranks: nothing; they receive its rows)."""
        from mizzen_rollout.api import RolloutConfig, SamplingParams, run_rollout

        if not self.world.is_writer:
            return {"step": step}
        config = self.config
        rollout = config.rollout
        tenants = config.active(step)
        self.cursor_before[step] = {t.name: self.cursors[t.name].state_dict() for t in tenants}
        started = time.perf_counter()

        async def one(tenant: RlTenantConfig):
            prompts = self.cursors[tenant.name].next_batch(tenant.prompts_per_step)
            rollout_config = RolloutConfig(
                n_samples=tenant.n_samples,
                sampling=SamplingParams(
                    max_new_tokens=tenant.max_new_tokens or rollout.max_new_tokens,
                    temperature=rollout.temperature,
                    top_p=rollout.top_p,
                    top_k=rollout.top_k,
                    seed=config.run.seed,
                ),
                return_logprob=True,
                max_concurrency=rollout.max_concurrency,
                batch_size=rollout.batch_size,
            )
            t0 = time.perf_counter()
            batch = await run_rollout(
                prompts,
                self.dispatch,
                rollout_config,
                reward=self.rewards[tenant.name],
                batch_id=f"s{step}-{tenant.name}",
                adapter=self.published[tenant.name],
            )
            return tenant.name, batch, time.perf_counter() - t0

        results = await asyncio.gather(*(one(t) for t in tenants))
        return {
            "step": step,
            "batches": {name: (batch, seconds) for name, batch, seconds in results},
            "wall_s": time.perf_counter() - started,
        }

    # -- training ---------------------------------------------------------------------------

    def _rows(self, name: str, batch) -> tuple[list[dict[str, Any]], dict[str, float]]:
        from mizzen_train.rl.advantages import group_advantages

        rows, rewards, lengths, failed = [], [], [], 0
        for group in batch.groups + batch.dropped:
            usable = [
                s.reward if s.reward is not None and s.response_tokens else None
                for s in group.samples
            ]
            advantages = group_advantages(usable, self.estimator)
            for sample, advantage, reward in zip(group.samples, advantages, usable, strict=True):
                if reward is None:
                    failed += 1
                else:
                    rewards.append(reward)
                    lengths.append(len(sample.response_tokens))
                rows.append(
                    {"sample": sample, "advantage": advantage, "usable": reward is not None}
                )
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else 0.0
        stats = {
            "reward_mean": mean,
            "reward_std": std,
            "response_length": sum(lengths) / len(lengths) if lengths else 0.0,
            "samples": float(len(rows)),
            "failed_samples": float(failed),
        }
        return rows, stats

    def _step_rows(self, step: int, rollout: dict[str, Any]):
        """The writer's part of a step: the rollout's samples as training rows
        (:func:`~mizzen_train.rl.rows.tokenise_rows`) with each tenant's rollout statistics."""
        from mizzen_train.rl.rows import tokenise_rows

        per_tenant: dict[str, dict[str, Any]] = {}
        all_rows: list[tuple[str, dict[str, Any]]] = []
        for name, (batch, rollout_s) in rollout["batches"].items():
            rows, stats = self._rows(name, batch)
            stats["rollout_s"] = rollout_s
            stats["samples_per_s"] = len(rows) / rollout_s if rollout_s > 0 else 0.0
            versions = {r["sample"].adapter_version for r in rows}
            stats["adapter_version"] = min(v for v in versions if v is not None)
            per_tenant[name] = stats
            all_rows += [(name, row) for row in rows]
        return tokenise_rows(
            all_rows, slot_of=self.slot_of, width=self.width,
            pad_id=self.tokenizer.pad_token_id, stats=per_tenant,
            nan_tenants={name for name in per_tenant if (name, step) in self.nan_plan},
        )  # fmt: skip

    def _shared_rows(self, step: int, rollout: dict[str, Any] | BaseException):
        """The step's rows on every rank: built once, by the writer (its rollout; a rollout
        that failed fails every rank, agreed), and broadcast to the others."""
        world = self.world

        def build():
            if not world.is_writer:
                return None
            if isinstance(rollout, BaseException):
                raise rollout
            return self._step_rows(step, rollout)

        return world.share(world.agreed(build))

    def _train_step(self, step: int, rollout: dict[str, Any] | BaseException) -> dict[str, Any]:
        """One policy step of every tenant of ``rollout`` (runs in a worker thread, on every
        rank: each trains its data-parallel share of the writer's rows)."""
        from mizzen_train.losses import ClippedPolicyGradientLoss

        config = self.config
        t0 = time.perf_counter()
        self.world.bind_thread()  # a worker thread: this rank's GPU, not GPU 0
        shared = self._shared_rows(step, rollout)
        batch, per_tenant = shared.batch, shared.stats
        trainer_logprobs = self.executor.forward_logprobs(batch)
        ref_logprobs = self.executor.forward_logprobs(
            replace(batch, slot_ids=torch.full_like(batch.slot_ids, -1))
        )
        old = trainer_logprobs
        rollout_cfg = config.rollout
        for name, stats in per_tenant.items():
            rows_of = shared.rows_of(name).unsqueeze(1)
            counted = batch.loss_mask & shared.engine_known & rows_of
            if bool(counted.any()):
                mismatch = (shared.engine_logprobs - trainer_logprobs).abs()[counted].mean().item()
            else:
                mismatch = float("nan")
            stats["logprob_mismatch"] = mismatch
            use_engine = (
                rollout_cfg.old_logprobs == "engine"
                and math.isfinite(mismatch)
                and mismatch <= rollout_cfg.max_logprob_mismatch
            )
            stats["old_logprobs"] = "engine" if use_engine else "trainer"
            if use_engine:
                old = torch.where(rows_of & shared.engine_known, shared.engine_logprobs, old)
        batch = replace(batch, old_logprobs=old, ref_logprobs=ref_logprobs)
        loss = ClippedPolicyGradientLoss(
            clip_low=config.algo.clip_low,
            clip_high=config.algo.clip_high,
            kl_coef=config.algo.kl_coef,
        )
        reports = self.executor.forward_backward(batch, loss)
        lrs, step_reports = self.optimizer_step(per_tenant, step)
        step_s = time.perf_counter() - t0
        real = shared.real_tokens()
        for name, stats in per_tenant.items():
            slot = self.slot_of[name]
            report, step_report = reports[slot], step_reports[slot]
            stats.update(
                packing_efficiency=report.packing_efficiency,
                loss=report.loss,
                kl=report.metrics.get("kl", 0.0),
                clip_fraction=report.metrics.get("clip_fraction", 0.0),
                importance_ratio=report.metrics.get("importance_ratio", 1.0),
                lr=lrs[name],
                grad_norm=step_report.grad_norm,
                stepped=step_report.stepped,
                version_after=step_report.step,
                tokens=int(real[shared.rows_of(name)].sum()),
                loss_tokens=report.num_tokens,
            )
        return {"tenants": per_tenant, "step_s": step_s, "tokens": int(real.sum())}

    # -- loop -------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        return asyncio.run(self._train())

    async def _train(self) -> dict[str, Any]:
        config = self.config
        steps = config.run.steps
        try:
            self._start_engines()  # inside: engines it started stop however it fails
            self.recover_points()
            started = time.perf_counter()
            self.totals = totals = {"samples": 0, "tokens": 0, "rollout_s": 0.0, "train_s": 0.0}
            first = self.start_step + 1
            for name in list(self.versions):  # resumed: the checkpoint's adapters, as they were
                await self._publish(name)
            if first <= steps:
                await self._leaves(first)
                await self._joins(first)
                pending = asyncio.ensure_future(self._rollout(first))
            for step in range(first, steps + 1):
                rollout = await _outcome(pending)  # a failure fails every rank, agreed
                overlap = config.rollout.off_policy and step < steps
                if overlap:  # the next rollout runs on the adapters published so far
                    await self._joins(step + 1)
                    pending = asyncio.ensure_future(self._rollout(step + 1))
                result = await asyncio.to_thread(self._train_step, step, rollout)
                totals["rollout_s"] += rollout.get("wall_s", 0.0)  # the writer's
                totals["train_s"] += result["step_s"]
                totals["tokens"] += result["tokens"]
                for name, stats in result["tenants"].items():
                    totals["samples"] += int(stats["samples"])
                    if stats["stepped"]:
                        self.versions[name] = stats["version_after"]
                        await self._publish(name)
                    else:
                        self.progress.print(
                            f"step {step} {name}: non-finite gradients (grad_norm "
                            f"{stats['grad_norm']}); skipped, adapter v{self.versions[name]} "
                            "stays published"
                        )
                    self._log_train(step, name, stats, result)
                if step % config.run.log_interval == 0 or step == steps:
                    rewards = {n: s["reward_mean"] for n, s in result["tenants"].items()}
                    rate = result["tokens"] / result["step_s"] if result["step_s"] else 0.0
                    self.progress.step(step, rewards, rate, result["step_s"], label="reward")
                self.end_step(step)
                if step < steps:
                    await self._leaves(step + 1)
                if not overlap and step < steps:
                    await self._joins(step + 1)
                    pending = asyncio.ensure_future(self._rollout(step + 1))
            wall = time.perf_counter() - started
            self.export_final()  # every rank (collective) before the writer waits
            self.drain_evaluations()
        finally:
            try:
                await self._close_dispatch()
            finally:  # however closing the clients ends, the engines stop
                self._stop_engines()
        return self.finish(wall)

    async def _close_dispatch(self) -> None:
        close = getattr(getattr(self, "dispatch", None), "aclose", None)
        if close is not None:
            await close()

    def _log_train(self, step: int, name: str, stats: dict[str, Any], result: dict) -> None:
        self.metrics.write(
            "train",
            step=step,
            tenant=name,
            loss=stats["loss"],
            lr=stats["lr"],
            grad_norm=stats["grad_norm"],
            stepped=stats["stepped"],
            tokens=stats["tokens"],
            loss_tokens=stats["loss_tokens"],
            packing_efficiency=stats["packing_efficiency"],
            tokens_per_s=result["tokens"] / result["step_s"] if result["step_s"] else 0.0,
            step_s=result["step_s"],
            reward_mean=stats["reward_mean"],
            reward_std=stats["reward_std"],
            response_length=stats["response_length"],
            kl=stats["kl"],
            clip_fraction=stats["clip_fraction"],
            importance_ratio=stats["importance_ratio"],
            adapter_version=stats["adapter_version"],
            published_version=self.versions.get(name),
            samples=stats["samples"],
            failed_samples=stats["failed_samples"],
            samples_per_s=stats["samples_per_s"],
            rollout_s=stats["rollout_s"],
            logprob_mismatch=stats["logprob_mismatch"],
            old_logprobs=stats["old_logprobs"],
        )

    def checkpoint_state(self, step: int) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        active = sorted(self.versions)
        # the cursors as they were before the next step's prompts were drawn (off-policy runs
        # draw them before this step trained)
        streams = {name: cursor.state_dict() for name, cursor in self.cursors.items()}
        streams.update(self.cursor_before.get(step + 1, {}))
        extra = {"adapter_versions": {name: self.versions[name] for name in active}}
        return active, streams, extra

    def checkpoint(self, step: int) -> Path:
        path = super().checkpoint(step)
        for old in [s for s in self.cursor_before if s <= step]:
            del self.cursor_before[old]
        return path

    def checkpoint_fields(self) -> dict[str, Any]:
        return {"versions": dict(self.versions)}

    # -- the end ----------------------------------------------------------------------------

    def summary_fields(self, records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
        totals = self.totals
        return {
            "final_reward": _last_rewards(records),
            "adapter_versions": dict(self.versions),
            "wall_s": round(wall, 3),
            "samples_per_s": totals["samples"] / totals["rollout_s"]
            if totals["rollout_s"]
            else 0.0,
            "train_tokens_per_s": (
                totals["tokens"] / totals["train_s"] if totals["train_s"] else 0.0
            ),
        }

    def output_lines(self, records: list[dict[str, Any]]) -> list[str]:
        return [f"adapters:    {self.run_dir / ADAPTERS_DIR}"]

    def final_lines(self, records: list[dict[str, Any]]) -> list[str]:
        return [f"final reward {t}: {r:.4f}" for t, r in _last_rewards(records).items()]


def _membership_steps(config: RlConfig) -> list[int]:
    """The steps at which the set of training tenants may change (the first, every join, the
    step after every leave), within the run: every step trains the set of one of them."""
    steps = {1} | {t.join_step for t in config.tenants}
    steps |= {t.leave_step + 1 for t in config.tenants if t.leave_step}
    return sorted(s for s in steps if s <= config.run.steps)


def _blamed(active: list[RlTenantConfig], unit: int) -> RlTenantConfig:
    """The tenant to name for a step whose rows do not split into ``unit``s: the first whose own
    rows do not (else the first)."""
    odd = [t for t in active if (t.prompts_per_step * t.n_samples) % unit]
    return (odd or active)[0]


async def _outcome(pending: asyncio.Future) -> Any:
    """What ``pending`` returned, or the exception it raised (as a value: the step agrees on it),
    a cancellation of ``pending`` alone included; a cancellation of the awaiting task propagates."""
    try:
        return await pending
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        return exc
    except Exception as exc:
        return exc


def _last_rewards(records: list[dict[str, Any]]) -> dict[str, float]:
    """Each tenant's ``reward_mean`` of its last training record."""
    return {r["tenant"]: r["reward_mean"] for r in records
            if r["kind"] == "train" and "reward_mean" in r}  # fmt: skip


def _data_path(spec: str) -> str:
    """``example:NAME`` of mizzen-train's shipped data sets, else the spec itself."""
    if spec.startswith("example:"):
        from mizzen_train.data import example_paths

        shipped = example_paths()
        name = spec[len("example:") :]
        if name in shipped:
            return str(shipped[name])
    return spec


def run_rl(config: RlConfig, *, resume: bool = False, stream: TextIO | None = None) -> dict:
    """Run (or ``resume``) the RL job ``config`` in this process; returns the summary record."""
    return run_trainer(RlTrainer, config, resume=resume, stream=stream)
