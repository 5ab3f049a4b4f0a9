"""Selection: which (test file, arch) pairs a plan schedules, and why every other one is not.

Inputs: the registry, the fleet, the :class:`~mizzen_ci.plan.request.Request` (what the event
asks for) and the :class:`~mizzen_ci.plan.impact.Impact` of the change.

Invariants:
- Every registered test file comes out either scheduled (with the reason it was selected) or
  in ``not_scheduled`` with one reason per (file, arch): disabled (with its reason), nightly-only,
  not impacted / not asked for, author not trusted, not the auto arch, arch not in fleet, or a
  registry error.  Nothing disappears silently.
- Lane membership is :func:`mizzen_ci.registry.declares_target`; arches and pools come from
  :func:`mizzen_ci.plan.dispatch.dispatch` (the fleet table); this module never names a pool.
- A GPU test on a pull request runs when the change impacts it or a label/comment asks for one of
  its labels (or for all); CPU tests run when impacted, or always outside pull requests.
- With rerun commands (``request.rerun``) the change's impact is not consulted: the files asked
  for run (a nightly-only one too), labels still add their GPU tests, every other file is not
  asked for; an asked-for path that is no registered test file is a warning naming why (a
  registry error such as a link, or not registered at all).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fleet import CPU_LANE, CpuPool, Fleet, Pool
from ..registry import Registration, Violation, declares_target
from .dispatch import DispatchPolicy, Mode, dispatch, home_generation
from .impact import Impact
from .model import NotScheduled
from .request import RUN_CI_ALL, RUN_CI_PREFIX, RUN_ON_PREFIX, Request

# Reason codes of not-scheduled entries (the text says the rest).
DISABLED = "disabled"
NIGHTLY_ONLY = "nightly-only"
NOT_IMPACTED = "not-impacted"
UNTRUSTED = "untrusted"
NOT_AUTO_ARCH = "not-auto-arch"
NOT_HOSTABLE = "arch-not-in-fleet"
REGISTRY_ERROR = "registry-error"


@dataclass(frozen=True)
class Selected:
    """A (test file, arch) the plan runs: the registration, the arch (None: the CPU lane), the
    pool derived for it and why it was selected."""

    reg: Registration
    arch: str | None
    pool: Pool | CpuPool
    why: str


def select(
    registrations: list[Registration],
    violations: list[Violation],
    fleet: Fleet,
    request: Request,
    impact: Impact,
) -> tuple[list[Selected], list[NotScheduled], list[str]]:
    """``(selected, not scheduled, warnings)`` (see the module docstring)."""
    selected: list[Selected] = []
    skipped: list[NotScheduled] = []
    policy = DispatchPolicy(mode=request.arch_mode, arches=request.arches)
    homes: dict[tuple, str | None] = {}  # home_generation depends only on what a test declares

    for reg in registrations:
        home = None
        if not declares_target(reg, CPU_LANE):
            declared = (reg.hardware, reg.num_gpus, reg.needs)
            home = homes.get(declared, homes)
            if home is homes:
                home = homes[declared] = home_generation(reg, fleet)
        if not reg.enabled:
            skipped.append(NotScheduled(reg.path, home, DISABLED, f"disabled: {reg.disabled}"))
            continue
        rerun = request.rerun.get(reg.path) if request.rerun is not None else None
        if reg.nightly and not request.include_nightly and rerun is None:
            skipped.append(
                NotScheduled(
                    reg.path, home, NIGHTLY_ONLY, "nightly-only: runs on the nightly schedule"
                )
            )
            continue
        impacted = impact.why(reg.path) if request.rerun is None else rerun
        if declares_target(reg, CPU_LANE):
            if request.rerun is not None and rerun is None:
                skipped.append(
                    NotScheduled(reg.path, None, NOT_IMPACTED, "not asked for by the rerun")
                )
            elif request.cpu_all:
                selected.append(Selected(reg, None, fleet.cpu_pool, f"{request.event}: all CPU"))
            elif impacted:
                selected.append(Selected(reg, None, fleet.cpu_pool, impacted))
            else:
                skipped.append(
                    NotScheduled(reg.path, None, NOT_IMPACTED, "not impacted by the change")
                )
            continue

        why = rerun or _gpu_wanted(reg, request, impacted)
        if why is None:
            asks = ", ".join(f"{RUN_CI_PREFIX}{label}" for label in reg.labels)
            skipped.append(
                NotScheduled(
                    reg.path,
                    home,
                    NOT_IMPACTED,
                    f"not impacted by the change and not asked for ({asks} or {RUN_CI_ALL})",
                )
            )
            continue
        if request.gpu_blocked:
            skipped.append(NotScheduled(reg.path, home, UNTRUSTED, request.gpu_blocked))
            continue
        placements, unplaced = dispatch(reg, fleet, policy)
        for p in placements:
            selected.append(Selected(reg, p.arch, p.pool, why))
        accounted = {p.arch for p in placements}
        for arch, reason in unplaced:
            if arch in reg.hardware and arch not in accounted:
                accounted.add(arch)
                skipped.append(NotScheduled(reg.path, arch, NOT_HOSTABLE, reason))
        for arch in reg.hardware:
            if arch not in accounted:
                skipped.append(
                    NotScheduled(
                        reg.path,
                        arch,
                        NOT_AUTO_ARCH,
                        f"runs on its auto arch {home}; {RUN_ON_PREFIX}{arch} (or the weekly "
                        "schedule) runs it here",
                    )
                )
        if policy.mode is Mode.EXPLICIT and not placements and not unplaced:
            skipped.append(NotScheduled(reg.path, home, NOT_HOSTABLE, "no arch could host it"))

    first_error: dict[str, Violation] = {}
    for v in violations:
        first_error.setdefault(v.path, v)
    warnings = []
    registered = {reg.path for reg in registrations}
    for path in request.rerun or {}:
        if path in first_error:
            v = first_error[path]
            warnings.append(f"rerun of {path} refused: registry error [{v.rule}] {v.message}")
        elif path not in registered:
            warnings.append(
                f"rerun of {path} refused: it is not a registered test file of this checkout"
            )
    for path, first in sorted(first_error.items()):
        skipped.append(
            NotScheduled(
                path, None, REGISTRY_ERROR, f"registry error: [{first.rule}] {first.message}"
            )
        )
    return selected, skipped, warnings


def _gpu_wanted(reg: Registration, request: Request, impacted: str | None) -> str | None:
    """Why a GPU test is wanted by this request (``None``: it is not)."""
    if request.gpu_all:
        return f"{request.cadence or request.event}: every GPU test"
    if request.gpu_impacted and impacted:
        return impacted
    if request.gpu_every_label:
        return f"asked for by {RUN_CI_ALL}"
    asked = sorted(set(reg.labels) & request.gpu_labels)
    if asked:
        return f"asked for by {', '.join(RUN_CI_PREFIX + label for label in asked)}"
    return None
