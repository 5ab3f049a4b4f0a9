"""The PR planner: from a change, an event and the registry to jobs on matching runners.

:func:`build_plan` runs the pipeline: request (:mod:`.request`) → the tree's index
(:mod:`.index`: registry and reverse import index, one parse per file, warm from its cache) →
impact analysis (:mod:`.impact`; with ``[tool.mizzen.plan] observed-selection``, united with the
tests that executed a changed file at the base: :mod:`.observed`) → selection (:mod:`.selection`), with the runs the base revision's
registrations keep (:mod:`.base_runs`, read from git outside every cache) → estimates
(:mod:`mizzen_ci.history`) → packing per pool (:mod:`.jobs`) → a :class:`~.model.Plan`.

Invariants:
- Stdlib only; never imports a test.  Deterministic for the same inputs: a cache makes it faster,
  never different.
- Every enabled registered test is scheduled or listed in ``not_scheduled`` with its reason;
  registry violations are listed and also in ``errors``.
- Every number that reaches the packing is finite and bounded: ``est_time`` and recorded
  durations by the registry's ceiling (3 hours), the budget by :data:`MAX_BUDGET_SECONDS`; so job
  timeouts cannot overflow.  Bad history lines are dropped with one warning naming them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .. import history
from ..fleet import Fleet
from ..registry.rules import MAX_EST_TIME_SECONDS
from . import base_runs, observed
from .base_runs import BaseRuns
from .change import Change, GitError, checkout_differs
from .impact import Analyser, Impact
from .index import CACHE_FILE, PlanIndex, build_index
from .jobs import pack_jobs
from .model import Plan, SelectionSummary
from .request import Inputs, Request, RequestError, build_request
from .selection import select

DEFAULT_BUDGET_MINUTES = 60
DEFAULT_MIN_JOB_MINUTES = 5
HISTORY_DIR = Path(".ci-artifacts") / "history"
MAX_BUDGET_SECONDS = MAX_EST_TIME_SECONDS  # a job budget over the ceiling is a typo


@dataclass(frozen=True)
class PlanOptions:
    budget_seconds: float = DEFAULT_BUDGET_MINUTES * 60
    min_job_seconds: float = DEFAULT_MIN_JOB_MINUTES * 60
    history: tuple[Path, ...] = ()
    cache_dir: Path | None = None  # None: no persistent cache


def build_plan(
    root: Path | str,
    fleet: Fleet,
    change: Change,
    inputs: Inputs,
    options: PlanOptions = PlanOptions(),
    pools: Fleet | None = None,
) -> Plan:
    """The plan for ``change`` under ``inputs`` (see the module docstring).  ``fleet`` is the
    tree's own table (its registrations are checked against it); ``pools`` is the trusted table
    the arches, pools and runner labels come from (default: ``fleet``; for a pull request the
    caller passes the base revision's)."""
    root = Path(root).resolve()
    _check_options(options)
    pools = pools or fleet
    request = build_request(inputs, pools)
    everything = request.cpu_all and request.gpu_all
    index = build_index(
        root,
        fleet,
        options.cache_dir / CACHE_FILE if options.cache_dir else None,
        with_reach=not everything,
        save=False,
    )
    registry = index.registry
    impact = _impact(index, change, request)
    observed_warnings = []
    if observed.enabled(root):  # opt-in: the union with what tests executed at the base
        observed_warnings = observed.add_observed(
            impact, change, options.history, (r.path for r in registry.registrations)
        )
    index.save()  # with the files the impact search parsed
    selected, not_scheduled, selection_warnings = select(
        registry.registrations, registry.violations, pools, request, impact
    )
    selection_warnings += observed_warnings
    base = BaseRuns([], [], [])
    if base_runs.applies(request, change):
        base_regs, problems = base_runs.base_registrations(root, change, registry, pools)
        selection_warnings += problems
        if base_regs:
            base = base_runs.keep_base_runs(
                base_regs, selected, registry, pools, request, impact, change
            )
            selected += base.selected
            not_scheduled = base_runs.without_overridden(not_scheduled, base.selected)
    plan = Plan(
        event=request.event,
        cadence=request.cadence,
        base=change.base,
        head=change.head,
        worktree=change.worktree,
        trusted=request.trusted,
        approval=request.approval,
        fleet=_shown_path(pools.path, root),
        budget_seconds=options.budget_seconds,
        selection=SelectionSummary(
            impact.everything, tuple(impact.everything_because), len(change.paths)
        ),
        not_scheduled=sorted(not_scheduled, key=lambda n: (n.file, n.arch or "")),
        warnings=[*request.warnings, *selection_warnings],
        errors=[str(v) for v in registry.violations] + base.errors,
        fast_fail=request.fast_fail,
        fast_fail_reason=request.fast_fail_reason,
        overrides=base.overrides,
    )
    if not change.usable:
        plan.warnings.append(f"selecting everything: {change.reason}")
    if request.gpu_blocked:
        plan.warnings.append(request.gpu_blocked)
    jobs, summaries, capacity, warnings = pack_jobs(
        selected,
        pools,
        _estimator(options, plan),
        options.budget_seconds,
        options.min_job_seconds,
    )
    plan.jobs, plan.pools, plan.capacity = jobs, summaries, capacity
    plan.warnings += warnings
    if plan.approval and not any(j.arch for j in jobs):
        plan.approval = None  # nothing waits for a review: the ask planned no GPU job
    return plan


def _shown_path(path: Path, root: Path) -> str:
    """A fleet's path as the plan names it: root-relative when inside the tree (plans are the
    same on every checkout), as given otherwise (``SHA:ci/fleet.toml``)."""
    if not path.is_absolute():
        return str(path)
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return str(path)


def check_checkout_is_head(root: Path, change: Change) -> None:
    """A plan for a named head (not the working tree) is made from that commit's files: the CLI
    refuses (:class:`RequestError`) when the checkout under ``root`` holds other files (the
    registry and imports are read from the checkout, so a plan named after one commit would
    select the tests of another)."""
    if change.worktree or not change.usable or not change.head:
        return
    try:
        why = checkout_differs(root, change.head)
    except GitError as e:
        why = f"cannot compare the checkout with it: {e}"
    if why is not None:
        raise RequestError(
            f"--head {change.head[:12]}: the planner reads the tests from the checkout, and {why}."
            f" Fix: check out {change.head[:12]} in a clean tree (`git checkout --detach "
            f"{change.head[:12]}`, with the changes committed or stashed), or leave out --head to "
            "plan the working tree as it is"
        )


def _check_options(options: PlanOptions) -> None:
    """The budget and the minimum job are finite and bounded (a job's timeout is computed from
    them, so ``inf`` or ``nan`` must never reach the packing): :class:`RequestError` otherwise."""
    budget, min_job = options.budget_seconds, options.min_job_seconds
    if not (math.isfinite(budget) and 0 < budget <= MAX_BUDGET_SECONDS):
        raise RequestError(
            f"the job budget must be a finite number of minutes from more than 0 to "
            f"{MAX_BUDGET_SECONDS // 60}, got {budget / 60:g} (--budget-minutes)"
        )
    if not (math.isfinite(min_job) and 0 <= min_job <= budget):
        raise RequestError(
            f"the minimum job must be a finite number of minutes from 0 to the budget, got "
            f"{min_job / 60:g} (--min-job-minutes)"
        )


def _impact(index: PlanIndex, change: Change, request: Request) -> Impact:
    if request.cpu_all and request.gpu_all:
        return Impact(everything=True, everything_because=[f"{request.cadence} run: everything"])
    return Analyser.of_index(index).analyse(change)


def _estimator(options: PlanOptions, plan: Plan) -> history.Estimator:
    """The estimator of the good records of the history stores; the bad lines are dropped, with
    one warning naming them (path:line)."""
    records, problems = history.read_stores(options.history, missing_ok=True)
    if problems:
        plan.warnings.append(history.dropped_warning(problems, "duration history"))
    return history.Estimator(records)


def default_history(root: Path) -> tuple[Path, ...]:
    return (root / HISTORY_DIR,)
