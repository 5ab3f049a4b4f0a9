"""The SFT trainer: K tenants' LoRA slots trained together on one base, evaluated on the side.

:func:`run_sft` runs one configuration (:mod:`mizzen_train.sft.config`) in this process, as a
:class:`~mizzen_train.run.trainer.Trainer` (run directory, checkpoints, metrics, eval points)
whose step is SFT's:

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
  ``eval-only``, and eval engines are started by the generation evaluator at the first eval point
  (never before), kept for the later points until the run ends (``engine_lifetime = "run"``, the
  default) or started and stopped at each point (``"point"``).
- A resumed run continues from the checkpoint's step with the checkpoint's slots, data position
  and RNG states, keeps its run id, evaluates only the points it has no results for (and first
  the unsettled points whose snapshots survived), and rewrites nothing it already logged except
  the training records after the checkpoint, which it produces again.
- One rank, or torchrun's ranks split by ``[parallel]`` (:mod:`mizzen_train.run.parallel`):
  every rank draws the same global batch from the same streams, and each data-parallel rank
  trains its contiguous rows of it (:meth:`~mizzen_train.batch.SlotBatch.rows_for`), so the data
  order, and a resume at the same world size, are those of one rank.
- Resume, checkpoints and eval points are the run framework's (:mod:`mizzen_train.run`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TextIO

import torch

from mizzen_train.run.config import ConfigError
from mizzen_train.run.sections import EvaluatorConfig
from mizzen_train.run.state import LoadedCheckpoint, RunStateError
from mizzen_train.run.trainer import Trainer, generation_evaluator, run_trainer
from mizzen_train.sft.config import SftConfig

__all__ = ["SftTrainer", "run_sft"]


class SftTrainer(Trainer):
    """SFT's step: one slot-contiguous packed batch of every tenant's rows, cross-entropy on the
    response tokens, one optimizer step for all slots."""

    command = "sft"
    SNAPSHOT_MARKER = "config.json"
    config: SftConfig

    # -- validation and set-up --------------------------------------------------------------

    def validate_inputs(self, model_spec) -> None:
        from mizzen_train.data import load_sft_dataset

        config = self.config
        if len(self.tokenizer) > model_spec.vocab_size:
            raise ConfigError(
                "model.tokenizer", config.model.tokenizer,
                f"has {len(self.tokenizer)} tokens but the model's vocab_size is "
                f"{model_spec.vocab_size}", "use the model's own tokenizer", source=config.source,
            )  # fmt: skip
        if config.data.seq_len > model_spec.max_sequence_length:
            raise ConfigError(
                "data.seq_len", config.data.seq_len,
                f"exceeds the model's max_position_embeddings={model_spec.max_sequence_length}",
                f"use data.seq_len <= {model_spec.max_sequence_length}", source=config.source,
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
                raise ConfigError(
                    f"eval.evaluators[{i}].device", "cuda", "no CUDA device is visible to this "
                    "process", 'use device = "cpu", or run on a GPU machine', source=config.source,
                )  # fmt: skip

    def build_data_evaluator(self, ev: EvaluatorConfig, index: int):
        from mizzen_train.data import load_sft_dataset
        from mizzen_train.evaluators import LossEvaluator, generation_prompts

        dataset = load_sft_dataset(
            ev.data,
            self.tokenizer,
            field=f"eval.evaluators[{index}].data",
            seq_len=self.model_spec.max_sequence_length - 1,
            limit=ev.limit or None,
        )
        if ev.kind == "loss":
            return LossEvaluator(
                name=ev.name or ev.kind,
                examples=dataset.examples,
                batch_size=ev.batch_size,
                device=ev.device,
            )
        return generation_evaluator(  # it starts its own engines, at the first eval point
            ev,
            generation_prompts(self.tokenizer, dataset.examples),
            engine_urls=tuple(ev.engine_urls),
            num_engines=ev.num_engines,
            engine_threads=ev.engine_threads,
            device=ev.device,
        )

    def prepare_data(self) -> None:
        from mizzen_train.data import PackedStream

        config = self.config
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

    def init_slots(self) -> None:
        for tenant in self.config.tenants:
            self.load_fresh_slot(tenant.name)

    def restore(self, checkpoint: LoadedCheckpoint) -> None:
        for tenant in self.config.tenants:
            self.restore_slot(tenant.name, checkpoint)
            if tenant.name not in checkpoint.streams:
                raise RunStateError(
                    f"{checkpoint.path}: holds no data stream of tenant {tenant.name!r}"
                )
            self.streams[tenant.name].load_state_dict(checkpoint.streams[tenant.name])

    def export_snapshot(self, step: int, tenant: str, directory: Path) -> None:
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

    def step_rows(self) -> tuple[int, int]:
        return sum(t.rows for t in self.config.tenants), self.config.data.seq_len

    def checkpoint_state(self, step: int) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        names = [t.name for t in self.config.tenants]
        return names, {name: stream.state_dict() for name, stream in self.streams.items()}, {}

    # -- the loop ---------------------------------------------------------------------------

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

    def train(self) -> dict[str, Any]:
        from mizzen_train.losses import CrossEntropyLoss

        config = self.config
        steps = config.run.steps
        names = [t.name for t in config.tenants]
        loss = CrossEntropyLoss()
        self.recover_points()
        started = time.perf_counter()
        self.total_tokens = 0
        self.last_losses: dict[str, float] = {}
        for step in range(self.start_step + 1, steps + 1):
            t0 = time.perf_counter()
            batch, parts = self._batch()
            reports = self.executor.forward_backward(batch, loss)
            lrs, step_reports = self.optimizer_step(names, step)
            step_s = time.perf_counter() - t0
            tokens = sum(p.tokens for p in parts.values())
            self.total_tokens += tokens
            for name in names:
                slot = self.slot_of[name]
                self.last_losses[name] = reports[slot].loss
                self.metrics.write(
                    "train",
                    step=step,
                    tenant=name,
                    loss=reports[slot].loss,
                    lr=lrs[name],
                    grad_norm=step_reports[slot].grad_norm,
                    stepped=step_reports[slot].stepped,
                    tokens=parts[name].tokens,
                    loss_tokens=parts[name].loss_tokens,
                    packing_efficiency=reports[slot].packing_efficiency,
                    tokens_per_s=tokens / step_s,
                    step_s=step_s,
                )
            if step % config.run.log_interval == 0 or step == steps:
                self.progress.step(step, self.last_losses, tokens / step_s, step_s)
            self.end_step(step)
        wall = time.perf_counter() - started
        self.export_final()  # every rank (collective) before the writer waits for evaluations
        self.drain_evaluations()
        return self.finish(wall)

    # -- the end ----------------------------------------------------------------------------

    def summary_fields(self, records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
        final_step = self.config.run.steps
        train_losses = {
            r["tenant"]: r["loss"]
            for r in records
            if r["kind"] == "train" and int(r["step"]) == final_step
        }
        return {
            "final_train_loss": train_losses or self.last_losses,
            "wall_s": round(wall, 3),
            "tokens_per_s": (self.total_tokens / wall) if wall > 0 else 0.0,
        }

    def output_lines(self, records: list[dict[str, Any]]) -> list[str]:
        snapshots = self.config.snapshot_root
        if snapshots is None or not snapshots.is_dir():
            return []
        kept = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
        return [f"snapshots:   {snapshots} (kept: {', '.join(kept) or 'none'})"]


def run_sft(config: SftConfig, *, resume: bool = False, stream: TextIO | None = None) -> dict:
    """Run (or ``resume``) the SFT job ``config`` in this process; returns the summary record."""
    return run_trainer(SftTrainer, config, resume=resume, stream=stream)
