"""Where a run's process trains: its device and dtype, and its place in the distributed world.

:func:`resolve_device` turns ``run.device`` / ``run.dtype`` (``auto`` included) into what this
machine can do; :func:`single_rank` is the world a run trains in today: one rank, megatron's
parallel state with TP = PP = 1 (gloo on a CPU, with the CPU shim; NCCL on a GPU).

Invariants:
- A device or dtype the machine cannot run is a :class:`~mizzen_train.run.config.ConfigError`
  naming the field, raised before anything is built.
- A launch under torchrun with more than one rank is refused, not run N times over.
- The process group and parallel state this module creates are destroyed on the way out; one
  that already existed (a test's) is left as it was.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch

from mizzen_train.run.config import ConfigError
from mizzen_train.run.sections import RunLayout

__all__ = ["resolve_device", "single_rank"]


def resolve_device(config: RunLayout) -> tuple[str, str]:
    """``(device, dtype)`` of the run: ``cuda``/``cpu`` and ``bf16``/``fp32``."""
    run = config.run
    cuda = torch.cuda.is_available()
    device = run.device if run.device != "auto" else ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        raise ConfigError(
            "run.device", "cuda", "no CUDA device is visible to this process",
            'use run.device = "cpu" (or "auto"), or run on a GPU machine', source=config.source,
        )  # fmt: skip
    if device == "cpu" and cuda:
        raise ConfigError(
            "run.device", "cpu", "megatron-core's CPU path needs a machine without CUDA",
            'use run.device = "cuda" (or "auto") here', source=config.source,
        )  # fmt: skip
    dtype = run.dtype if run.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    if dtype == "bf16" and device == "cpu":
        raise ConfigError(
            "run.dtype", "bf16", "bf16 training is supported on CUDA only",
            'use run.dtype = "fp32" (or "auto") on a CPU', source=config.source,
        )  # fmt: skip
    return device, dtype


@contextlib.contextmanager
def single_rank(device: str) -> Iterator[None]:
    """A world of one rank and megatron's parallel state (TP = PP = 1) for this process."""
    from megatron.core import parallel_state

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError(
            "WORLD_SIZE", os.environ["WORLD_SIZE"], "mizzen-train runs as one process",
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
    with tempfile.TemporaryDirectory(prefix="mizzen-run-rdzv-") as tmp:
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
