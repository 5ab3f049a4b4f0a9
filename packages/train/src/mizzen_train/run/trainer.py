"""The trainer every run command specialises: K LoRA tenants in the slots of one base model,
with a run directory, checkpoints, resume, metrics and evaluation points on the side.

:class:`Trainer` owns what a run is, whatever it trains by:

1. :meth:`Trainer.validate` -- everything that can be wrong (run directory, base model,
   tokenizer, the command's inputs through :meth:`Trainer.validate_inputs`, evaluators) before
   megatron starts;
2. :meth:`Trainer.setup` -- the base model imported into megatron-core, the run directory opened
   (a fresh run id, or the resumed run's), the slot executor, the newest complete checkpoint
   restored (or fresh slots and seeded RNGs), ``metrics.jsonl`` opened, the eval dispatcher
   started;
3. per step, the command's own work (SFT: one packed batch; RL: rollout, reward, policy step),
   then :meth:`Trainer.optimizer_step` and :meth:`Trainer.end_step`: the checkpoint every
   ``checkpoint_interval`` steps (and at the last), the eval point at every point of
   :meth:`~mizzen_train.run.sections.RunLayout.eval_points`;
4. :meth:`Trainer.finish` -- evaluations drained, the final export (a PEFT adapter per tenant,
   :mod:`mizzen_train.run.export`), the ``summary`` record, ``curves.png``, and where everything
   is.

A subclass sets :attr:`Trainer.command` and :attr:`Trainer.SNAPSHOT_MARKER` and implements the
hooks marked "hook" below; it never re-implements a step of the run's life cycle.

Invariants:
- A step is 1-based and ends with :meth:`end_step`; a checkpoint holds exactly the state after
  its step (slots, data positions, RNGs and the command's extra state).
- A resumed run continues from the checkpoint's step with the checkpoint's slots, data position
  and RNG states, keeps its run id, evaluates only the points it has no results for (first the
  unsettled points whose snapshots survived), and rewrites nothing it already logged except the
  training records after the checkpoint, which it produces again.  It (and ``mizzen-train
  export``) refuses a base model whose files are not those ``run.json`` fingerprinted, and a
  slot checkpoint whose manifest names another run or step than the checkpoint holding it (each
  slot's manifest records its owner: the run id and the checkpoint's step).
- The process is one rank of the run's world (:mod:`mizzen_train.run.parallel`: one rank, or
  torchrun's ranks split by ``[parallel]``).  Every rank builds the model, restores the slots and
  holds the same global batch (SFT draws it from the same streams on every rank; RL's writer
  rolls it out and broadcasts its rows), each data-parallel rank training its rows of it; the
  writer rank (rank 0) alone holds the run directory for the whole command
  (:func:`~mizzen_train.run.lock.hold_run_dir`), opens the run, writes the metrics, progress
  lines, checkpoint metadata and exports, and runs the evaluations.  Under tensor parallelism
  the other ranks follow the writer's snapshot exports (:meth:`RankWorld.lead`), whose
  collectives they share.
- However the command ends -- finished, failed or interrupted -- :func:`run_trainer` closes the
  eval dispatcher last (:meth:`Trainer.close_evaluations`), so no engine an evaluator keeps from
  point to point outlives it (a SIGKILLed process's engines exit on their own: they watch it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TextIO

import torch

from mizzen_train.run.config import ConfigError
from mizzen_train.run.export import export_root, export_tenants
from mizzen_train.run.layout import (
    CURVES_FILE,
    METRICS_FILE,
    TINY_MODEL_PREFIX,
    linked_component,
)
from mizzen_train.run.lock import hold_run_dir
from mizzen_train.run.loggers import open_loggers
from mizzen_train.run.metrics import (
    MetricsLog,
    Progress,
    UnwrittenMetrics,
    format_duration,
    read_metrics,
    rewrite_for_resume,
    settled_eval_keys,
)
from mizzen_train.run.parallel import RankWorld, check_split, join_world, one_rank, plan_world
from mizzen_train.run.process import resolve_device
from mizzen_train.run.schedule import adam_params, lr_at
from mizzen_train.run.sections import EvaluatorConfig, RunLayout
from mizzen_train.run.state import (
    RESHARD_DIR,
    SLOTS_DIR,
    LoadedCheckpoint,
    RunStateError,
    base_model_record,
    check_base_model,
    check_run_dir,
    checkpoint_step,
    checkpoints_dir,
    complete_checkpoints,
    load_checkpoint,
    open_run,
    remove_partial_checkpoints,
    save_checkpoint,
    set_rng_state,
)

__all__ = [
    "Trainer",
    "base_model_dir",
    "export_run",
    "generation_evaluator",
    "load_tokenizer",
    "run_trainer",
]


def base_model_dir(config: RunLayout) -> Path:
    """The base model's Hugging Face directory (``model.path = "tiny"``: written once per tiny
    configuration under the run directory)."""
    if config.model.path != "tiny":
        return Path(config.model.path)
    from mizzen_train.hf.tiny import write_tiny_llama
    from mizzen_train.plugin_models.base import write_tiny_base

    overrides = dict(config.model.tiny)
    plugin = config.model.plugin
    key = {**overrides, "plugin": plugin} if plugin else overrides  # Llama digests unchanged
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    target = config.run_dir / f"{TINY_MODEL_PREFIX}{digest}"  # one directory per tiny config
    if not target.exists():
        seed = int(overrides.pop("seed", 0))
        if plugin:
            write_tiny_base(target, plugin, seed=seed, overrides=overrides)
        else:
            write_tiny_llama(target, seed=seed, **overrides)
    return target


def load_tokenizer(config: RunLayout, model_dir: Path):
    """The run's tokenizer: the model directory's, the byte one, or a directory's."""
    from mizzen_train.data import SftTokenizer

    choice = config.model.tokenizer
    return SftTokenizer.load(model_dir if choice == "model" else choice)


def generation_evaluator(ev: EvaluatorConfig, prompts: list, **engines: Any):
    """The generate evaluator of ``ev`` over ``prompts``; ``engines``: where it generates
    (SFT's evaluator starts its own engines; without them it is given the run's)."""
    from mizzen_train.evaluators import GenerationEvaluator

    return GenerationEvaluator(
        name=ev.name or ev.kind,
        prompts=prompts,
        reward=ev.reward,
        max_new_tokens=ev.max_new_tokens,
        temperature=ev.temperature,
        batch_size=ev.batch_size,
        startup_timeout_s=ev.startup_timeout_s,
        request_timeout_s=ev.request_timeout_s,
        engine_lifetime=ev.engine_lifetime,
        **engines,
    )


class Trainer:
    """One run of K LoRA tenants on one base model (see the module docstring)."""

    #: The command's name in progress lines (``[mizzen-train sft] ...``).
    command: ClassVar[str]
    #: The file that marks an exported snapshot directory as complete (read on recovery).
    SNAPSHOT_MARKER: ClassVar[str]

    def __init__(self, config: RunLayout, *, resume: bool, stream: TextIO | None) -> None:
        self.config = config
        self.resume = resume
        self.trains = True  # False for mizzen-train export: it reads a checkpoint, trains nothing
        self.progress = Progress(config.run.steps, stream=stream, command=self.command)
        self.run_dir = config.run_dir
        self.eval_points = set(config.eval_points())
        self.exported: Path | None = None
        self.world = one_rank()  # until run_trainer joins the run's world
        self.dispatcher = None  # the writer's EvalDispatcher, from setup on

    def join(self, world: RankWorld) -> None:
        """This trainer is ``world``'s rank: only the writer prints."""
        self.world = world
        self.progress.quiet = not world.is_writer

    # -- hooks ----------------------------------------------------------------------------

    def validate_inputs(self, model_spec) -> None:
        """Hook: load and check the command's data (called by :meth:`validate`)."""
        raise NotImplementedError

    def build_data_evaluator(self, ev: EvaluatorConfig, index: int):
        """Hook: the evaluator of a non-``python`` ``[[eval.evaluators]]`` table."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Hook: the data streams of a fresh run (:meth:`restore` may then move them)."""
        raise NotImplementedError

    def init_slots(self) -> None:
        """Hook: the slots of a fresh run."""
        raise NotImplementedError

    def restore(self, checkpoint: LoadedCheckpoint) -> None:
        """Hook: slots, data streams and extra state from ``checkpoint``."""
        raise NotImplementedError

    def start_fields(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Hook: the command's fields of the ``run_started``/``resumed`` event: those written
        after ``engines_needed`` and those after ``tenants``."""
        return {}, {}

    def engines_text(self) -> str:
        """Hook: the engines part of the start line."""
        return f"engines needed: {self.config.engines_needed}"

    def export_snapshot(self, step: int, tenant: str, directory: Path) -> None:
        """Hook: one tenant's eval snapshot of ``step`` into ``directory``."""
        raise NotImplementedError

    def step_rows(self) -> tuple[int, int]:
        """Hook: ``(rows, seq_len)`` of one step's batch (for the parallel split's checks)."""
        raise NotImplementedError

    def tenants_at(self, step: int) -> list[str]:
        """The tenants that train (and are evaluated) at ``step``; all of them by default."""
        del step
        return [t.name for t in self.config.tenants]

    def checkpoint_state(self, step: int) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        """Hook: the tenants whose slots a checkpoint of ``step`` saves, their data stream
        states and the command's extra state."""
        raise NotImplementedError

    def summary_fields(self, records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
        """Hook: the command's fields of the ``summary`` record (after ``final_eval``)."""
        raise NotImplementedError

    def output_lines(self, records: list[dict[str, Any]]) -> Iterable[str]:
        """Hook: what the end of the run says after the curves (before the checkpoint line)."""
        return ()

    def final_lines(self, records: list[dict[str, Any]]) -> Iterable[str]:
        """Hook: what the end of the run says before the final eval lines."""
        return ()

    def run_to_end(self) -> dict[str, Any]:
        """After validation, in the rank's world: set up, then train to the end."""
        self.setup()
        return self.train()

    def train(self) -> dict[str, Any]:
        """Hook: the steps from :attr:`start_step` to the last, then :meth:`finish`."""
        raise NotImplementedError

    # -- 1. validation ----------------------------------------------------------------------

    def validate(self, device: str, dtype: str) -> None:
        """Everything that can be wrong with the configuration, its files and the run directory,
        checked before megatron starts."""
        from mizzen_train.hf import read_llama_config

        config = self.config
        self.device, self.dtype = device, dtype
        check_run_dir(self.run_dir, config.to_dict(), resume=self.resume)
        self._check_resume_steps()
        self._check_snapshot_path()
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        if config.model.plugin:
            self._check_plugin_run()  # before a tiny base is written for it
        self.model_dir = base_model_dir(config)
        if config.model.plugin:
            from mizzen_train.plugin_models.build import plugin_spec

            self.model_spec = plugin_spec(config.model.plugin, self.model_dir)
        else:
            self.model_spec = read_llama_config(self.model_dir, dtype=dtype).spec
        self._check_base_model()  # after the config's own checks: they name the missing file
        self.tokenizer = load_tokenizer(config, self.model_dir)
        self.validate_inputs(self.model_spec)
        if self.world.size > 1:
            rows, seq_len = self.step_rows()
            check_split(
                self.world.plan, self.model_spec, rows=rows, seq_len=seq_len,
                micro_batch_size=config.run.micro_batch_size, source=config.source,
                context_supported=_context_parallel_supported(),
            )  # fmt: skip
        self.evaluators = [self.build_evaluator(ev, i) for i, ev in enumerate(config.evaluators)]

    def _check_base_model(self) -> None:
        """The base model's fingerprint (recorded by a fresh run), compared with the one the run
        recorded when resuming or exporting: a different base at ``model.path`` is refused."""
        self.base_model = base_model_record(self.model_dir)
        if self.resume:
            warning = check_base_model(self.run_dir, self.base_model, self.model_dir)
            if warning is not None:
                self.progress.print(warning)

    def _check_resume_steps(self) -> None:
        """``--resume`` continues towards ``run.steps``: a run already past it has nothing to
        run, and its export would be the newer checkpoint's adapters under an older step."""
        if not (self.resume and self.trains):
            return
        found = complete_checkpoints(self.run_dir)
        newest = checkpoint_step(found[-1]) if found else None
        if newest is not None and newest > self.config.run.steps:
            raise ConfigError(
                "run.steps", self.config.run.steps,
                f"the run's newest checkpoint is step {newest} ({found[-1]}); a resumed run "
                "cannot go back", f"resume with run.steps >= {newest}, or export an earlier step "
                f"with mizzen-train export {self.run_dir} --step N",
                source=self.config.source,
            )  # fmt: skip

    def _check_snapshot_path(self) -> None:
        """``eval.snapshot_dir`` on disk: no symbolic link below the run directory (an eval point
        deletes its ``step-NNNNNNNN`` directory there; a link to ``checkpoints`` would delete
        checkpoints of the same names, see :mod:`mizzen_train.run.layout`)."""
        if self.config.eval is None:
            return
        relative = self.config.eval.snapshot_dir
        link = linked_component(self.run_dir, relative)
        if link is not None:
            raise ConfigError(
                "eval.snapshot_dir", relative,
                f"{link} is a symbolic link (to {os.readlink(link)}); eval points delete their "
                "snapshot directories, which must lie in the run directory itself",
                "remove the link, or set eval.snapshot_dir to a directory of the run's own",
                source=self.config.source,
            )  # fmt: skip

    def _check_plugin_run(self) -> None:
        """What the run asks of its plugin model (:mod:`mizzen_train.plugin_models`)."""
        from mizzen_train.plugin_models.build import plugin_run_problems

        for field, value, rule, fix in plugin_run_problems(self.config, self.command):
            raise ConfigError(field, value, rule, fix, source=self.config.source)

    def build_evaluator(self, ev: EvaluatorConfig, index: int):
        """The evaluator of ``eval.evaluators[index]``: a user's factory, or the command's."""
        from mizzen_train.eval_dispatch import load_evaluator

        if ev.kind == "python":
            evaluator = load_evaluator(ev.factory, ev.options)
            if ev.name and evaluator.name != ev.name:
                evaluator.name = ev.name
        else:
            evaluator = self.build_data_evaluator(ev, index)
        if ev.tenants:
            evaluator.tenants = list(ev.tenants)
        return evaluator

    # -- 2. set-up --------------------------------------------------------------------------

    def setup(self) -> None:
        config = self.config
        spec = self._build_model()
        world = self.world
        # everything is validated: only now does the run directory become a run
        opened = world.agreed(
            lambda: open_run(
                self.run_dir, config.to_dict(), resume=self.resume, base_model=self.base_model
            ) if world.is_writer else None
        )  # fmt: skip
        self.identity = world.share(opened)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.prepare_data()
        self.start_step = self._restore_or_init()
        records, broken = self._open_metrics()
        event = "resumed" if self.identity.resumed else "run_started"
        after_engines, after_tenants = self.start_fields()
        self.metrics.event(
            event,
            run_id=self.identity.run_id,
            from_step=self.start_step,
            steps=config.run.steps,
            engines_needed=str(config.engines_needed),
            **after_engines,
            device=self.device,
            dtype=self.dtype,
            base_model=str(self.model_dir),
            base_parameters=spec.parameter_count(),
            trainable_parameters_per_slot=self.executor.trainable_parameters_per_slot(),
            tenants=[t.name for t in config.tenants],
            **after_tenants,
            eval_points=config.eval_points(),
            broken_metric_lines=broken,
            **({"parallel": world.plan.describe()} if world.size > 1 else {}),
        )
        self.progress.print(
            f"{event} run {self.identity.run_id} in {self.run_dir} from step {self.start_step}: "
            f"{len(config.tenants)} tenant(s) on {self.model_dir} ({spec.parameter_count():,} "
            f"parameters, {self.device}, {self.dtype}); {self.engines_text()}"
        )
        self.dispatcher = self._dispatcher(records) if self.evaluators and world.is_writer else None
        if self.dispatcher is not None:
            self._start_dispatcher()

    def _build_model(self):
        """The base model imported into megatron-core and the slot executor over it; returns
        the model's spec."""
        from mizzen_train.executor import SlotExecutor
        from mizzen_train.hf import import_hf_llama
        from mizzen_train.specs import ExecutorConfig

        config = self.config
        targets = {}
        if config.model.plugin:
            from mizzen_train.plugin_models import import_plugin_model

            imported = import_plugin_model(
                config.model.plugin, self.model_dir, device=self.device, dtype=self.dtype
            )
            targets = {"target_modules": imported.target_modules}
        else:
            imported = import_hf_llama(self.model_dir, device=self.device, dtype=self.dtype)
        self.model, self.source = imported.model, imported.source
        self.executor = SlotExecutor(
            self.model,
            ExecutorConfig(
                num_slots=len(config.tenants),
                max_rank=max(t.lora_rank for t in config.tenants),
                micro_batch_size=config.run.micro_batch_size,
                **targets,
            ),
        )
        self.slot_of = {t.name: i for i, t in enumerate(config.tenants)}
        self.tenant_of = {t.name: t for t in config.tenants}
        return imported.spec

    def _start_dispatcher(self) -> None:
        try:
            self.dispatcher.start()  # a runner that cannot start fails before step 0
        except Exception as exc:
            raise ConfigError(
                "eval.ray_address",
                self.config.eval.ray_address,
                f"the Ray runner did not start ({type(exc).__name__}: {exc})",
                'fix the address, or use eval.runner = "thread"',
                source=self.config.source,
            ) from None

    def _open_metrics(self) -> tuple[list[dict[str, Any]], int]:
        """``metrics.jsonl`` for this run: a resumed run's records up to its checkpoint (and the
        count of broken lines dropped), a fresh run's leftover removed."""
        records, broken = [], 0
        if not self.world.is_writer:
            self.metrics = UnwrittenMetrics()
            return records, broken
        if self.identity.resumed and self.metrics_path.exists():
            records, broken = rewrite_for_resume(self.metrics_path, self.start_step)
        if not self.identity.resumed and self.metrics_path.exists():
            self.metrics_path.unlink()  # a leftover of a start that never became a run
        sinks = open_loggers(self.config.run.loggers, self.run_dir,
                             name=self.identity.run_id, command=self.command)  # fmt: skip
        self.metrics = MetricsLog(self.metrics_path, sinks)
        return records, broken

    def _restore_or_init(self) -> int:
        world = self.world
        if world.is_writer:
            removed = remove_partial_checkpoints(self.run_dir)
            if removed:
                self.progress.print(f"removed partial checkpoint(s) of a killed run: {removed}")
        resumed = self.identity.resumed and world.is_writer
        found = complete_checkpoints(self.run_dir) if resumed else []
        checkpoints = world.share(found)  # the writer's view: the same checkpoint on every rank
        if not checkpoints:
            random.seed(self.config.run.seed)
            torch.manual_seed(self.config.run.seed)
            self.init_slots()
            return 0
        checkpoint = world.agreed(
            lambda: load_checkpoint(checkpoints[-1], run_id=self.identity.run_id)
        )
        self.restore(checkpoint)
        if world.is_writer:  # every rank has read its shards (restore_slot agrees on it)
            shutil.rmtree(checkpoints_dir(self.run_dir) / RESHARD_DIR, ignore_errors=True)
        set_rng_state(checkpoint.rng)
        self.progress.print(f"resuming from {checkpoint.path} (step {checkpoint.step})")
        return checkpoint.step

    def load_fresh_slot(self, name: str) -> None:
        """Tenant ``name``'s slot with a fresh adapter (its rank, alpha and initialisation)."""
        tenant = self.tenant_of[name]
        self.executor.load_slot(
            self.slot_of[name],
            tenant.lora_rank,
            tenant.lora_alpha,
            init=tenant.lora_init,
            seed=tenant.lora_seed,
        )

    def restore_slot(self, name: str, checkpoint: LoadedCheckpoint) -> None:
        """Tenant ``name``'s slot from ``checkpoint``, refused if it is not the checkpoint's own
        (another run's or step's) or its LoRA shape changed."""
        from mizzen_train.checkpoint import check_owner

        tenant, slot = self.tenant_of[name], self.slot_of[name]
        directory = checkpoint.path / SLOTS_DIR / name
        world, run_id = self.world, self.identity.run_id
        warning = world.agreed(
            lambda: check_owner(directory, run_id=run_id, step=checkpoint.step)
            if world.is_writer else None
        )  # fmt: skip
        if warning is not None:
            self.progress.print(warning)
        directory = self._at_this_layout(directory)
        spec = self.executor.restore_slot(slot, str(directory))
        if (spec.rank, spec.alpha) != (tenant.lora_rank, tenant.lora_alpha):
            raise ConfigError(
                f"tenants[{slot}].lora_rank", tenant.lora_rank,
                f"the checkpoint's slot has rank {spec.rank}, alpha {spec.alpha}",
                "resume with the original LoRA settings", source=self.config.source,
            )  # fmt: skip

    def _at_this_layout(self, directory: Path) -> Path:
        """A slot checkpoint at this world's tensor-parallel size: ``directory`` itself, or
        (saved at another size) a resharded copy the writer makes under the checkpoints'
        ``.tmp-reshard/`` (removed after the restore, and by the next start if killed)."""
        from megatron.core import parallel_state

        from mizzen_train.checkpoint import reshard_slot_checkpoint, saved_tp_size

        world = self.world
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        saved = world.agreed(lambda: saved_tp_size(directory) if world.is_writer else None)
        saved = world.share(saved)
        if saved == tp_size:
            return directory
        target = world.share(
            checkpoints_dir(self.run_dir) / RESHARD_DIR / f"{directory.name}-{uuid.uuid4().hex}"
        )
        world.agreed(
            lambda: reshard_slot_checkpoint(
                directory, target, tp_size=tp_size, relayout=_fused_relayout(self.model_spec)
            ) if world.is_writer else None
        )  # fmt: skip
        self.progress.print(f"resharded {directory} from TP={saved} to TP={tp_size}")
        return target

    # -- evaluation points ------------------------------------------------------------------

    def _dispatcher(self, records: list[dict[str, Any]]):
        from mizzen_train.eval_dispatch import EvalDispatcher, point_dir_name

        config = self.config
        evaluation = config.eval
        root = config.snapshot_root
        assert evaluation is not None and root is not None
        settled_points = {
            int(r["step"])
            for r in records
            if r["kind"] == "eval_point" and r["status"] != "skipped"
        }
        retained = [
            (step, root / point_dir_name(step))
            for step in sorted(settled_points)
            if (root / point_dir_name(step)).is_dir()
        ]
        return EvalDispatcher(
            evaluators=self.evaluators,
            tenants=[t.name for t in config.tenants],
            export=self._export_ordered,
            snapshot_root=root,
            snapshot_marker=self.SNAPSHOT_MARKER,
            max_in_flight=evaluation.max_in_flight,
            overflow=evaluation.overflow,
            keep_snapshots=evaluation.keep_snapshots,
            runner=evaluation.runner,
            on_record=self._on_eval_record,
            on_point=self._on_eval_point,
            on_event=self._on_evaluator_event,
            settled=settled_eval_keys(records),
            retained=retained,
            ray_options={"address": evaluation.ray_address or None},
        )

    def _on_eval_record(self, record) -> None:
        for event in record.events:
            fields = {k: v for k, v in event.items() if k not in ("event",)}
            self.metrics.event(
                event["event"], step=record.step, tenant=record.tenant,
                evaluator=record.evaluator, **fields,
            )  # fmt: skip
        self.metrics.write(
            "eval",
            step=record.step,
            tenant=record.tenant,
            evaluator=record.evaluator,
            status=record.status,
            metrics=record.metrics,
            reason=record.reason,
            wall_s=record.wall_s,
        )
        shown = " ".join(f"{k}={v:.4g}" for k, v in record.metrics.items())
        text = shown if record.status == "ok" else f"skipped: {record.reason}"
        self.progress.print(f"eval step {record.step} {record.tenant}/{record.evaluator}: {text}")

    def _on_evaluator_event(self, evaluator: str, event: dict[str, Any]) -> None:
        """An event of an evaluator's ``close`` (e.g. the engines it kept, stopped)."""
        fields = {k: v for k, v in event.items() if k != "event"}
        self.metrics.event(event["event"], evaluator=evaluator, **fields)

    def _on_eval_point(self, outcome) -> None:
        if outcome.status == "already":
            return
        self.metrics.write(
            "eval_point",
            step=outcome.step,
            status=outcome.status,
            final=outcome.final,
            reason=outcome.reason,
            wall_s=outcome.wall_s,
        )

    def _export_ordered(self, step: int, tenant: str, directory: Path) -> None:
        """The writer's snapshot export, the other ranks following it (its collectives)."""
        self.world.order(step, tenant)
        self.export_snapshot(step, tenant, directory)

    def _follow_export(self, step: int, tenant: str) -> None:
        """A rank other than the writer: its part of the writer's export (it writes nothing)."""
        assert self.config.snapshot_root is not None
        self.export_snapshot(step, tenant, self.config.snapshot_root / ".follower-unwritten")

    def led_by_writer(self, work) -> None:
        """``work`` on the writer (the dispatcher's), its snapshot exports followed by the other
        ranks when they share its collectives (tensor parallel); nothing without evaluators."""
        if not self.evaluators:
            return
        if self.world.plan.tensor > 1:
            self.world.lead(work if self.world.is_writer else None, self._follow_export)
        elif self.world.is_writer:
            work()

    def recover_points(self) -> None:
        """The eval points a resumed run has no results for, up to its checkpoint."""
        self.led_by_writer(self._recover_points)

    def _recover_points(self) -> None:
        if self.dispatcher is None:
            return
        from mizzen_train.eval_dispatch import point_dir_name

        root = self.config.snapshot_root
        assert root is not None
        for step in self.config.eval_points():
            self.dispatcher.tenants = self.tenants_at(step)
            if step > self.start_step or not self.dispatcher.pending_keys(step):
                continue
            final = step == self.config.run.steps
            survived = all(
                (root / point_dir_name(step) / name / self.SNAPSHOT_MARKER).is_file()
                for name in self.dispatcher.tenants
            )
            if step == self.start_step and not survived:
                # the checkpoint holds exactly this step's state: export it now
                state = self.dispatcher.submit(step, final=final)
            else:
                state = self.dispatcher.recover(step, final=final)
            self.progress.print(f"eval point {step} of the previous run: {state}")

    def drain_evaluations(self) -> None:
        """Wait for the eval points in flight, then close the dispatcher (its evaluators' kept
        engines stop, logged before the summary)."""
        if self.dispatcher is None:
            return
        self.progress.print("waiting for the evaluations in flight...")
        try:
            self.dispatcher.drain()
        finally:
            self.dispatcher.close()

    def close_evaluations(self) -> None:
        """However the run ends (:func:`run_trainer` calls it last): close the dispatcher --
        the evaluators stop the engines they keep -- without waiting for points in flight.
        After :meth:`drain_evaluations` it finds nothing left to stop."""
        if self.dispatcher is not None:
            self.dispatcher.close()

    # -- 3. steps ---------------------------------------------------------------------------

    def optimizer_step(self, names: Iterable[str], step: int) -> tuple[dict[str, float], dict]:
        """One AdamW step of the tenants ``names`` at their schedule's rate for ``step``:
        ``({tenant: lr}, {slot: StepReport})``."""
        lrs = {name: lr_at(self.tenant_of[name], step, self.config.run.steps) for name in names}
        reports = self.executor.optim_step(
            {self.slot_of[name]: adam_params(self.tenant_of[name], lr) for name, lr in lrs.items()}
        )
        if self.device == "cuda":
            torch.cuda.synchronize()
        return lrs, reports

    def end_step(self, step: int) -> None:
        """What follows every trained step, in order: the checkpoint, then the eval point."""
        steps = self.config.run.steps
        if step % self.config.run.checkpoint_interval == 0 or step == steps:
            self.checkpoint(step)
        if step in self.eval_points:
            self.led_by_writer(lambda: self._submit_point(step))

    def _submit_point(self, step: int) -> None:
        assert self.dispatcher is not None
        self.dispatcher.tenants = self.tenants_at(step)
        state = self.dispatcher.submit(step, final=step == self.config.run.steps)
        if state == "skipped":
            self.progress.print(f"eval point {step} skipped (see metrics)")

    def checkpoint(self, step: int) -> Path:
        names, streams, extra = self.checkpoint_state(step)

        def save_slots(directory: Path) -> None:
            owner = {"run_id": self.identity.run_id, "step": step}  # checked on restore
            for name in names:
                self.executor.save_slot(self.slot_of[name], str(directory / name), owner=owner)

        path = save_checkpoint(
            self.run_dir,
            step=step,
            run_id=self.identity.run_id,
            streams=streams,
            save_slots=save_slots,
            keep=self.config.run.keep_checkpoints,
            extra=extra,
            world=self.world,
        )
        self.metrics.event("checkpoint", step=step, path=str(path), **self.checkpoint_fields())
        return path

    def checkpoint_fields(self) -> dict[str, Any]:
        """Hook: the command's fields of the ``checkpoint`` event."""
        return {}

    # -- 4. the end -------------------------------------------------------------------------

    def export(self, step: int, names: Iterable[str], *, merged: bool) -> Path:
        """The tenants' adapters (and merged models) as their slots are now, as the export of
        ``step`` (:mod:`mizzen_train.run.export`)."""
        evaluation = self.config.eval
        chosen = evaluation.export_dtype if evaluation is not None else "auto"
        return export_tenants(
            export_root(self.run_dir, step),
            names=list(names),
            slot_of=self.slot_of,
            executor=self.executor,
            model=self.model,
            source=self.source,
            base_model_dir=self.model_dir,
            tokenizer=self.tokenizer,
            merged=merged,
            dtype=self.dtype if chosen == "auto" else chosen,
        )

    def export_checkpoint(self, step: int | None, *, merged: bool) -> Path:
        """Export the checkpoint of ``step`` (None: the newest) of this existing run: every
        tenant it holds a slot of.  After :meth:`validate`, in the rank's world."""
        self._build_model()
        identity = self.identity = open_run(self.run_dir, self.config.to_dict(), resume=True)
        checkpoints = {checkpoint_step(p): p for p in complete_checkpoints(self.run_dir)}
        if not checkpoints or (step is not None and step not in checkpoints):
            held = ", ".join(str(s) for s in sorted(checkpoints)) or "none"
            raise RunStateError(
                f"{self.run_dir}: no complete checkpoint of step {step if step else '(any)'} "
                f"(checkpoints: {held}); give --step one of them"
            )
        checkpoint = load_checkpoint(checkpoints[step or max(checkpoints)], run_id=identity.run_id)
        names = sorted(
            p.name for p in (checkpoint.path / SLOTS_DIR).iterdir() if p.name in self.tenant_of
        )
        for name in names:
            self.restore_slot(name, checkpoint)
        shutil.rmtree(checkpoints_dir(self.run_dir) / RESHARD_DIR, ignore_errors=True)
        return self.export(checkpoint.step, names, merged=merged)

    def export_final(self) -> Path:
        """The final export (collective: every rank, once; :meth:`finish` uses it)."""
        if self.exported is None:
            final_step = self.config.run.steps
            self.exported = self.export(
                final_step, self.tenants_at(final_step), merged=self.config.run.export_merged
            )
        return self.exported

    def finish(self, wall: float) -> dict[str, Any]:
        """The final export, the ``summary`` record, the curves, and where the run's outputs
        are (the writer's; the other ranks return an empty record)."""
        config = self.config
        final_step = config.run.steps
        exported = self.export_final()
        if not self.world.is_writer:
            return {}
        records, _ = read_metrics(self.metrics_path)
        final = _final_eval(records, final_step)
        summary = self.metrics.write(
            "summary",
            run_id=self.identity.run_id,
            steps=final_step,
            eval_points=sorted({int(r["step"]) for r in records if r["kind"] == "eval_point"}),
            final_eval=final,
            **self.summary_fields(records, wall),
            engines_needed=str(config.engines_needed),
        )
        self.metrics.close()
        curves = self._plot()
        self.progress.print(f"done: {final_step} steps in {format_duration(wall)}")
        self.progress.print(f"metrics:     {self.metrics_path}")
        if curves is not None:
            self.progress.print(f"curves:      {curves}")
        self.progress.print(f"export:      {exported} (a PEFT adapter per tenant)")
        for line in self.output_lines(records):
            self.progress.print(line)
        checkpoints = complete_checkpoints(self.run_dir)
        if checkpoints:
            self.progress.print(f"checkpoint:  {checkpoints[-1]}")
        for line in self.final_lines(records):
            self.progress.print(line)
        for tenant, by_evaluator in final.items():
            for name, values in by_evaluator.items():
                shown = " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in values.items()
                )
                self.progress.print(f"final eval {tenant}/{name}: {shown}")
        return summary

    def _plot(self) -> Path | None:
        if not self.config.run.plot:
            return None
        if importlib.util.find_spec("matplotlib") is None:
            self.progress.print("no curves.png: matplotlib is not installed (mizzen-train[plot])")
            return None
        from mizzen_train.run.plot import plot_metrics

        return plot_metrics(self.metrics_path, self.run_dir / CURVES_FILE)


def _final_eval(records: list[Mapping[str, Any]], final_step: int) -> dict[str, dict[str, Any]]:
    """``{tenant: {evaluator: metrics or {"skipped": reason}}}`` of the last step's eval."""
    final: dict[str, dict[str, Any]] = {}
    for record in records:
        if record["kind"] == "eval" and int(record["step"]) == final_step:
            final.setdefault(record["tenant"], {})[record["evaluator"]] = (
                record["metrics"] if record["status"] == "ok" else {"skipped": record.get("reason")}
            )
    return final


def _fused_relayout(spec):
    """The ``relayout`` of :func:`~mizzen_train.checkpoint.reshard_slot_checkpoint` for this
    model: a fused factor's joined tensor at one TP size in the fused layout of another (through
    the Hugging Face modules' tensors, which no TP size changes)."""
    from mizzen_train.hf.convert import layout_of

    def relayout(name: str, full: torch.Tensor, saved: int, size: int) -> torch.Tensor:
        if not name.endswith(".lora_B"):  # A factors split along the input: no fused layout
            return full
        key = name[: -len(".lora_B")]
        return layout_of(spec, size).from_hf(key, layout_of(spec, saved).to_hf(key, full))

    return relayout


def _context_parallel_supported() -> bool:
    """Whether the slot executor splits sequences over context-parallel ranks (its
    ``SUPPORTS_CONTEXT_PARALLEL``; the packed THD attention path sets it)."""
    from mizzen_train.executor import SlotExecutor

    return bool(getattr(SlotExecutor, "SUPPORTS_CONTEXT_PARALLEL", False))


def run_trainer(
    trainer_cls: type[Trainer], config: RunLayout, *, resume: bool, stream: TextIO | None
) -> dict[str, Any]:
    """Run (or ``resume``) ``config`` with ``trainer_cls`` as this process's rank of the run
    (one rank, or torchrun's), the writer holding the run directory for the whole command;
    returns the summary record (the writer's; other ranks: empty)."""
    plan = plan_world(config.parallel, source=config.source)
    device, dtype = resolve_device(config)
    trainer = trainer_cls(config, resume=resume, stream=stream)
    with join_world(plan, device) as world, contextlib.ExitStack() as held:
        trainer.join(world)
        world.agreed(
            lambda: held.enter_context(hold_run_dir(config.run_dir, resume=resume))
            if world.is_writer else None
        )  # fmt: skip
        world.agreed(lambda: trainer.validate(device, dtype))
        try:
            with world.model_parallel():
                return trainer.run_to_end()
        finally:  # failed or interrupted too: no eval engine outlives the run
            trainer.close_evaluations()


def export_run(
    trainer_cls: type[Trainer], config: RunLayout, *, step: int | None, merged: bool
) -> Path:
    """``mizzen-train export``: the checkpoint of ``step`` (None: the newest) of the existing
    run of ``config``, holding its run directory; returns the export's directory.  It runs as
    one rank with ``[parallel]``'s defaults whatever layout trained the run (the slot
    checkpoints are resharded on restore)."""
    from mizzen_train.run.parallel import ParallelConfig

    plan = plan_world(ParallelConfig(timeout_s=config.parallel.timeout_s), {})
    device, dtype = resolve_device(config)
    trainer = trainer_cls(config, resume=True, stream=None)
    trainer.trains = False
    with hold_run_dir(config.run_dir, resume=True), join_world(plan, device) as world:
        trainer.join(world)
        trainer.validate(device, dtype)
        with world.model_parallel():
            return trainer.export_checkpoint(step, merged=merged)
