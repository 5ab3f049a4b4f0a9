"""mizzen-ci: the CI registry, fleet, planner, lazy-import checks and pytest plugin of mizzen.

Every ``tests/**/test_*.py`` file declares itself with one module-level call, literal arguments
only::

    from mizzen_ci import register_cpu_ci, register_cuda_ci

    register_cuda_ci(est_time=240, hardware=["hopper", "blackwell"], num_gpus=2, labels=["lora"])

Invariants:
- This package is stdlib-only and cheap to import: planning runs on a bare runner with nothing
  installed (``PYTHONPATH=ci/src python3 -S -m mizzen_ci ...``).
- The two ``register_*`` functions do nothing at run time.  The registry
  (:mod:`mizzen_ci.registry`) reads the calls from each test file's syntax tree; it never imports
  a test.  Their signatures here are the contract the reader enforces.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "register_cpu_ci", "register_cuda_ci"]


def register_cpu_ci(
    est_time: float,
    *,
    labels: list[str] | tuple[str, ...] = (),
    nightly: bool = False,
    disabled: str | None = None,
) -> None:
    """Declare this test file for the CPU lane (a no-op; read statically by the registry)."""


def register_cuda_ci(
    est_time: float,
    *,
    hardware: list[str],
    num_gpus: int = 1,
    labels: list[str],
    needs: list[str] | tuple[str, ...] = (),
    nightly: bool = False,
    disabled: str | None = None,
) -> None:
    """Declare this test file for the GPU lanes of ``hardware`` (a no-op; read statically)."""
