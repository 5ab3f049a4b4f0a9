"""The PR planner: from a change, an event and the registry to jobs on matching runners.

``build_plan`` runs the pipeline: request (:mod:`plan_request`) → the tree's index
(:mod:`plan_index`: registry and reverse import index, one parse per file, warm from its cache) →
impact analysis (:mod:`impact`) → selection (:mod:`selection`) → estimates (:mod:`history`) →
packing per pool (:mod:`packing`) → a :class:`Plan`.

The plan JSON (``version`` 1; fields may be added, never renamed)::

    {"version": 1, "event": "pull_request", "cadence": null, "base": SHA, "head": SHA,
     "worktree": false, "trusted": true, "budget_seconds": 3600,
     "selection": {"everything": false, "because": [...], "changed_paths": 3},
     "jobs": [{"id": "hopper-h200-2gpu-1", "lane": "gpu-hopper", "arch": "hopper",
               "pool": "h200-2gpu", "runs_on": ["self-hosted", ...], "gpus": 2,
               "session": "gpu-hopper", "timeout_minutes": 75, "over_budget": false,
               "est_seconds": 1234.0,
               "tests": [{"file": "tests/...", "num_gpus": 1, "est_seconds": 60.0,
                          "estimate": "history" | "est_time", "start_seconds": 0.0,
                          "why": "reaches mizzen_train.lora (…changed)"}]}],
     "pools": [{"pool": ..., "lane": ..., "jobs": n, "gpu_seconds": ..., "makespan_seconds": ...,
                "lower_bound_seconds": ..., "strategy": ...}],
     "not_scheduled": [{"file": ..., "arch": ..., "code": ..., "reason": ...}],
     "warnings": [...], "errors": [...]}

A job's tests are listed in their planned start order (longest first): the lanes run them so.
CPU jobs have ``arch: null``, ``lane: "cpu"`` and ``gpus: 1`` (one test at a time is what the
estimate assumes; the lane may run faster with pytest-xdist).

Invariants:
- Stdlib only; never imports a test.  Deterministic for the same inputs.
- Every enabled registered test is scheduled or listed in ``not_scheduled`` with its reason;
  registry errors are listed and also in ``errors``.
- Job ids are unique, stable names: ``cpu-<k>`` and ``<arch>-<pool>-<k>``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import history
from .change import Change
from .fleet import Fleet
from .impact import Analyser, Impact
from .packing import Item, pack
from .plan_index import CACHE_FILE, PlanIndex, build_index
from .plan_request import Inputs, Request, build_request
from .selection import NotScheduled, Selected, select

PLAN_VERSION = 1
DEFAULT_BUDGET_MINUTES = 60
DEFAULT_MIN_JOB_MINUTES = 5
TIMEOUT_FACTOR = 1.25  # a job's timeout over its estimate (estimates are p90s, not maxima)
TIMEOUT_SLACK_MINUTES = 15  # set-up (checkout, environment) on top of the tests
CACHE_DIR = Path(".ci-artifacts") / "cache"
HISTORY_DIR = Path(".ci-artifacts") / "history"


class PlanError(ValueError):
    """A plan file cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class PlanOptions:
    budget_seconds: float = DEFAULT_BUDGET_MINUTES * 60
    min_job_seconds: float = DEFAULT_MIN_JOB_MINUTES * 60
    history: tuple[Path, ...] = ()
    cache_dir: Path | None = None  # None: no persistent cache


@dataclass
class Plan:
    event: str
    cadence: str | None
    base: str | None
    head: str | None
    worktree: bool
    trusted: bool
    budget_seconds: float
    impact: Impact
    changed_paths: int
    jobs: list[dict] = field(default_factory=list)
    pools: list[dict] = field(default_factory=list)
    not_scheduled: list[NotScheduled] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "event": self.event,
            "cadence": self.cadence,
            "base": self.base,
            "head": self.head,
            "worktree": self.worktree,
            "trusted": self.trusted,
            "budget_seconds": self.budget_seconds,
            "selection": {
                "everything": self.impact.everything,
                "because": list(self.impact.everything_because),
                "changed_paths": self.changed_paths,
            },
            "jobs": self.jobs,
            "pools": self.pools,
            "not_scheduled": [n.to_json() for n in self.not_scheduled],
            "warnings": self.warnings,
            "errors": self.errors,
        }

    def scheduled(self) -> set[tuple[str, str | None]]:
        """Every (file, arch) the plan runs."""
        return {(t["file"], j["arch"]) for j in self.jobs for t in j["tests"]}


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
        registry.registrations, registry.errors, fleet, request, impact
    )
    plan = Plan(
        event=request.event,
        cadence=request.cadence,
        base=change.base,
        head=change.head,
        worktree=change.worktree,
        trusted=request.trusted,
        budget_seconds=options.budget_seconds,
        impact=impact,
        changed_paths=len(change.paths),
        not_scheduled=sorted(not_scheduled, key=lambda n: (n.file, n.arch or "")),
        warnings=list(request.warnings),
        errors=[str(e) for e in registry.errors],
    )
    if not change.usable:
        plan.warnings.append(f"selecting everything: {change.reason}")
    if request.gpu_blocked:
        plan.warnings.append(request.gpu_blocked)
    estimator = _estimator(options, plan)
    _pack_jobs(plan, selected, fleet, estimator, options)
    return plan


def _impact(index: PlanIndex, change: Change, request: Request) -> Impact:
    if request.cpu_all and request.gpu_all:
        return Impact(everything=True, everything_because=[f"{request.cadence} run: everything"])
    analyser = Analyser(index.tree, index.modules, index.source_dirs, index.reach, index.excludes)
    return analyser.analyse(change)


def _estimator(options: PlanOptions, plan: Plan) -> history.Estimator:
    try:
        records = history.load(options.history, missing_ok=True)
    except history.HistoryError as e:
        plan.warnings.append(f"duration history ignored, estimates from est_time: {e}")
        records = []
    return history.Estimator(records)


def _pack_jobs(
    plan: Plan,
    selected: list[Selected],
    fleet: Fleet,
    estimator: history.Estimator,
    options: PlanOptions,
) -> None:
    by_pool: dict[str, list[Selected]] = {}
    for s in selected:
        by_pool.setdefault(s.pool.name, []).append(s)
    order = [fleet.cpu_pool.name] + [p.name for p in fleet.pools]
    for pool_name in order:
        chosen = by_pool.get(pool_name)
        if not chosen:
            continue
        pool = fleet.pool(pool_name)
        is_cpu = pool_name == fleet.cpu_pool.name
        gpus = 1 if is_cpu else pool.gpus_per_runner
        items, info = [], {}
        for s in sorted(chosen, key=lambda s: s.reg.path):
            est = estimator.estimate(s.reg.path, s.arch, s.reg.est_time)
            item = Item(s.reg.path, 1 if is_cpu else s.reg.num_gpus, est.seconds)
            items.append(item)
            info[s.reg.path] = (s, est)
        packing = pack(
            items,
            gpus=gpus,
            runners=pool.runners,
            budget=options.budget_seconds,
            min_job=options.min_job_seconds,
        )
        arch = None if is_cpu else pool.arch
        lane = "cpu" if is_cpu else f"gpu-{arch}"
        for k, job in enumerate(packing.jobs, 1):
            job_id = f"cpu-{k}" if is_cpu else f"{arch}-{pool_name}-{k}"
            seconds = job.seconds
            tests = []
            for slot in sorted(job.slots, key=lambda s: (s.start, -s.item.seconds, s.item.key)):
                s, est = info[slot.item.key]
                tests.append(
                    {
                        "file": slot.item.key,
                        "num_gpus": s.reg.num_gpus,
                        "est_seconds": round(est.seconds, 1),
                        "estimate": est.source,
                        "start_seconds": round(slot.start, 1),
                        "why": s.why,
                    }
                )
            if job.over_budget:
                longest = max(job.slots, key=lambda s: s.item.seconds).item
                plan.warnings.append(
                    f"{longest.key} ({arch or 'cpu'}) is estimated at {longest.seconds / 60:.0f} "
                    f"min, over the {options.budget_seconds / 60:.0f}-min job budget: it has a job "
                    f"of its own ({job_id}); split the test or raise --budget-minutes"
                )
            plan.jobs.append(
                {
                    "id": job_id,
                    "lane": lane,
                    "arch": arch,
                    "pool": pool_name,
                    "runs_on": list(pool.runs_on),
                    "gpus": gpus,
                    "session": "cpu" if is_cpu else f"gpu-{arch}",
                    "timeout_minutes": math.ceil(
                        seconds * TIMEOUT_FACTOR / 60 + TIMEOUT_SLACK_MINUTES
                    ),
                    "over_budget": job.over_budget,
                    "est_seconds": round(seconds, 1),
                    "tests": tests,
                }
            )
        plan.pools.append(
            {
                "pool": pool_name,
                "lane": lane,
                "jobs": len(packing.jobs),
                "runners": pool.runners,
                "gpus_per_runner": gpus,
                "tests": len(items),
                "gpu_seconds": round(sum(i.gpu_seconds for i in items), 1),
                "makespan_seconds": round(packing.makespan, 1),
                "lower_bound_seconds": round(packing.lower_bound, 1),
                "strategy": packing.strategy,
            }
        )


# --------------------------------------------------------------------------------------------
# Reading a plan back (the lanes run one job of it).


def load_plan(path: Path | str) -> dict:
    """A plan written by ``mizzen-ci plan --output``; :class:`PlanError` when it is not one."""
    path = Path(path)
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: cannot read the plan: {e}") from None
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise PlanError(
            f"{path}: not a version-{PLAN_VERSION} plan; write one with `mizzen-ci plan --output`"
        )
    if not isinstance(plan.get("jobs"), list):
        raise PlanError(f"{path}: the plan has no `jobs` list")
    return plan


def job(plan: dict, job_id: str) -> dict:
    """The job ``job_id`` of a loaded plan; :class:`PlanError` naming the jobs it has."""
    for j in plan["jobs"]:
        if isinstance(j, dict) and j.get("id") == job_id:
            return j
    ids = ", ".join(str(j.get("id")) for j in plan["jobs"] if isinstance(j, dict))
    raise PlanError(f"the plan has no job {job_id!r}; its jobs: {ids or 'none'}")


def job_tests(plan: dict, job_id: str) -> list[dict]:
    """The tests (``{"file", "num_gpus", "est_seconds", …}``) of job ``job_id``, in order."""
    tests = job(plan, job_id).get("tests")
    if not isinstance(tests, list) or not all(
        isinstance(t, dict) and isinstance(t.get("file"), str) for t in tests
    ):
        raise PlanError(f"job {job_id}: malformed `tests` (each needs a `file`)")
    return tests


def job_files(plan: dict, job_id: str) -> list[str]:
    return [t["file"] for t in job_tests(plan, job_id)]


def default_history(root: Path) -> tuple[Path, ...]:
    return (root / HISTORY_DIR,)


def as_paths(values: Iterable[str | Path]) -> tuple[Path, ...]:
    return tuple(Path(v) for v in values)
