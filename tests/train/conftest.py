"""Shared fixtures of the train tests: megatron-core on CPU ranks, and small GPT kits.

CPU tests run each scenario in forked worker processes, one per rank, joined by a gloo process
group (``file://`` rendezvous in a temp dir, so concurrent runs never collide on a port) and
megatron's ``parallel_state``.  Forking after megatron-core is imported here keeps a rank's
start-up to well under a second; the parent pytest process itself never runs a torch kernel (so
no OpenMP pool exists to be inherited) and never touches CUDA.  Inside each worker the
``torch.cuda`` shim of :mod:`mizzen_train.megatron_on_cpu` is installed before anything else.

Workers report a picklable result (by value) or their traceback over a pipe; a worker that fails makes
the parent kill the other ranks (they may be blocked in a collective) and fail the test with
every rank's traceback.  GPU test files in this directory use only :func:`tiny_batch` and the
kits, never the fork launcher.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

# Imported here, before any fork, so workers inherit them instead of importing them again.
import megatron.core.models.gpt  # noqa: F401
import megatron.core.distributed  # noqa: F401
from megatron.core import parallel_state

from mizzen_train.batch import SlotBatch
from mizzen_train.executor import SlotExecutor
from mizzen_train.gpt import GPTSpec, build_gpt
from mizzen_train.specs import ExecutorConfig

TINY_GPT = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)


def _rank_main(
    rank: int,
    world_size: int,
    tp: int,
    init_file: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    conn,
) -> None:
    status, payload = "error", "worker did not start"
    try:
        from mizzen_train.megatron_on_cpu import install_megatron_cpu_shim

        install_megatron_cpu_shim()
        torch.set_num_threads(1)
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        status, payload = "ok", fn(*args)
    except BaseException:
        status, payload = "error", traceback.format_exc()
    try:
        try:
            message = pickle.dumps((status, payload))
        except Exception:
            message = pickle.dumps(("error", "unpicklable result:\n" + traceback.format_exc()))
        # Plain pickle (by value): torch registers fd-sharing reducers with multiprocessing's
        # pickler, which would need this process alive after it exits.
        conn.send_bytes(message)
        conn.close()
    finally:
        # Skip the parent's (pytest's) exit handlers inherited through fork.
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int = 1,
    tp: int = 1,
    args: Sequence[Any] = (),
    timeout: float = 150.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` forked gloo ranks (TP ``tp``, DP the rest).

    Returns each rank's result in rank order; raises AssertionError with every failed rank's
    traceback (or a timeout) otherwise."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="mizzen-gloo-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        pipes, procs = [], []
        for rank in range(world_size):
            parent_end, child_end = context.Pipe(duplex=False)
            proc = context.Process(
                target=_rank_main,
                args=(rank, world_size, tp, init_file, fn, tuple(args), child_end),
                daemon=True,
            )
            proc.start()
            child_end.close()
            pipes.append(parent_end)
            procs.append(proc)
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        while len(results) < world_size:
            now = time.monotonic()
            if now > deadline or (first_failure is not None and now > first_failure + 10):
                break
            for rank, pipe in enumerate(pipes):
                if rank in results or not pipe.poll(0.05):
                    continue
                try:
                    results[rank] = pickle.loads(pipe.recv_bytes())
                except EOFError:
                    results[rank] = ("error", "worker exited without a result")
                if results[rank][0] != "ok" and first_failure is None:
                    first_failure = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank not in results and not proc.is_alive() and not pipes[rank].poll():
                    results[rank] = ("error", f"worker exited with code {proc.exitcode}")
                    first_failure = first_failure or time.monotonic()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    problems = []
    for rank in range(world_size):
        status, payload = results.get(rank, ("error", f"no result within {timeout:.0f} s"))
        if status != "ok":
            problems.append(f"--- rank {rank} ---\n{payload}")
    if problems:
        raise AssertionError("distributed scenario failed:\n" + "\n".join(problems))
    return [results[rank][1] for rank in range(world_size)]


def tiny_batch(
    row_slots: Sequence[int],
    *,
    seq_len: int = 16,
    vocab_size: int = TINY_GPT.vocab_size,
    seed: int = 0,
    with_policy_fields: bool = False,
) -> SlotBatch:
    """A host batch with one row per entry of ``row_slots`` (a slot id, -1 = base only).

    Targets follow a fixed per-slot permutation of the inputs, so each slot has something
    learnable that differs from the others'."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(row_slots)
    input_ids = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    target_ids = torch.empty_like(input_ids)
    for row, slot in enumerate(row_slots):
        shift = 1 + 7 * (slot + 1)
        target_ids[row] = (input_ids[row] * 3 + shift) % vocab_size
    slot_ids = torch.tensor(row_slots, dtype=torch.int64).unsqueeze(1).expand(rows, seq_len)
    loss_mask = torch.ones(rows, seq_len, dtype=torch.bool)
    loss_mask[:, :2] = False
    fields: dict[str, torch.Tensor] = {}
    if with_policy_fields:
        fields["old_logprobs"] = -torch.rand(rows, seq_len, generator=generator) - 4.0
        fields["advantages"] = torch.randn(rows, seq_len, generator=generator)
    return SlotBatch(
        input_ids=input_ids,
        target_ids=target_ids,
        loss_mask=loss_mask,
        slot_ids=slot_ids.clone(),
        **fields,
    )


def tiny_executor(
    *,
    num_slots: int = 2,
    max_rank: int = 8,
    micro_batch_size: int = 2,
    gpt: GPTSpec = TINY_GPT,
    device: str = "cpu",
    target_modules: Sequence[str] | None = None,
) -> SlotExecutor:
    """A tiny GPT (hidden 64, 2 layers) under a slot executor, on the current parallel state."""
    model = build_gpt(gpt, device=device)
    extra = {} if target_modules is None else {"target_modules": tuple(target_modules)}
    config = ExecutorConfig(
        num_slots=num_slots, max_rank=max_rank, micro_batch_size=micro_batch_size, **extra
    )
    return SlotExecutor(model, config)


def random_adapter(
    executor: SlotExecutor, rank: int, *, seed: int, magnitude: float = 0.2
) -> dict[str, torch.Tensor]:
    """Full true-rank factors with every entry non-zero (a fresh slot's B is zero)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.rand(shape, generator=generator) - 0.5) * 2 * magnitude
        for name, shape in executor.adapter_shapes(rank).items()
    }


def split_dims(executor: SlotExecutor) -> dict[str, int | None]:
    """Factor name -> the dimension its TP shards split (None: replicated)."""
    return {factor.name: factor.split_dim for factor in executor.layout}


def join_tp_shards(
    per_rank: Sequence[dict[str, torch.Tensor]], dims: dict[str, int | None]
) -> dict[str, torch.Tensor]:
    """Full factors from every TP rank's local shards (replicated ones must agree exactly)."""
    joined = {}
    for name, dim in dims.items():
        parts = [shards[name] for shards in per_rank]
        if dim is None:
            for part in parts[1:]:
                assert torch.equal(part, parts[0]), f"{name}: replicated factor differs across TP"
            joined[name] = parts[0]
        else:
            joined[name] = torch.cat(parts, dim=dim)
    return joined


@pytest.fixture
def kit() -> SimpleNamespace:
    """The launcher and builders, for scenarios that run inside worker ranks."""
    return SimpleNamespace(
        run_ranks=run_ranks,
        tiny_batch=tiny_batch,
        tiny_executor=tiny_executor,
        random_adapter=random_adapter,
        split_dims=split_dims,
        join_tp_shards=join_tp_shards,
        TINY_GPT=TINY_GPT,
    )
