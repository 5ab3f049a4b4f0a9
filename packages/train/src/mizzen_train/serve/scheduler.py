"""The executor thread: one :class:`~mizzen_train.executor.SlotExecutor`, every tenant's
operations, batched into as few executor steps as the shapes allow.

The thread takes the head operation of every model's queue (submission order per model) and runs
together, in one executor call, the heads that can share it:

- ``forward_backward`` heads whose rows have the same padded length (and fit ``max_batch_rows``):
  one ``forward_backward_logprobs`` with a loss per slot (the log-probs it answers come from the
  same forward pass as the gradients);
- ``forward`` heads likewise, one ``forward_logprobs``;
- ``optim_step`` heads: one ``optim_step`` with each slot's Adam parameters;
- everything else (create, load, save, publish, unload) alone.

Invariants:
- Only this thread touches the executor and megatron's parallel state.
- A request error of one tenant in a batched call (the executor validates before it changes
  anything) re-runs that call one tenant at a time, so only the culprit fails; a non-finite batch
  stays in its own slot (rows hold one slot each; the step skips a slot whose gradient norm is
  non-finite).  Any other exception leaves the executor failed: every later operation fails
  with "restart the server" (saved checkpoints survive, see :mod:`.state`).
- A model's slot is reserved when ``create_model`` is accepted and freed by ``unload_model``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from mizzen_train.serve.batching import TenantRows, join_rows, loss_sums
from mizzen_train.serve.operations import Operation, OperationBook, internal_error
from mizzen_train.serve.state import (
    UNNAMED_PREFIX,
    ModelRecord,
    ServerState,
    session_of_model,
)
from mizzen_train.serve.wire import PROTOBUF, WireError, encode_forward_backward_output

__all__ = ["Scheduler"]

log = logging.getLogger("mizzen_train.serve")
JSON = "application/json"
BATCHABLE = ("forward_backward", "forward", "optim_step")


class Scheduler:
    def __init__(self, config, state: ServerState, book: OperationBook, metrics, publish) -> None:
        self.config = config
        self.state = state
        self.book = book
        self.metrics = metrics
        self.publish = publish  # (tenant, path, directory, session) -> sampling session id
        self.slot_of: dict[str, int] = {}
        self.owner_of: dict[str, str] = {}  # model id -> tenant, for every reserved slot
        self.ready = threading.Event()
        self.startup_error: str | None = None
        self.stopping = False
        self._thread = threading.Thread(
            target=self._main, name="mizzen-serve-executor", daemon=True
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.book.cond:
            self.stopping = True
            self.book.cond.notify_all()
        self._thread.join(timeout=30)

    def _main(self) -> None:
        from mizzen_train.run.parallel import single_rank

        try:
            device, dtype = self._device()
            with single_rank(device):
                self._build(device, dtype)
                self.ready.set()
                self._loop()
        except Exception as exc:  # reported by the command; the server does not serve
            self.startup_error = f"{type(exc).__name__}: {exc}"
            log.exception("executor thread stopped")
            self.ready.set()

    def _device(self) -> tuple[str, str]:
        import torch

        model = self.config.model
        cuda = torch.cuda.is_available()
        device = model.device if model.device != "auto" else ("cuda" if cuda else "cpu")
        dtype = model.dtype if model.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
        return device, dtype

    def _build(self, device: str, dtype: str) -> None:
        import torch

        from mizzen_train.executor import SlotExecutor
        from mizzen_train.hf import import_hf_llama
        from mizzen_train.specs import ExecutorConfig

        if self.config.model.threads:
            torch.set_num_threads(self.config.model.threads)
        imported = import_hf_llama(self.model_dir, device=device, dtype=dtype)
        self.model, self.source = imported.model, imported.source
        self.vocab_size = int(self.model.vocab_size)
        self.max_seq_len = int(self.model.max_sequence_length)
        model = self.config.model
        self.executor = SlotExecutor(
            self.model,
            ExecutorConfig(
                num_slots=model.slots, max_rank=model.max_rank,
                micro_batch_size=model.micro_batch_size,
            ),
        )  # fmt: skip

    @property
    def model_dir(self):
        """The base model's directory; a "tiny" one is written on first use, named by a digest of
        its whole config (seed and every field, overrides applied: another ``[model.tiny]`` is
        another directory) and written whole or not at all (a temporary sibling, renamed)."""
        import hashlib
        import json
        from pathlib import Path

        model = self.config.model
        if model.path != "tiny":
            return Path(model.path)
        from mizzen_train.hf.tiny import tiny_llama_config, write_tiny_llama

        whole = {"seed": model.seed, "config": tiny_llama_config(**model.tiny)}
        digest = hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()[:24]
        target = self.state.root / f"base-model-tiny-{digest}"
        if not target.exists():
            write_tiny_llama(target, seed=model.seed, **dict(model.tiny))
        return target

    # -- slots ----------------------------------------------------------------------------------

    def reserve_slot(self, model_id: str, tenant: str) -> int:
        """A free slot for a new model of ``tenant`` (call under ``book.cond``); 422 when all K
        are in use."""
        used = set(self.slot_of.values())
        for slot in range(self.config.model.slots):
            if slot not in used:
                self.slot_of[model_id] = slot
                self.owner_of[model_id] = tenant
                return slot
        raise WireError(
            422, f"all {self.config.model.slots} LoRA slots are in use. Fix: unload a model "
            "(TrainingClient's model) or ask the operator for a server with more slots",
        )  # fmt: skip

    def models_of(self, tenant: str) -> int:
        """How many slots ``tenant`` holds (reserved at submit: created, or being created)."""
        return sum(owner == tenant for owner in self.owner_of.values())

    def _free_slot(self, model_id: str) -> None:
        """Forget ``model_id``'s slot (call under ``book.cond``)."""
        self.slot_of.pop(model_id, None)
        self.owner_of.pop(model_id, None)

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.book.cond:
                while not self.stopping and not self.book.heads():
                    self.book.cond.wait()
                if self.stopping:
                    return
                group = self._pick(self.book.heads())
            started = time.monotonic()
            for op in group:
                op.started = started
            self._execute(group)
            self.metrics.executed(group, time.monotonic() - started)
            self.book.pop(group)

    def _pick(self, heads: list[Operation]) -> list[Operation]:
        first = heads[0]
        if first.kind not in BATCHABLE:
            return [first]
        group, rows = [], 0
        for op in heads:
            if op.kind != first.kind:
                continue
            if op.kind != "optim_step":
                part: TenantRows = op.payload
                if part.padded_len != first.payload.padded_len:
                    continue
                if group and rows + len(part.inputs) > self.config.server.max_batch_rows:
                    continue
                rows += len(part.inputs)
            group.append(op)
        return group

    def _execute(self, group: list[Operation]) -> None:
        from mizzen_train.errors import SlotCheckpointError, SlotConfigError

        if self.executor.failed is not None:
            for op in group:
                op.fail("the executor failed earlier (logged on the server, under the incident "
                        "id of the operation that failed it). Fix: the operator restarts the "
                        "server", "server")  # fmt: skip
            return
        # operations queued behind a create that failed (it freed the slot): nothing to run on
        orphans = [op for op in group if op.model_id not in self.slot_of]
        if orphans and group[0].kind != "unload_model":
            for op in orphans:
                op.fail(f"model_id {op.model_id[:80]!r}: has no slot (its create failed, or it "
                        "was unloaded) before this ran", "user")  # fmt: skip
            group = [op for op in group if op not in orphans]
            if not group:
                return
        run: Callable[[list[Operation]], None] = getattr(self, f"_run_{group[0].kind}")
        try:
            run(group)
        except SlotCheckpointError:  # a checkpoint the server wrote: its damage is not the client's
            message = internal_error(f"operation {group[0].kind} (a checkpoint on the server)")
            for op in group:
                if not op.done.is_set():
                    op.fail(message, "server")
        except (SlotConfigError, WireError) as exc:
            if len(group) > 1:
                for op in group:
                    self._execute([op])
                return
            group[0].fail(str(exc), "user")
        except Exception:
            message = internal_error(f"operation {group[0].kind}")
            for op in group:
                if not op.done.is_set():
                    op.fail(message, "server")
        for op in group:
            outcome = "failed" if op.failure else "ok"
            log.info("op %s %s tenant=%s model=%s %s", op.kind, op.request_id, op.tenant,
                     op.model_id, outcome)  # fmt: skip

    # -- operations -----------------------------------------------------------------------------

    def _joined(self, group: list[Operation]):
        parts = [op.payload for op in group]
        batch, losses = join_rows(parts, self.config.model.micro_batch_size)
        return parts, batch, losses

    def _answer_rows(self, group, parts, logprobs) -> None:
        row = 0
        for op, part in zip(group, parts, strict=True):
            rows = []
            for x in part.inputs:
                rows.append(logprobs[row, : len(x)].astype(np.float32))
                row += 1
            body = encode_forward_backward_output(
                [{"logprobs": lp} for lp in rows], loss_sums(part, rows)
            )
            self.metrics.tokens(op.tenant, part.tokens)
            op.succeed(PROTOBUF, body)

    def _run_forward(self, group: list[Operation]) -> None:
        parts, batch, _ = self._joined(group)
        self._answer_rows(group, parts, self.executor.forward_logprobs(batch).numpy())

    def _run_forward_backward(self, group: list[Operation]) -> None:
        parts, batch, losses = self._joined(group)
        _, logprobs = self.executor.forward_backward_logprobs(batch, losses)
        self._answer_rows(group, parts, logprobs.numpy())

    def _run_optim_step(self, group: list[Operation]) -> None:
        from mizzen_train.specs import AdamParams

        params = {}
        for op in group:
            p = op.payload
            params[self.slot_of[op.model_id]] = AdamParams(
                lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps,
                weight_decay=p.weight_decay,
                max_grad_norm=p.grad_clip_norm if p.grad_clip_norm > 0 else None,
            )  # fmt: skip
        reports = self.executor.optim_step(params)
        for op in group:
            report = reports[self.slot_of[op.model_id]]
            metrics = {"stepped": float(report.stepped), "step": float(report.step)}
            if math.isfinite(report.grad_norm):  # JSON has no NaN: a skipped step omits it
                metrics["grad_norm"] = report.grad_norm
            op.succeed(JSON, _json({"metrics": metrics}))

    def _run_create_model(self, group: list[Operation]) -> None:
        op = group[0]
        record: ModelRecord = op.payload
        slot = self.slot_of[op.model_id]
        try:
            self.executor.load_slot(slot, record.rank, float(record.rank), seed=record.seed)
        except Exception:
            with self.book.cond:
                self._free_slot(op.model_id)
            raise
        self.state.add_model(record)
        op.succeed(JSON, _json({"model_id": op.model_id, "type": "create_model"}))

    def _run_unload_model(self, group: list[Operation]) -> None:
        op = group[0]
        slot = self.slot_of.get(op.model_id)
        if slot is not None:  # else unloaded already (the client's unload, then its session's end)
            if slot in self.executor.loaded_slots:
                self.executor.unload_slot(slot)
            with self.book.cond:
                self._free_slot(op.model_id)
        op.succeed(JSON, _json({"model_id": op.model_id, "type": "unload_model"}))

    def _run_save_weights(self, group: list[Operation]) -> None:
        op = group[0]
        name = op.payload or f"ckpt-{uuid.uuid4().hex[:12]}"
        slot = self.slot_of[op.model_id]
        self.state.write_checkpoint(
            op.model_id, "weights", name, lambda tmp: self.executor.save_slot(slot, str(tmp))
        )
        path = f"tinker://{op.model_id}/weights/{name}"
        op.succeed(JSON, _json({"path": path, "type": "save_weights"}))

    def _run_load_weights(self, group: list[Operation]) -> None:
        op = group[0]
        directory, with_optimizer, path = op.payload
        slot = self.slot_of[op.model_id]
        if slot in self.executor.loaded_slots:
            self.executor.unload_slot(slot)
        spec = self.executor.restore_slot(slot, str(directory))
        if not with_optimizer:  # the weights only: a fresh optimizer
            weights = self.executor.adapter_weights(slot)
            self.executor.unload_slot(slot)
            self.executor.load_slot(slot, spec.rank, spec.alpha, weights=weights)
        record = self.state.models[op.model_id]
        if (record.rank, record.seed) != (spec.rank, spec.seed):  # created by this load
            self.state.add_model(dataclasses.replace(record, rank=spec.rank, seed=spec.seed))
        op.succeed(JSON, _json({"path": path, "model_id": op.model_id, "type": "load_weights"}))

    def _run_save_weights_for_sampler(self, group: list[Operation]) -> None:
        from mizzen_train.hf import export_peft_adapter

        op = group[0]
        name, session = op.payload
        name = name or f"{UNNAMED_PREFIX}{uuid.uuid4().hex[:12]}"
        slot = self.slot_of[op.model_id]
        directory = self.state.write_checkpoint(
            op.model_id, "sampler_weights", name,
            lambda tmp: export_peft_adapter(
                tmp, executor=self.executor, slot=slot, source=self.source,
                base_model_name_or_path=str(self.model_dir),
            ),
        )  # fmt: skip
        path = f"tinker://{op.model_id}/sampler_weights/{name}"
        try:
            sampling_session_id = (
                self.publish(op.tenant, path, directory, session_of_model(op.model_id))
                if session
                else None
            )
        except WireError as exc:  # its session ended while this was queued
            op.fail(f"no sampler was opened, and the unnamed sampler weights {path} were "
                    f"discarded: {exc}", "user")  # fmt: skip
            return
        body = {"path": path, "type": "save_weights_for_sampler"}
        if sampling_session_id is not None:
            body["sampling_session_id"] = sampling_session_id
        op.succeed(JSON, _json(body))


def _json(payload: Any) -> bytes:
    import json

    return json.dumps(payload).encode()
