"""Shared fixtures of the tests/gpu tests: the numeric checks and the all-reduce workers.

- ``numerics``: ``numerics.py`` (bf16 matmul bound and check, CUDA-graph replay check, each a
  function of a device);
- ``allreduce``: ``allreduce_worker.py`` (``run_workers(backend, device_kind)``: two worker
  processes started from that script).

Both are plain modules loaded here by path (test modules are imported by path, so a helper is no
importable module either): the GPU test files and the CPU-lane file that runs the same checks on
``device="cpu"`` share one copy of each, and the planner sees that they do.  A fixture loads its
module when first asked for (that imports torch; it touches no device).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def _load_helper(name: str) -> ModuleType:
    """The helper module ``tests/gpu/NAME.py``, loaded by path under a private name."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"mizzen_tests_gpu_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def numerics() -> ModuleType:
    """``BF16_EPS``, ``bf16_matmul_bound(a, b)``, ``bf16_matmul_excess(device, m, k, n)``,
    ``cuda_graph_replay_excess(device)`` (see ``numerics.py``)."""
    return _load_helper("numerics")


@pytest.fixture(scope="session")
def allreduce() -> ModuleType:
    """``WORLD``, ``run_workers(backend, device_kind)`` (see ``allreduce_worker.py``)."""
    return _load_helper("allreduce_worker")
