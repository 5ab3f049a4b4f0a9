"""Shared fixtures of the train tests: megatron-core on CPU ranks, and small GPT kits.

CPU tests run each scenario in forked worker processes, one per rank, joined by a gloo process
group (``file://`` rendezvous in a temp dir, so concurrent runs never collide on a port) and
megatron's ``parallel_state``.  megatron-core is imported here, before any fork, so a rank
inherits it and starts in well under a second; the parent pytest process itself never runs a
torch kernel (so no OpenMP pool exists to be inherited) and never touches CUDA.  Inside each
worker the ``torch.cuda`` shim of :mod:`mizzen_train.megatron_on_cpu` is installed first.

Workers report a picklable result (by value) or their traceback over a pipe; a worker that
fails makes the parent kill the other ranks (they may be blocked in a collective) and fail the
test with every rank's traceback.  The builders live in ``slot_kit.py`` (shared with the 2-GPU
worker script); GPU test files use them through ``kit`` but never the fork launcher.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import megatron.core.distributed  # pre-fork import, see the docstring
import megatron.core.models.gpt  # noqa: F401  (pre-fork import, see the docstring)
import pytest
import torch
from megatron.core import parallel_state


def _load_slot_kit():
    path = Path(__file__).with_name("slot_kit.py")
    spec = importlib.util.spec_from_file_location("mizzen_tests_train_slot_kit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


slot_kit = _load_slot_kit()


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


@pytest.fixture
def kit() -> SimpleNamespace:
    """The launcher and builders, for scenarios that run inside worker ranks."""
    return SimpleNamespace(
        run_ranks=run_ranks,
        tiny_batch=slot_kit.tiny_batch,
        tiny_executor=slot_kit.tiny_executor,
        random_adapter=slot_kit.random_adapter,
        split_dims=slot_kit.split_dims,
        join_tp_shards=slot_kit.join_tp_shards,
        TINY_GPT=slot_kit.TINY_GPT,
    )
