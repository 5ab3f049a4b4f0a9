"""Fixtures of the train tests: megatron-core on CPU ranks and small GPT kits (``kit``), train
runs as real subprocesses (``sft``, ``rl``).  Each fixture hands out one typed object.

- ``kit`` (:class:`MegatronKit`): CPU tests run each scenario on forked gloo ranks started by the
  root launcher (the ``run_ranks`` fixture of ``tests/conftest.py``: ``file://`` rendezvous, one
  intra-op thread per rank, every rank's traceback on failure, the other ranks killed), here with
  a megatron set-up in each rank: the ``torch.cuda`` shim of :mod:`mizzen_train.megatron_on_cpu`,
  then ``parallel_state`` with the scenario's TP size.  The builders live in
  ``slots/slot_kit.py`` (shared with the 2-GPU worker script beside it); GPU test files use them
  through ``kit`` but never the fork launcher.
- ``sft`` (:class:`e2e_runs.SftRuns`) and ``rl`` (:class:`e2e_runs.RlRuns`): the e2e protocols,
  defined in ``e2e_runs.py`` beside this file; ``sft`` also writes the small run of the CLI and
  run-directory tests and runs ``python -m mizzen_train`` commands to completion (``cli``).

Invariants: megatron-core (and ``slot_kit.py``) is imported by the ``kit`` fixture, before any
fork, so a rank inherits it and starts in well under a second; nothing here imports megatron at
collection (the e2e files, whose runs are subprocesses, do not pay its ~16 s import in the pytest
process); the parent pytest process never touches CUDA.  Helper modules are loaded by path under
private names (test files never import them, nor each other).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from mizzen_train.batch import SlotBatch
    from mizzen_train.executor import SlotExecutor
    from mizzen_train.gpt import GPTSpec

HERE = Path(__file__).parent


def _load_helper(path: Path, name: str) -> ModuleType:
    """The helper file ``path`` as the module ``name`` (registered in ``sys.modules``, so its
    classes pickle and its dataclasses resolve their annotations)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Standard library only: loaded at collection, cheap.
e2e_runs = _load_helper(HERE / "e2e_runs.py", "mizzen_tests_train_e2e_runs")


@functools.cache
def _load_slot_kit() -> ModuleType:
    """``slots/slot_kit.py`` as a module, megatron-core imported with it (the pre-fork import)."""
    import megatron.core.distributed
    import megatron.core.models.gpt  # noqa: F401

    return _load_helper(HERE / "slots/slot_kit.py", "mizzen_tests_train_slot_kit")


def _megatron_rank_setup(tp: int, cp: int = 1) -> None:
    """Per-rank set-up after the process group exists: the CPU shim, then TP ``tp`` and
    context parallel ``cp``."""
    from megatron.core import parallel_state

    from mizzen_train.megatron_on_cpu import install_megatron_cpu_shim

    install_megatron_cpu_shim()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )


@dataclass(frozen=True)
class MegatronKit:
    """Scenarios on megatron-core ranks: the launcher (:meth:`run_ranks`) and the tiny-GPT
    builders of ``slots/slot_kit.py`` that the scenarios use."""

    launcher: Callable[..., list[Any]]  # the root ``run_ranks`` fixture
    tiny_batch: Callable[..., SlotBatch]
    tiny_executor: Callable[..., SlotExecutor]
    random_adapter: Callable[..., dict[str, torch.Tensor]]
    split_dims: Callable[[SlotExecutor], dict[str, int | None]]
    join_tp_shards: Callable[..., dict[str, torch.Tensor]]
    TINY_GPT: GPTSpec

    def run_ranks(
        self,
        fn: Callable[..., Any],
        *,
        world_size: int = 1,
        tp: int = 1,
        cp: int = 1,
        args: Sequence[Any] = (),
        timeout: float = 150.0,
    ) -> list[Any]:
        """``fn(*args)`` on forked gloo ranks (TP ``tp``, CP ``cp``, DP the rest) through the
        root launcher; each rank's result in rank order, or AssertionError with every failed
        rank's traceback."""
        return self.launcher(
            fn,
            world_size=world_size,
            args=args,
            setup=functools.partial(_megatron_rank_setup, tp, cp),
            timeout=timeout,
        )


@pytest.fixture
def kit(run_ranks: Callable[..., list[Any]]) -> MegatronKit:
    """The megatron rank launcher and the tiny-GPT builders (megatron-core imported here)."""
    slot_kit = _load_slot_kit()
    return MegatronKit(
        launcher=run_ranks,
        tiny_batch=slot_kit.tiny_batch,
        tiny_executor=slot_kit.tiny_executor,
        random_adapter=slot_kit.random_adapter,
        split_dims=slot_kit.split_dims,
        join_tp_shards=slot_kit.join_tp_shards,
        TINY_GPT=slot_kit.TINY_GPT,
    )


@pytest.fixture(scope="session")
def sft() -> e2e_runs.SftRuns:
    """Write SFT configurations (the e2e colours run, the small run of the CLI and run-directory
    tests), launch ``python -m mizzen_train`` subprocesses or run them to completion (``cli``),
    read their metrics and find the engine processes they start; run the e2e protocols (an
    uninterrupted run, a killed-and-resumed one, or both at once with ``side_by_side``).
    Session-scoped (module-scoped fixtures use it): the object keeps no state."""
    return e2e_runs.SftRuns()


@pytest.fixture
def rl() -> e2e_runs.RlRuns:
    """The RL e2e protocol: the toy two-tenant configuration, the reference-and-faulty run pair
    (NaN injection, SIGKILL, --resume) and the per-run checks."""
    return e2e_runs.RlRuns()


@pytest.fixture(scope="module")
def nccl_rank():
    """World of one NCCL rank on GPU 0 with megatron's parallel state at TP 1 (the GPU files)."""
    import os
    import tempfile

    import torch
    from megatron.core import parallel_state

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="mizzen-nccl-") as tmp:
        torch.distributed.init_process_group(
            "nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
