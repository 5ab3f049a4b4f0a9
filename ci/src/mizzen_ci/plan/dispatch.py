"""Arch dispatch policy: on which GPU generations (and pools) a CUDA registration runs.

Invariants:
- A test only ever runs on a generation whose lane runs it (:func:`mizzen_ci.registry.declares_target`:
  one it declared) and on a pool derived from the fleet (:meth:`mizzen_ci.fleet.Fleet.pool_for`);
  nothing here names a pool or a runner label.
- The *home* arch of a test is the first generation in the fleet's preference order that the test
  declares and that some pool can host (GPU count and capabilities).
- Every arch considered and not used comes back with a reason, so the planner can say why.

Policies:
- ``AUTO``: the home arch only (pull requests, nightly).
- ``EXPLICIT``: the requested arches (``run-on-<arch>`` labels, workflow_dispatch).
- ``ALL``: every declared arch the fleet can host (weekly).
``leave_home`` is the switch that lets a test leave its own arch at all: when off, the home arch
always runs and EXPLICIT/ALL only *add* arches; when on, EXPLICIT runs exactly what was asked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..fleet import Fleet, Pool
from ..registry import Registration, declares_target


class Mode(enum.Enum):
    AUTO = "auto"
    EXPLICIT = "explicit"
    ALL = "all"


@dataclass(frozen=True)
class DispatchPolicy:
    mode: Mode = Mode.AUTO
    arches: tuple[str, ...] = ()
    leave_home: bool = False


@dataclass(frozen=True)
class Placement:
    arch: str
    pool: Pool


def home_generation(reg: Registration, fleet: Fleet) -> str | None:
    """The first declared generation, in preference order, that a pool of the fleet can host."""
    for arch in fleet.generation_names:
        if declares_target(reg, arch) and fleet.pool_for(arch, reg.num_gpus, set(reg.needs)):
            return arch
    return None


def why_not_hostable(reg: Registration, fleet: Fleet, arch: str) -> str | None:
    """``None`` when ``arch`` can run ``reg``, else the reason."""
    if not declares_target(reg, arch):
        return f"does not declare {arch}"
    if not fleet.pools_of(arch):
        return f"arch not in fleet: no {arch} pool"
    if not fleet.pool_for(arch, reg.num_gpus, set(reg.needs)):
        needs = f" with {', '.join(reg.needs)}" if reg.needs else ""
        return f"no {arch} pool has {reg.num_gpus} GPU(s){needs}"
    return None


def dispatch(
    reg: Registration, fleet: Fleet, policy: DispatchPolicy
) -> tuple[list[Placement], list[tuple[str, str]]]:
    """(placements, [(arch, reason not placed)]) for a CUDA registration under ``policy``."""
    home = home_generation(reg, fleet)
    if policy.mode is Mode.AUTO:
        wanted = [home] if home else []
    elif policy.mode is Mode.EXPLICIT:
        wanted = list(dict.fromkeys(policy.arches))
    else:
        wanted = list(reg.hardware)
    if not policy.leave_home and home and home not in wanted:
        wanted.insert(0, home)

    placed: list[Placement] = []
    skipped: list[tuple[str, str]] = []
    for arch in wanted:
        reason = why_not_hostable(reg, fleet, arch)
        if reason:
            skipped.append((arch, reason))
        else:
            placed.append(Placement(arch, fleet.pool_for(arch, reg.num_gpus, set(reg.needs))))
    if home is None:
        skipped.extend(
            (a, why_not_hostable(reg, fleet, a) or "unhostable")
            for a in reg.hardware
            if a not in wanted
        )
    return placed, skipped
