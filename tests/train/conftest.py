"""Shared fixtures of the train tests: megatron-core on CPU ranks, and small GPT kits.

CPU tests run each scenario on forked gloo ranks started by the root launcher (the
``run_ranks`` fixture of ``tests/conftest.py``: ``file://`` rendezvous, one intra-op thread per
rank, every rank's traceback on failure, the other ranks killed), here with a megatron set-up in
each rank: the ``torch.cuda`` shim of :mod:`mizzen_train.megatron_on_cpu`, then
``parallel_state`` with the scenario's TP size.  megatron-core is imported here, before any
fork, so a rank inherits it and starts in well under a second; the parent pytest process itself
never touches CUDA.  The builders live in ``slot_kit.py`` (shared with the 2-GPU worker script);
GPU test files use them through ``kit`` but never the fork launcher.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import megatron.core.distributed  # pre-fork import, see the docstring
import megatron.core.models.gpt  # noqa: F401  (pre-fork import, see the docstring)
import pytest
from megatron.core import parallel_state


def _load_slot_kit():
    path = Path(__file__).with_name("slot_kit.py")
    spec = importlib.util.spec_from_file_location("mizzen_tests_train_slot_kit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


slot_kit = _load_slot_kit()


def _megatron_rank_setup(tp: int) -> None:
    """Per-rank set-up after the process group exists: the CPU shim, then TP ``tp``."""
    from mizzen_train.megatron_on_cpu import install_megatron_cpu_shim

    install_megatron_cpu_shim()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


@pytest.fixture
def kit(run_ranks) -> SimpleNamespace:
    """The launcher and builders, for scenarios that run inside worker ranks.

    ``kit.run_ranks(fn, world_size=1, tp=1, args=(), timeout=150.0)`` runs ``fn(*args)`` on
    forked gloo ranks (TP ``tp``, DP the rest) through the root ``run_ranks`` launcher; each
    rank's result in rank order, or AssertionError with every failed rank's traceback."""

    def megatron_ranks(
        fn: Callable[..., Any],
        *,
        world_size: int = 1,
        tp: int = 1,
        args: Sequence[Any] = (),
        timeout: float = 150.0,
    ) -> list[Any]:
        return run_ranks(
            fn,
            world_size=world_size,
            args=args,
            setup=functools.partial(_megatron_rank_setup, tp),
            timeout=timeout,
        )

    return SimpleNamespace(
        run_ranks=megatron_ranks,
        tiny_batch=slot_kit.tiny_batch,
        tiny_executor=slot_kit.tiny_executor,
        random_adapter=slot_kit.random_adapter,
        split_dims=slot_kit.split_dims,
        join_tp_shards=slot_kit.join_tp_shards,
        TINY_GPT=slot_kit.TINY_GPT,
    )
