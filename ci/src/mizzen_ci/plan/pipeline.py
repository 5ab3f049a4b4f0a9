"""The PR planner: from a change, an event and the registry to jobs on matching runners.

:func:`build_plan` runs the pipeline: request (:mod:`.request`) → the tree's index
(:mod:`.index`: registry and reverse import index, one parse per file, warm from its cache) →
impact analysis (:mod:`.impact`) → selection (:mod:`.selection`) → estimates
(:mod:`mizzen_ci.history`) → packing per pool (:mod:`.jobs`) → a :class:`~.model.Plan`.

Invariants:
- Stdlib only; never imports a test.  Deterministic for the same inputs: a cache makes it faster,
  never different.
- Every enabled registered test is scheduled or listed in ``not_scheduled`` with its reason;
  registry violations are listed and also in ``errors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import history
from ..fleet import Fleet
from .change import Change
from .impact import Analyser, Impact
from .index import CACHE_FILE, PlanIndex, build_index
from .jobs import pack_jobs
from .model import Plan, SelectionSummary
from .request import Inputs, Request, build_request
from .selection import select

DEFAULT_BUDGET_MINUTES = 60
DEFAULT_MIN_JOB_MINUTES = 5
CACHE_DIR = Path(".ci-artifacts") / "cache"
HISTORY_DIR = Path(".ci-artifacts") / "history"


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
) -> Plan:
    """The plan for ``change`` under ``inputs`` (see the module docstring)."""
    root = Path(root).resolve()
    request = build_request(inputs, fleet)
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
    index.save()  # with the files the impact search parsed
    selected, not_scheduled = select(
        registry.registrations, registry.violations, fleet, request, impact
    )
    plan = Plan(
        event=request.event,
        cadence=request.cadence,
        base=change.base,
        head=change.head,
        worktree=change.worktree,
        trusted=request.trusted,
        budget_seconds=options.budget_seconds,
        selection=SelectionSummary(
            impact.everything, tuple(impact.everything_because), len(change.paths)
        ),
        not_scheduled=sorted(not_scheduled, key=lambda n: (n.file, n.arch or "")),
        warnings=list(request.warnings),
        errors=[str(v) for v in registry.violations],
    )
    if not change.usable:
        plan.warnings.append(f"selecting everything: {change.reason}")
    if request.gpu_blocked:
        plan.warnings.append(request.gpu_blocked)
    jobs, pools, warnings = pack_jobs(
        selected,
        fleet,
        _estimator(options, plan),
        options.budget_seconds,
        options.min_job_seconds,
    )
    plan.jobs, plan.pools = jobs, pools
    plan.warnings += warnings
    return plan


def _impact(index: PlanIndex, change: Change, request: Request) -> Impact:
    if request.cpu_all and request.gpu_all:
        return Impact(everything=True, everything_because=[f"{request.cadence} run: everything"])
    return Analyser.of_index(index).analyse(change)


def _estimator(options: PlanOptions, plan: Plan) -> history.Estimator:
    try:
        records = history.load(options.history, missing_ok=True)
    except history.HistoryError as e:
        plan.warnings.append(f"duration history ignored, estimates from est_time: {e}")
        records = []
    return history.Estimator(records)


def default_history(root: Path) -> tuple[Path, ...]:
    return (root / HISTORY_DIR,)
