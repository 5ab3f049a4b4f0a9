"""The SFT trainer: K tenants' LoRA slots trained together on one base, evaluated on the side.

:func:`run_sft` runs one configuration (:mod:`mizzen_train.sft.config`) in this process:

1. opens the run directory (a fresh run id, or ``resume`` keeps the run's), imports the base
   model from its Hugging Face directory into megatron-core (``model.path = "tiny"`` first writes a
   small Llama by code) and loads every data set and eval set -- all validation happens here,
   before step 0;
2. gives tenant ``i`` slot ``i`` of a :class:`~mizzen_train.executor.SlotExecutor` (its own LoRA
   rank, AdamW settings, schedule and data stream), or restores slots, data streams and RNGs from
   the newest complete checkpoint;
3. per step: packs each tenant's rows into one slot-contiguous batch, runs one forward/backward
   (SFT cross-entropy on the response tokens) and one optimizer step for all slots, logs a
   ``train`` record per tenant and a progress line;
4. checkpoints every ``checkpoint_interval`` steps and at the last step; at every eval point
   (every ``eval.interval`` steps, and the last step, forced) hands the step to the
   :class:`~mizzen_train.eval_dispatch.EvalDispatcher` and continues training at once;
5. drains the evaluations, writes the ``summary`` record and ``curves.png``, prints where the
   metrics, curves, snapshots and checkpoints are.

Invariants:
- Training never starts a rollout engine: :attr:`SftConfig.engines_needed` is ``none`` or
  ``eval-only``, and eval engines are started by the generation evaluator for an eval point only.
- A resumed run continues from the checkpoint's step with the checkpoint's slots, data position
  and RNG states, keeps its run id, evaluates only the points it has no results for (and first
  the unsettled points whose snapshots survived), and rewrites nothing it already logged except
  the training records after the checkpoint, which it produces again.
- One process, one rank (TP = DP = 1); a launch under torchrun with more ranks is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from mizzen_train.sft.config import EvaluatorConfig, SftConfig, SftConfigError, TenantConfig
from mizzen_train.sft.metrics import (
    METRICS_FILE,
    MetricsLog,
    Progress,
    format_duration,
    rewrite_for_resume,
    settled_eval_keys,
)
from mizzen_train.sft.state import (
    RunStateError,
    check_run_dir,
    complete_checkpoints,
    load_checkpoint,
    open_run,
    remove_partial_checkpoints,
    save_checkpoint,
    set_rng_state,
)

__all__ = ["lr_at", "run_sft"]


def lr_at(tenant: TenantConfig, step: int, total_steps: int) -> float:
    """Learning rate of ``step`` (1-based): linear warmup, then constant / cosine / linear decay
    towards ``min_lr_ratio * lr``, reached one step after the last (so no step has lr 0)."""
    peak = tenant.lr
    if tenant.warmup_steps and step <= tenant.warmup_steps:
        return peak * step / tenant.warmup_steps
    if tenant.lr_schedule == "constant":
        return peak
    span = max(1, total_steps - tenant.warmup_steps)
    progress = min(1.0, (step - tenant.warmup_steps - 1) / span)
    floor = tenant.min_lr_ratio * peak
    if tenant.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak - (peak - floor) * progress


def _resolve_device(config: SftConfig) -> tuple[str, str]:
    run = config.run
    cuda = torch.cuda.is_available()
    device = run.device if run.device != "auto" else ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        raise SftConfigError(
            "run.device", "cuda", "no CUDA device is visible to this process",
            'use run.device = "cpu" (or "auto"), or run on a GPU machine', source=config.source,
        )  # fmt: skip
    if device == "cpu" and cuda:
        raise SftConfigError(
            "run.device", "cpu", "megatron-core's CPU path needs a machine without CUDA",
            'use run.device = "cuda" (or "auto") here', source=config.source,
        )  # fmt: skip
    dtype = run.dtype if run.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    if dtype == "bf16" and device == "cpu":
        raise SftConfigError(
            "run.dtype", "bf16", "bf16 training is supported on CUDA only",
            'use run.dtype = "fp32" (or "auto") on a CPU', source=config.source,
        )  # fmt: skip
    return device, dtype


@contextlib.contextmanager
def _single_rank(device: str) -> Iterator[None]:
    """A world of one rank and megatron's parallel state (TP = PP = 1) for this process."""
    from megatron.core import parallel_state

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SftConfigError(
            "WORLD_SIZE", os.environ["WORLD_SIZE"], "mizzen-train sft runs as one process",
            "launch it directly (not under torchrun with several ranks)",
        )  # fmt: skip
    if device == "cpu":
        from mizzen_train.megatron_on_cpu import install_megatron_cpu_shim

        install_megatron_cpu_shim()
        backend = "gloo"
    else:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(0)
        backend = "nccl"
    owned = not torch.distributed.is_initialized()
    with tempfile.TemporaryDirectory(prefix="mizzen-sft-rdzv-") as tmp:
        if owned:
            torch.distributed.init_process_group(
                backend, init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
            )
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            yield
        finally:
            if owned:
                parallel_state.destroy_model_parallel()
                torch.distributed.destroy_process_group()


def _base_model_dir(config: SftConfig) -> Path:
    if config.model.path != "tiny":
        return Path(config.model.path)
    from mizzen_train.hf.tiny import write_tiny_llama

    overrides = dict(config.model.tiny)
    digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
    target = config.run_dir / f"base-model-tiny-{digest}"  # one directory per tiny config
    if not target.exists():
        seed = int(overrides.pop("seed", 0))
        write_tiny_llama(target, seed=seed, **overrides)
    return target


def _tokenizer(config: SftConfig, model_dir: Path):
    from mizzen_train.data import SftTokenizer

    choice = config.model.tokenizer
    return SftTokenizer.load(model_dir if choice == "model" else choice)


def _build_evaluator(ev: EvaluatorConfig, index: int, tokenizer, max_positions: int):
    from mizzen_train.data import load_sft_dataset
    from mizzen_train.eval_dispatch import load_evaluator
    from mizzen_train.evaluators import GenerationEvaluator, LossEvaluator, generation_prompts

    where = f"eval.evaluators[{index}]"
    name = ev.name or ev.kind
    if ev.kind == "python":
        evaluator = load_evaluator(ev.factory, ev.options)
        if ev.name and evaluator.name != ev.name:
            evaluator.name = ev.name
    else:
        dataset = load_sft_dataset(
            ev.data,
            tokenizer,
            field=f"{where}.data",
            seq_len=max_positions - 1,
            limit=ev.limit or None,
        )
        if ev.kind == "generate":
            evaluator = GenerationEvaluator(
                name=name,
                prompts=generation_prompts(tokenizer, dataset.examples),
                reward=ev.reward,
                max_new_tokens=ev.max_new_tokens,
                temperature=ev.temperature,
                batch_size=ev.batch_size,
                engine_urls=tuple(ev.engine_urls),
                num_engines=ev.num_engines,
                engine_threads=ev.engine_threads,
                device=ev.device,
                startup_timeout_s=ev.startup_timeout_s,
                request_timeout_s=ev.request_timeout_s,
            )
        else:
            evaluator = LossEvaluator(
                name=name, examples=dataset.examples, batch_size=ev.batch_size, device=ev.device
            )
    if ev.tenants:
        evaluator.tenants = list(ev.tenants)
    return evaluator


class _Trainer:
    def __init__(self, config: SftConfig, *, resume: bool, stream: TextIO | None) -> None:
        self.config = config
        self.resume = resume
        self.progress = Progress(config.run.steps, stream=stream)
        self.run_dir = config.run_dir

    # -- setup ----------------------------------------------------------------------------

    def validate(self, device: str, dtype: str) -> None:
        """Everything that can be wrong with the configuration, its files and the run directory,
        checked before megatron starts: model config, tokenizer, data and eval sets, evaluators."""
        from mizzen_train.data import load_sft_dataset
        from mizzen_train.hf import read_llama_config

        config = self.config
        self.device, self.dtype = device, dtype
        check_run_dir(self.run_dir, config.to_dict(), resume=self.resume)
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        self.model_dir = _base_model_dir(config)
        spec = read_llama_config(self.model_dir, dtype=dtype).spec
        self.tokenizer = _tokenizer(config, self.model_dir)
        if len(self.tokenizer) > spec.vocab_size:
            raise SftConfigError(
                "model.tokenizer", config.model.tokenizer,
                f"has {len(self.tokenizer)} tokens but the model's vocab_size is {spec.vocab_size}",
                "use the model's own tokenizer", source=config.source,
            )  # fmt: skip
        if config.data.seq_len > spec.max_sequence_length:
            raise SftConfigError(
                "data.seq_len", config.data.seq_len,
                f"exceeds the model's max_position_embeddings={spec.max_sequence_length}",
                f"use data.seq_len <= {spec.max_sequence_length}", source=config.source,
            )  # fmt: skip
        self.datasets = {}
        for i, tenant in enumerate(config.tenants):
            self.datasets[tenant.name] = load_sft_dataset(
                tenant.data,
                self.tokenizer,
                field=f"tenants[{i}].data",
                seq_len=config.data.seq_len,
                on_overlong=config.data.on_overlong,
            )
        for i, ev in enumerate(config.evaluators):
            if ev.device == "cuda" and not torch.cuda.is_available():
                raise SftConfigError(
                    f"eval.evaluators[{i}].device", "cuda", "no CUDA device is visible to this "
                    "process", 'use device = "cpu", or run on a GPU machine', source=config.source,
                )  # fmt: skip
        self.evaluators = [
            _build_evaluator(ev, i, self.tokenizer, spec.max_sequence_length)
            for i, ev in enumerate(config.evaluators)
        ]

    def setup(self) -> None:
        from mizzen_train.data import PackedStream
        from mizzen_train.executor import SlotExecutor
        from mizzen_train.hf import import_hf_llama
        from mizzen_train.specs import ExecutorConfig

        config = self.config
        device, dtype, model_dir = self.device, self.dtype, self.model_dir
        imported = import_hf_llama(model_dir, device=device, dtype=dtype)
        self.model, self.source = imported.model, imported.source
        spec = imported.spec
        # everything is validated: only now does the run directory become a run
        self.identity = open_run(self.run_dir, config.to_dict(), resume=self.resume)
        self.executor = SlotExecutor(
            self.model,
            ExecutorConfig(
                num_slots=len(config.tenants),
                max_rank=max(t.lora_rank for t in config.tenants),
                micro_batch_size=config.run.micro_batch_size,
            ),
        )
        self.slot_of = {t.name: i for i, t in enumerate(config.tenants)}
        self.streams = {
            t.name: PackedStream(
                self.datasets[t.name],
                rows=t.rows,
                seq_len=config.data.seq_len,
                pad_id=self.tokenizer.pad_token_id,
                seed=t.data_seed,
            )
            for t in config.tenants
        }
        self.start_step = self._restore_or_init()
        self.metrics_path = self.run_dir / METRICS_FILE
        records, broken = [], 0
        if self.identity.resumed and self.metrics_path.exists():
            records, broken = rewrite_for_resume(self.metrics_path, self.start_step)
        if not self.identity.resumed and self.metrics_path.exists():
            self.metrics_path.unlink()  # a leftover of a start that never became a run
        self.metrics = MetricsLog(self.metrics_path)
        event = "resumed" if self.identity.resumed else "run_started"
        self.metrics.event(
            event,
            run_id=self.identity.run_id,
            from_step=self.start_step,
            steps=config.run.steps,
            engines_needed=str(config.engines_needed),
            device=device,
            dtype=dtype,
            base_model=str(model_dir),
            base_parameters=spec.parameter_count(),
            trainable_parameters_per_slot=self.executor.trainable_parameters_per_slot(),
            tenants=[t.name for t in config.tenants],
            eval_points=config.eval_points(),
            broken_metric_lines=broken,
        )
        self.progress.print(
            f"{event} run {self.identity.run_id} in {self.run_dir} from step {self.start_step}: "
            f"{len(config.tenants)} tenant(s) on {model_dir} ({spec.parameter_count():,} "
            f"parameters, {device}, {dtype}); engines needed: {config.engines_needed}"
        )
        self.dispatcher = self._dispatcher(records) if self.evaluators else None
        if self.dispatcher is not None:
            try:
                self.dispatcher.start()  # a runner that cannot start fails before step 0
            except Exception as exc:
                raise SftConfigError(
                    "eval.ray_address",
                    config.eval.ray_address,
                    f"the Ray runner did not start ({type(exc).__name__}: {exc})",
                    'fix the address, or use eval.runner = "thread"',
                    source=config.source,
                ) from None

    def _restore_or_init(self) -> int:
        config = self.config
        removed = remove_partial_checkpoints(self.run_dir)
        if removed:
            self.progress.print(f"removed partial checkpoint(s) of a killed run: {removed}")
        checkpoints = complete_checkpoints(self.run_dir) if self.identity.resumed else []
        if not checkpoints:
            random.seed(config.run.seed)
            torch.manual_seed(config.run.seed)
            for tenant in config.tenants:
                self.executor.load_slot(
                    self.slot_of[tenant.name],
                    tenant.lora_rank,
                    tenant.lora_alpha,
                    init=tenant.lora_init,
                    seed=tenant.lora_seed,
                )
            return 0
        checkpoint = load_checkpoint(checkpoints[-1], run_id=self.identity.run_id)
        for tenant in config.tenants:
            slot = self.slot_of[tenant.name]
            spec = self.executor.restore_slot(slot, str(checkpoint.path / "slots" / tenant.name))
            if (spec.rank, spec.alpha) != (tenant.lora_rank, tenant.lora_alpha):
                raise SftConfigError(
                    f"tenants[{slot}].lora_rank", tenant.lora_rank,
                    f"the checkpoint's slot has rank {spec.rank}, alpha {spec.alpha}",
                    "resume with the original LoRA settings", source=config.source,
                )  # fmt: skip
            if tenant.name not in checkpoint.streams:
                raise RunStateError(
                    f"{checkpoint.path}: holds no data stream of tenant {tenant.name!r}"
                )
            self.streams[tenant.name].load_state_dict(checkpoint.streams[tenant.name])
        set_rng_state(checkpoint.rng)
        self.progress.print(f"resuming from {checkpoint.path} (step {checkpoint.step})")
        return checkpoint.step

    #: The file that marks an exported snapshot directory as complete (read on recovery).
    SNAPSHOT_MARKER = "config.json"

    def _export_snapshot(self, step: int, tenant: str, directory: Path) -> None:
        """One tenant's eval snapshot: the merged model as a Hugging Face directory."""
        from mizzen_train.hf import export_hf_snapshot

        evaluation = self.config.eval
        assert evaluation is not None
        export_dtype = evaluation.export_dtype if evaluation.export_dtype != "auto" else self.dtype
        export_hf_snapshot(
            directory,
            model=self.model,
            source=self.source,
            executor=self.executor,
            slot=self.slot_of[tenant],
            dtype=export_dtype,
            tokenizer=self.tokenizer,
        )

    def _tenants_at(self, step: int) -> list[str]:
        """The tenants an eval point of ``step`` evaluates (SFT: all of them)."""
        del step
        return [t.name for t in self.config.tenants]

    def _dispatcher(self, records: list[dict[str, Any]]):
        from mizzen_train.eval_dispatch import EvalDispatcher, point_dir_name

        config = self.config
        evaluation = config.eval
        assert evaluation is not None
        root = config.snapshot_root
        assert root is not None

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
            export=self._export_snapshot,
            snapshot_root=root,
            snapshot_marker=self.SNAPSHOT_MARKER,
            max_in_flight=evaluation.max_in_flight,
            overflow=evaluation.overflow,
            keep_snapshots=evaluation.keep_snapshots,
            runner=evaluation.runner,
            on_record=self._on_eval_record,
            on_point=self._on_eval_point,
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

    # -- loop -----------------------------------------------------------------------------

    def _batch(self):
        from mizzen_train.batch import SlotBatch

        parts = {name: stream.next_rows() for name, stream in self.streams.items()}
        slot_ids = torch.cat(
            [torch.full_like(p.input_ids, self.slot_of[n]) for n, p in parts.items()]
        )
        batch = SlotBatch(
            input_ids=torch.cat([p.input_ids for p in parts.values()]),
            target_ids=torch.cat([p.target_ids for p in parts.values()]),
            loss_mask=torch.cat([p.loss_mask for p in parts.values()]),
            slot_ids=slot_ids,
            segment_ids=torch.cat([p.segment_ids for p in parts.values()]),
        )
        return batch, parts

    def _recover_points(self) -> None:
        if self.dispatcher is None:
            return
        from mizzen_train.eval_dispatch import point_dir_name

        root = self.config.snapshot_root
        assert root is not None
        for step in self.config.eval_points():
            self.dispatcher.tenants = self._tenants_at(step)
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

    def train(self) -> dict[str, Any]:
        from mizzen_train.losses import CrossEntropyLoss
        from mizzen_train.specs import AdamParams

        config = self.config
        steps = config.run.steps
        points = set(config.eval_points())
        loss = CrossEntropyLoss()
        self._recover_points()
        started = time.perf_counter()
        total_tokens = 0
        last_losses: dict[str, float] = {}
        for step in range(self.start_step + 1, steps + 1):
            t0 = time.perf_counter()
            batch, parts = self._batch()
            reports = self.executor.forward_backward(batch, loss)
            lrs = {t.name: lr_at(t, step, steps) for t in config.tenants}
            requests = {
                self.slot_of[t.name]: AdamParams(
                    lr=lrs[t.name],
                    betas=tuple(t.betas),
                    eps=t.eps,
                    weight_decay=t.weight_decay,
                    max_grad_norm=t.max_grad_norm or None,
                )
                for t in config.tenants
            }
            step_reports = self.executor.optim_step(requests)
            if self.device == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
            tokens = sum(p.tokens for p in parts.values())
            total_tokens += tokens
            for tenant in config.tenants:
                slot = self.slot_of[tenant.name]
                last_losses[tenant.name] = reports[slot].loss
                self.metrics.write(
                    "train",
                    step=step,
                    tenant=tenant.name,
                    loss=reports[slot].loss,
                    lr=lrs[tenant.name],
                    grad_norm=step_reports[slot].grad_norm,
                    stepped=step_reports[slot].stepped,
                    tokens=parts[tenant.name].tokens,
                    loss_tokens=parts[tenant.name].loss_tokens,
                    tokens_per_s=tokens / step_s,
                    step_s=step_s,
                )
            if step % config.run.log_interval == 0 or step == steps:
                self.progress.step(step, last_losses, tokens / step_s, step_s)
            if step % config.run.checkpoint_interval == 0 or step == steps:
                self._checkpoint(step)
            if self.dispatcher is not None and step in points:
                state = self.dispatcher.submit(step, final=step == steps)
                if state == "skipped":
                    self.progress.print(f"eval point {step} skipped (see metrics)")
        wall = time.perf_counter() - started
        if self.dispatcher is not None:
            self.progress.print("waiting for the evaluations in flight...")
            try:
                self.dispatcher.drain()
            finally:
                self.dispatcher.close()
        return self._finish(wall, total_tokens, last_losses)

    def _checkpoint(self, step: int) -> None:
        def save_slots(directory: Path) -> None:
            for tenant in self.config.tenants:
                self.executor.save_slot(self.slot_of[tenant.name], str(directory / tenant.name))

        path = save_checkpoint(
            self.run_dir,
            step=step,
            run_id=self.identity.run_id,
            streams={name: stream.state_dict() for name, stream in self.streams.items()},
            save_slots=save_slots,
            keep=self.config.run.keep_checkpoints,
        )
        self.metrics.event("checkpoint", step=step, path=str(path))

    def _finish(self, wall: float, tokens: int, last_losses: dict[str, float]) -> dict[str, Any]:
        from mizzen_train.sft.metrics import read_metrics

        config = self.config
        records, _ = read_metrics(self.metrics_path)
        evals = [r for r in records if r["kind"] == "eval"]
        final_step = config.run.steps
        final: dict[str, dict[str, Any]] = {}
        for record in evals:
            if int(record["step"]) == final_step:
                final.setdefault(record["tenant"], {})[record["evaluator"]] = (
                    record["metrics"] if record["status"] == "ok" else {"skipped": record["reason"]}
                )
        points = sorted({int(r["step"]) for r in records if r["kind"] == "eval_point"})
        train_losses = {
            r["tenant"]: r["loss"]
            for r in records
            if r["kind"] == "train" and int(r["step"]) == final_step
        }
        summary = self.metrics.write(
            "summary",
            run_id=self.identity.run_id,
            steps=final_step,
            eval_points=points,
            final_eval=final,
            final_train_loss=train_losses or last_losses,
            wall_s=round(wall, 3),
            tokens_per_s=(tokens / wall) if wall > 0 else 0.0,
            engines_needed=str(config.engines_needed),
        )
        self.metrics.close()
        curves = self._plot()
        self.progress.print(f"done: {final_step} steps in {format_duration(wall)}")
        self.progress.print(f"metrics:     {self.metrics_path}")
        if curves is not None:
            self.progress.print(f"curves:      {curves}")
        snapshots = config.snapshot_root
        if snapshots is not None and snapshots.is_dir():
            kept = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
            self.progress.print(f"snapshots:   {snapshots} (kept: {', '.join(kept) or 'none'})")
        checkpoints = complete_checkpoints(self.run_dir)
        if checkpoints:
            self.progress.print(f"checkpoint:  {checkpoints[-1]}")
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
        from mizzen_train.plot import plot_metrics

        return plot_metrics(self.metrics_path, self.run_dir / "curves.png")


def run_sft(config: SftConfig, *, resume: bool = False, stream: TextIO | None = None) -> dict:
    """Run (or ``resume``) the SFT job ``config`` in this process; returns the summary record."""
    device, dtype = _resolve_device(config)
    trainer = _Trainer(config, resume=resume, stream=stream)
    trainer.validate(device, dtype)
    with _single_rank(device):
        trainer.setup()
        return trainer.train()
