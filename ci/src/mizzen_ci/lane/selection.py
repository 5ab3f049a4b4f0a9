"""What a GPU lane runs: the files of a planned job, given paths, or every file of its arch —
always checked against the registry, never trusted from the command line or the plan.

Invariants:
- Lane membership is :func:`mizzen_ci.registry.declares_target`: a file that the lane does not run, that
  is not registered or whose registration is broken is an error before anything runs
  (:class:`~.refusal.LaneRefusal`, naming the file, the rule and the fix).
- A planned job must be for this lane's arch and agree with the registry on each file's GPU
  count (a stale plan is refused, not run with the wrong GPUs).
- Disabled files are listed with their reason and not run; a file needing more GPUs than the host
  has is *not runnable here*; each file is run once however often it is named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..fleet import FLEET_RELATIVE_PATH, Fleet, nox_session_name
from ..plan.model import Plan, PlanError, PlannedTest
from ..registry import Backend, Registration, Registry, Violation, declares_target, read_registry
from .refusal import LaneRefusal
from .runner import LaneFile


@dataclass
class Selection:
    """What the lane runs, what it cannot run here, what is disabled and what is broken."""

    runnable: list[LaneFile] = field(default_factory=list)
    not_runnable: list[tuple[LaneFile, str]] = field(default_factory=list)
    disabled: list[Registration] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # registry errors that fail the lane
    #: files the plan runs as the base declares them (run even where the head disabled them)
    as_planned: set[str] = field(default_factory=set)


def _why_not_in_lane(
    rel: str, reg: Registration | None, arch: str, violations: list[Violation]
) -> str | None:
    if violations:
        return "; ".join(str(v) for v in violations)
    if reg is None:
        return f"{rel}: not a registered test file (tests/**/test_*.py with a registration)"
    if declares_target(reg, arch):
        return None
    if reg.backend is Backend.CPU:
        return (
            f"{rel}:{reg.line}: registered for the cpu lane, not for {nox_session_name(arch)}. Fix: run "
            "it with `nox -s cpu`, or register it with register_cuda_ci(hardware=[...])"
        )
    return (
        f"{rel}:{reg.line}: declares hardware={list(reg.hardware)}, not {arch}. Fix: run it "
        f"with {' or '.join(f'`nox -s {nox_session_name(a)}`' for a in reg.hardware)}, or add {arch!r} "
        "to its hardware if it supports it"
    )


def _plan_tests(plan_path: Path, job_id: str, arch: str) -> tuple[PlannedTest, ...]:
    """The tests of job ``job_id`` of the planner's JSON; the job must be for ``arch``."""
    try:
        plan = Plan.load(plan_path)  # its errors name the file
    except PlanError as e:
        raise LaneRefusal(str(e)) from None
    try:
        planned = plan.job(job_id)
    except PlanError as e:
        raise LaneRefusal(f"{plan_path}: {e}") from None
    if planned.arch != arch:
        raise LaneRefusal(
            f"{plan_path}: job {job_id} is for {planned.lane!r}, not {nox_session_name(arch)}. Fix: run "
            f"`nox -s {planned.lane} -- --job {job_id} --plan {plan_path}`"
        )
    return planned.tests


# (registration, what pytest is given, estimated seconds) of one file the lane was asked to run
Chosen = tuple[Registration, str, float]


def select(
    root: Path,
    fleet: Fleet,
    arch: str,
    host_gpus: int,
    paths: list[str],
    plan: Path | None,
    job: str | None,
) -> Selection:
    """What the lane runs; :class:`LaneRefusal` for any input that does not match the registry."""
    if arch not in fleet.generation_names:
        raise LaneRefusal(
            f"unknown GPU generation {arch!r}; {FLEET_RELATIVE_PATH} has "
            f"{', '.join(fleet.generation_names)}"
        )
    if (plan is None) != (job is None):
        raise LaneRefusal("--plan and --job go together: `--job ID --plan plan.json`")
    if plan is not None and paths:
        raise LaneRefusal("give either test paths or --job/--plan, not both")
    registry = read_registry(root, fleet)
    sel = Selection()
    if plan is not None:
        chosen = _planned(registry, arch, plan, job)
        sel.as_planned = _as_planned(plan, arch)
    elif paths:
        chosen = _given(registry, arch, root, paths, sel)
    else:
        sel.broken.extend(str(v) for v in registry.violations)
        chosen = [
            (r, r.path, r.est_time) for r in registry.registrations if declares_target(r, arch)
        ]
    _sort_into(sel, chosen, arch, host_gpus)
    return sel


def _planned(registry: Registry, arch: str, plan: Path, job: str) -> list[Chosen]:
    """The files of a planned job, each checked against its registration."""
    by_path, violations = registry.by_path(), registry.violations_by_path()
    tests = _plan_tests(plan, job, arch)
    as_planned = _as_planned(plan, arch)
    chosen: list[Chosen] = []
    problems = []
    for t in tests:
        rel = t.file
        reg = by_path.get(rel)
        why = _why_not_in_lane(rel, reg, arch, violations.get(rel, []))
        if why is None and reg.num_gpus != t.num_gpus:
            why = (
                f"{rel}: the plan says num_gpus={t.num_gpus}, the registration "
                f"{reg.num_gpus}. Fix: re-plan (`nox -s plan`)"
            )
        if why:
            problems.append(why)
            continue
        if rel in as_planned:  # the base runs it for this change, whatever the head disabled
            reg = dataclasses.replace(reg, disabled=None)
        chosen.append((reg, rel, t.est_seconds if t.est_seconds > 0 else reg.est_time))
    if problems:
        raise LaneRefusal("the plan does not match the registry:\n  " + "\n  ".join(problems))
    if not tests:
        raise LaneRefusal(f"{plan}: job {job} has no tests")
    return chosen


def _as_planned(plan: Path, arch: str) -> set[str]:
    """The files the plan runs on ``arch`` as the base declares them (its overrides)."""
    return {o.file for o in Plan.load(plan).overrides if o.arch in (None, arch)}


def _given(
    registry: Registry, arch: str, root: Path, paths: list[str], sel: Selection
) -> list[Chosen]:
    """The files (or every file of the lane under a directory) named on the command line; a
    broken file under a named directory goes to ``sel.broken``."""
    by_path, violations = registry.by_path(), registry.violations_by_path()
    chosen: list[Chosen] = []
    problems = []
    for given in paths:
        file_part, sep, node = given.partition("::")
        p = Path(file_part)
        p = (p if p.is_absolute() else Path.cwd() / p).resolve()
        try:
            rel = p.relative_to(root).as_posix()
        except ValueError:
            problems.append(f"{given}: not inside the repository {root}")
            continue
        if p.is_dir():
            prefix = "" if rel == "." else rel + "/"
            under = [r for r in registry.registrations if r.path.startswith(prefix)]
            under = [r for r in under if declares_target(r, arch)]
            broken = sorted(b for b in violations if b.startswith(prefix))
            sel.broken.extend(str(v) for b in broken for v in violations[b])
            chosen.extend((r, r.path, r.est_time) for r in under)
            if not under and not broken:
                problems.append(f"{given}: no test under it declares {arch}")
            continue
        if not p.is_file():
            problems.append(f"{given}: no such file")
            continue
        reg = by_path.get(rel)
        why = _why_not_in_lane(rel, reg, arch, violations.get(rel, []))
        if why:
            problems.append(why)
        else:
            chosen.append((reg, rel + sep + node, reg.est_time))
    if problems:
        raise LaneRefusal(
            f"refusing to run files that {nox_session_name(arch)} does not run:\n  "
            + "\n  ".join(problems)
        )
    return chosen


def _sort_into(sel: Selection, chosen: list[Chosen], arch: str, host_gpus: int) -> None:
    """Each chosen file once: disabled, not runnable on this host, or runnable."""
    seen: set[str] = set()
    for reg, target, est in chosen:
        if target in seen:
            continue
        seen.add(target)
        if not reg.enabled:
            sel.disabled.append(reg)
            continue
        lf = LaneFile(
            reg.path, target, reg.num_gpus, est, reg.shares_gpu, reg.path in sel.as_planned
        )
        if reg.num_gpus > host_gpus:
            sel.not_runnable.append(
                (lf, f"needs {reg.num_gpus} GPUs, this host has {host_gpus} {arch} GPU(s)")
            )
        else:
            sel.runnable.append(lf)


# --------------------------------------------------------------------------------------------
