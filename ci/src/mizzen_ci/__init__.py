"""mizzen-ci: the CI registry, fleet, planner, lazy-import checks and pytest plugin of mizzen.

Every ``tests/**/test_*.py`` file declares itself with one module-level call, literal arguments
only::

    from mizzen_ci import register_cpu_ci, register_cuda_ci, register_gpu_ci

    register_cuda_ci(est_time=240, hardware=["hopper", "blackwell"], num_gpus=2, labels=["lora"])
    register_gpu_ci(est_time=300, hardware=["hopper", "cdna3"], num_gpus=8, labels=["train"])

``register_gpu_ci`` is the one GPU declaration whatever the vendor: its ``hardware`` lists NVIDIA
and AMD generations alike.  ``register_cuda_ci`` is the same call restricted to NVIDIA generations
(the files written before AMD generations existed keep meaning exactly what they said).

Invariants:
- This package is stdlib-only and cheap to import: planning runs on a bare runner with nothing
  installed (``PYTHONPATH=ci/src python3 -S -m mizzen_ci ...``).
- The ``register_*`` functions do nothing at run time.  The registry
  (:mod:`mizzen_ci.registry`) reads the calls from each test file's syntax tree; it never imports
  a test.  Their signatures here are the contract the reader enforces.
- :func:`register_ci_gate` is the same kind of declaration for the metric gate
  (:mod:`mizzen_ci.gate`): zero or more module-level calls per test file, one per metric, read from
  the syntax tree by :mod:`mizzen_ci.gate.declarations`; values are recorded with
  :func:`mizzen_ci.metrics.record`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "register_ci_gate",
    "register_cpu_ci",
    "register_cuda_ci",
    "register_gpu_ci",
]


def register_cpu_ci(
    est_time: float,
    *,
    labels: list[str] | tuple[str, ...] = (),
    nightly: bool = False,
    disabled: str | None = None,
    watches: list[str] | tuple[str, ...] = (),
) -> None:
    """Declare this test file for the CPU lane (a no-op; read statically by the registry).

    ``est_time``: expected wall seconds.  ``labels``: domain labels from ``ci/fleet.toml``.
    ``nightly``: runs on the nightly schedule only.  ``disabled``: why it does not run.
    ``watches``: globs of repository paths (``*`` and ``?`` within a segment, ``**`` across
    segments, e.g. ``["packages/*/src/**/*.py"]``) whose change selects this file, for what it
    depends on that no import or path literal shows (it imports every module in a subprocess, or
    copies a source tree).  Relative POSIX globs, no ``..``; at most 32, each at most 200
    characters."""


def register_cuda_ci(
    est_time: float,
    *,
    hardware: list[str],
    num_gpus: int = 1,
    labels: list[str],
    needs: list[str] | tuple[str, ...] = (),
    nightly: bool = False,
    disabled: str | None = None,
    watches: list[str] | tuple[str, ...] = (),
    shares_gpu: bool = False,
) -> None:
    """Declare this test file for the GPU lanes of ``hardware``, NVIDIA generations only (a no-op;
    read statically).  A test that also runs on AMD GPUs uses :func:`register_gpu_ci`.

    ``hardware``: the NVIDIA generations it supports (from ``ci/fleet.toml``); ``num_gpus``: how
    many it needs; ``needs``: capabilities such as ``rdma``; ``shares_gpu=True`` (one GPU only):
    the file uses at most a quarter of the smallest GPU of its generations (memory and compute)
    and runs correctly beside other such files, so a lane may run up to four of them on one GPU
    at once (``mizzen-ci gpu-lane --gpu-seats``); the other arguments as for
    :func:`register_cpu_ci`."""


def register_gpu_ci(
    est_time: float,
    *,
    hardware: list[str],
    num_gpus: int = 1,
    labels: list[str],
    needs: list[str] | tuple[str, ...] = (),
    nightly: bool = False,
    disabled: str | None = None,
    watches: list[str] | tuple[str, ...] = (),
    shares_gpu: bool = False,
) -> None:
    """Declare this test file for the GPU lanes of ``hardware``, whatever their vendor (a no-op;
    read statically): ``hardware=["hopper", "cdna3"]`` runs on H200s by default and on MI300Xs
    when asked (``run-on-cdna3``, the weekly schedule).

    The arguments are those of :func:`register_cuda_ci`; ``hardware`` may name any generation of
    ``ci/fleet.toml``, NVIDIA or AMD."""


def register_ci_gate(
    *,
    metric: str,
    direction: str,
    tolerance: float,
    steps: str | list[int] = "last",
    floor: float = 0.0,
    enforce: bool = True,
    reason: str | None = None,
) -> None:
    """Declare a metric gate on this test file (a no-op; read statically by the gate).

    ``metric``: a name from ``ci/metrics.toml``; ``direction``: which way is better (``"lower"``
    for a loss, ``"higher"`` for a score, ``"both"`` for a value that must not drift);
    ``tolerance``: the band as a fraction of the reference (0.1 = 10 %), widened to the history's
    noise and to ``floor`` (absolute); ``steps``: ``"last"``, ``"all"`` or a list of steps;
    ``enforce=False`` (with a ``reason``) reports a failure as a warning."""
