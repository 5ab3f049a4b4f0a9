"""What the registry knows: registrations, the rule violations it found, and what each runs on.

Invariants:
- A :class:`Registration` is what one test file declared, defaults filled in; its ``backend`` is a
  :class:`Backend`.  ``Registration(*row)`` of the plain row a content-hash cache keeps (its
  fields in order, the backend as a string) equals the registration the row was made from.
- A :class:`Violation` names ``file:line``, the rule broken, what is wrong and the fix.
- :func:`declares_target` is the one predicate "does this file run on this target": the pytest
  plugin, ``list --lane``, the GPU lane and the planner all ask it.  A *target* is ``"cpu"``
  (:data:`CPU_LANE`) or a GPU generation of the fleet (never a nox session name such as
  ``gpu-hopper``: that is :func:`mizzen_ci.fleet.nox_session_name` of a generation); a disabled
  file belongs to its target (reported there, not run).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from ..fleet import CPU_LANE


class Backend(enum.StrEnum):
    """Which register function declared a file, i.e. where it runs: the CPU lane
    (``register_cpu_ci``), or the GPU lanes of its generations — NVIDIA ones only
    (``register_cuda_ci``) or any vendor's (``register_gpu_ci``)."""

    CPU = "cpu"
    CUDA = "cuda"
    GPU = "gpu"

    @property
    def is_gpu(self) -> bool:
        return self is not Backend.CPU


@dataclass(frozen=True)
class Violation:
    """One broken rule: where, which rule, what is wrong and how to fix it."""

    path: str
    line: int
    rule: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}. Fix: {self.fix}"


@dataclass(frozen=True)
class Registration:
    """What one test file declared (defaults filled in from the register function's signature)."""

    path: str  # repository-relative, POSIX separators
    line: int
    backend: Backend
    est_time: float
    labels: tuple[str, ...] = ()
    nightly: bool = False
    disabled: str | None = None
    hardware: tuple[str, ...] = ()
    num_gpus: int = 0
    needs: tuple[str, ...] = ()
    watches: tuple[str, ...] = ()  # globs of paths whose change selects this file
    shares_gpu: bool = False  # may run beside other such files on one GPU (GPU tests, 1 GPU)

    def __post_init__(self) -> None:
        if type(self.backend) is not Backend:  # a plain string from a cached row
            object.__setattr__(self, "backend", Backend(self.backend))

    @property
    def enabled(self) -> bool:
        return self.disabled is None

    @property
    def gpu_seconds(self) -> float:
        return self.est_time * max(self.num_gpus, 1)


def declares_target(reg: Registration, target: str) -> bool:
    """Whether the file of ``reg`` runs on ``target`` (:data:`CPU_LANE` or a GPU generation)."""
    if target == CPU_LANE:
        return reg.backend is Backend.CPU
    return reg.backend.is_gpu and target in reg.hardware


@dataclass
class Registry:
    """The registrations and rule violations of one tree."""

    root: Path
    registrations: list[Registration] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    def by_path(self) -> dict[str, Registration]:
        return {r.path: r for r in self.registrations}

    def violations_by_path(self) -> dict[str, list[Violation]]:
        out: dict[str, list[Violation]] = {}
        for v in self.violations:
            out.setdefault(v.path, []).append(v)
        return out


class RuleBroken(Exception):
    """Raised inside the readers for one broken rule; becomes a :class:`Violation` (or a problem
    tuple before the path is known).  Never escapes the registry."""

    def __init__(self, rule: str, message: str, fix: str):
        super().__init__(message)
        self.rule, self.message, self.fix = rule, message, fix
