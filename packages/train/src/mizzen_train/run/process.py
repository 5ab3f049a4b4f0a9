"""Where a run's process trains: its device and dtype.

:func:`resolve_device` turns ``run.device`` / ``run.dtype`` (``auto`` included) into what this
machine can do.  The process's place among the run's ranks is :mod:`mizzen_train.run.parallel`'s.

Invariants:
- A device or dtype the machine cannot run is a :class:`~mizzen_train.run.config.ConfigError`
  naming the field, raised before anything is built.
- With several ranks on CUDA, each rank's ``LOCAL_RANK`` names a visible GPU.
"""

from __future__ import annotations

import os

import torch

from mizzen_train.run.config import ConfigError
from mizzen_train.run.sections import RunLayout

__all__ = ["resolve_device"]


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
    local_rank = os.environ.get("LOCAL_RANK", "0").strip()
    if device == "cuda" and local_rank.isdigit() and int(local_rank) >= torch.cuda.device_count():
        raise ConfigError(
            "LOCAL_RANK", local_rank,
            f"names no GPU: {torch.cuda.device_count()} are visible to this process",
            "launch at most as many ranks per node as it has GPUs (torchrun --nproc-per-node)",
        )  # fmt: skip
    return device, dtype
