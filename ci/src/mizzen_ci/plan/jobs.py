"""From the selected tests to runner jobs: estimates, the pool of each test, packing, the records.

Invariants:
- A test runs on its arch and on a pool that can host it (GPUs per runner, capabilities): the
  *eligible* pools of that arch.  Pools that can host the same tests share them: each test goes
  to the eligible pool that finishes it first (a fluid estimate, longest first, then moves that
  shorten the pool finishing last), and the result is kept only when it ends the arch's work no
  later than giving every test its smallest eligible pool (:meth:`mizzen_ci.fleet.Fleet.pool_for`)
  does — so sharing never makes a plan worse.  Ties keep the smallest pool; everything is
  deterministic (fleet order, then test path).
- Every job pays its pool's ``job_setup_s`` before its first test: in its estimate, in the time
  budget (the tests of a job get ``budget - setup``), in the packer's objective (a job more is
  opened only when it ends the pool sooner) and in every lower bound.
- Pools are visited in the fleet's order (the CPU pool first); job ids are unique, stable names:
  ``cpu-<k>`` and ``<arch>-<pool>-<k>``; a job's lane is :func:`mizzen_ci.fleet.nox_session_name` of its
  arch; its tests are in planned start order, their start counted from the job's start.
- A job's timeout is its set-up plus its tests' span × :data:`TIMEOUT_FACTOR`, plus
  :data:`TIMEOUT_SLACK_MINUTES`, and never over
  :data:`~mizzen_ci.registry.rules.MAX_JOB_TIMEOUT_MINUTES` (the workflows' job limit).  A test
  estimated over the tests' budget gets a job of its own, and a warning saying so.
- The capacity summary of each arch compares the arch's finish (its last pool done) with a bound
  that pools the eligible capacity: over every set S of the arch's pools, the GPU-seconds of the
  tests that only S can host over S's GPUs, plus the set-ups of the jobs a runner needs for that
  much work (S's least set-up each, :func:`~mizzen_ci.packing.pool.with_setups`); and each test plus the least
  set-up of its eligible pools.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .. import history
from ..fleet import CpuPool, Fleet, Pool, nox_session_name
from ..packing.gpus import PackItem
from ..packing.pool import PackedJob, Packing, job_gpu_seconds, pack, with_setups
from ..registry.rules import MAX_JOB_TIMEOUT_MINUTES
from .model import ArchSummary, Job, PlannedTest, PoolSummary
from .selection import Selected

TIMEOUT_FACTOR = 1.25  # a job's timeout over its tests' estimate (p90s, not maxima)
TIMEOUT_SLACK_MINUTES = 5  # on top of the set-up and the tests
MAX_MOVES = 24  # moves tried between pools of one arch (bounds the planner's time)


@dataclass(frozen=True)
class _Test:
    """One selected test with its estimate and the pools that can host it (smallest first)."""

    selected: Selected
    estimate: history.Estimate
    eligible: tuple[Pool | CpuPool, ...]

    @property
    def key(self) -> str:
        return self.selected.reg.path

    def item(self, is_cpu: bool) -> PackItem:
        gpus = 1 if is_cpu else self.selected.reg.num_gpus
        shares = not is_cpu and self.selected.reg.shares_gpu
        return PackItem(self.key, gpus, self.estimate.seconds, shares)


def pack_jobs(
    selected: list[Selected],
    fleet: Fleet,
    estimator: history.Estimator,
    budget_seconds: float,
    min_job_seconds: float,
) -> tuple[list[Job], list[PoolSummary], list[ArchSummary], list[str]]:
    """``(jobs, one summary per pool used, one per arch, warnings)`` for the selected tests."""
    by_arch: dict[str | None, list[_Test]] = {}
    for s in sorted(selected, key=lambda s: s.reg.path):
        est = estimator.estimate(s.reg.path, s.arch, s.reg.est_time)
        by_arch.setdefault(s.arch, []).append(_Test(s, est, _eligible(s, fleet)))
    packer = _Packer(budget_seconds, min_job_seconds)
    placed: dict[str, tuple[list[_Test], Packing]] = {}
    arches: list[ArchSummary] = []
    for arch in [None, *fleet.generation_names]:
        tests = by_arch.get(arch)
        if not tests:
            continue
        assignment = packer.assign(tests)
        for pool_name, (chosen, packing) in assignment.items():
            placed[pool_name] = (chosen, packing)
        pools = [fleet.pool(n) for n in assignment]
        arches.append(
            ArchSummary(
                arch=arch,
                lane=nox_session_name(arch),
                pools=tuple(p.name for p in pools),
                tests=len(tests),
                makespan_seconds=round(max(p.makespan for _, p in assignment.values()), 1),
                bound_seconds=round(_pooled_bound(tests, arch is None, budget_seconds), 1),
                vendor=_vendor(fleet, arch),
            )
        )
    jobs: list[Job] = []
    summaries: list[PoolSummary] = []
    warnings: list[str] = []
    for pool_name in [fleet.cpu_pool.name] + [p.name for p in fleet.pools]:
        if pool_name not in placed:
            continue
        tests, packing = placed[pool_name]
        pool = fleet.pool(pool_name)
        info = {t.key: t for t in tests}
        arch = None if pool_name == fleet.cpu_pool.name else pool.arch
        for k, job in enumerate(packing.jobs, 1):
            job_id = f"cpu-{k}" if arch is None else f"{arch}-{pool_name}-{k}"
            jobs.append(_job_record(job_id, job, pool, arch, packing, info, _vendor(fleet, arch)))
            if job.over_budget:
                longest = max(job.slots, key=lambda s: s.item.est_seconds).item
                warnings.append(
                    f"{longest.key} ({arch or 'cpu'}) is estimated at "
                    f"{longest.est_seconds / 60:.0f} min, over the {budget_seconds / 60:.0f}-min "
                    f"job budget ({pool.job_setup_s / 60:.0f} min of it set-up): it has a job of "
                    f"its own ({job_id}); split the test or raise --budget-minutes"
                )
        items = [t.item(arch is None) for t in tests]
        summaries.append(
            PoolSummary(
                pool=pool_name,
                lane=nox_session_name(arch),
                jobs=len(packing.jobs),
                runners=pool.runners,
                gpus_per_runner=packing.gpus,
                tests=len(items),
                gpu_seconds=round(sum(job_gpu_seconds(j.slots) for j in packing.jobs), 1),
                makespan_seconds=round(packing.makespan, 1),
                lower_bound_seconds=round(packing.lower_bound, 1),
                strategy=packing.strategy,
                setup_seconds=packing.setup,
                vendor=_vendor(fleet, arch),
            )
        )
    return jobs, summaries, arches, warnings


def _vendor(fleet: Fleet, arch: str | None) -> str | None:
    """The plan's ``vendor`` of an arch's records (``None``: the CPU pool)."""
    vendor = fleet.vendor_of(arch)
    return None if vendor is None else vendor.name


def _eligible(s: Selected, fleet: Fleet) -> tuple[Pool | CpuPool, ...]:
    """The pools that can host ``s``: its own pool first, then the others of its arch that fit,
    in the order :meth:`Fleet.pool_for` prefers them."""
    if s.arch is None:
        return (s.pool,)
    fits = [
        p
        for p in fleet.pools_of(s.arch)
        if p.gpus_per_runner >= s.reg.num_gpus and set(s.reg.needs) <= p.capabilities
    ]
    fits.sort(key=lambda p: (p.gpus_per_runner, len(p.capabilities), p.name))
    return (s.pool, *[p for p in fits if p.name != s.pool.name])


class _Packer:
    """Packs the tests of one arch onto its pools (see the module docstring)."""

    def __init__(self, budget: float, min_job: float):
        self.budget = budget
        self.min_job = min_job
        self._memo: dict[tuple, Packing] = {}

    def pack(self, pool: Pool | CpuPool, tests: Sequence[_Test]) -> Packing:
        is_cpu = isinstance(pool, CpuPool)
        key = (pool.name, tuple(t.key for t in tests))
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = pack(
                [t.item(is_cpu) for t in tests],
                gpus=1 if is_cpu else pool.gpus_per_runner,
                runners=pool.runners,
                budget=self.budget,
                min_job=max(self.min_job, pool.job_setup_s),
                setup=pool.job_setup_s,
            )
        return found

    def packings(self, chosen: dict[str, list[_Test]], pools: dict) -> dict[str, Packing]:
        return {name: self.pack(pools[name], tests) for name, tests in chosen.items() if tests}

    def assign(self, tests: list[_Test]) -> dict[str, tuple[list[_Test], Packing]]:
        """``{pool name: (its tests, its packing)}`` for the tests of one arch."""
        pools = {p.name: p for t in tests for p in t.eligible}
        default: dict[str, list[_Test]] = {}
        for t in tests:
            default.setdefault(t.eligible[0].name, []).append(t)
        best = default
        best_finish = self._finish(self.packings(default, pools))
        if any(len(t.eligible) > 1 for t in tests):
            shared = self._improve(self._fluid(tests), pools)
            finish = self._finish(self.packings(shared, pools))
            if finish[0] < best_finish[0] - 1e-6 or (
                abs(finish[0] - best_finish[0]) <= 1e-6 and finish[1] < best_finish[1] - 1e-6
            ):
                best, best_finish = shared, finish
        done = self.packings(best, pools)
        order = [p for p in pools if best.get(p)]
        return {name: (sorted(best[name], key=lambda t: t.key), done[name]) for name in order}

    @staticmethod
    def _finish(packings: dict[str, Packing]) -> tuple[float, float]:
        """(when the last pool ends, then the sum of the pools' ends): lower is better."""
        ends = [p.makespan for p in packings.values()]
        return (max(ends, default=0.0), sum(ends))

    def _fluid(self, tests: list[_Test]) -> dict[str, list[_Test]]:
        """Longest first, each test to the eligible pool whose fluid finish (set-up plus work
        over its GPUs, at least its longest test) is earliest with it."""
        work: dict[str, float] = {}
        longest: dict[str, float] = {}
        out: dict[str, list[_Test]] = {}
        for t in sorted(
            tests, key=lambda t: (-t.estimate.seconds, -t.selected.reg.num_gpus, t.key)
        ):
            seconds, gpus = t.estimate.seconds, max(t.selected.reg.num_gpus, 1)

            def finish(p, seconds=seconds, gpus=gpus):
                capacity = p.gpus_per_runner * p.runners
                fluid = (work.get(p.name, 0.0) + gpus * seconds) / capacity
                return p.job_setup_s + max(fluid, longest.get(p.name, 0.0), seconds)

            pool = min(t.eligible, key=finish)  # (min keeps the first of equal ones)
            work[pool.name] = work.get(pool.name, 0.0) + gpus * seconds
            longest[pool.name] = max(longest.get(pool.name, 0.0), seconds)
            out.setdefault(pool.name, []).append(t)
        return out

    def _improve(self, chosen: dict[str, list[_Test]], pools: dict) -> dict[str, list[_Test]]:
        """Move tests off the pool that ends last while that ends the arch sooner."""
        chosen = {name: list(ts) for name, ts in chosen.items()}
        packings = self.packings(chosen, pools)
        for _ in range(MAX_MOVES):
            last = max(packings, key=lambda n: (packings[n].makespan, n))
            movable = [t for t in chosen[last] if len(t.eligible) > 1]
            movable.sort(key=lambda t: (-t.estimate.seconds, t.key))
            improved = False
            for t in movable[:4]:
                for target in t.eligible:
                    if target.name == last:
                        continue
                    trial_from = [x for x in chosen[last] if x is not t]
                    trial_to = sorted([*chosen.get(target.name, []), t], key=lambda x: x.key)
                    new_from = self.pack(pools[last], trial_from).makespan if trial_from else 0.0
                    new_to = self.pack(pools[target.name], trial_to).makespan
                    if max(new_from, new_to) < packings[last].makespan - 1e-6:
                        chosen[last], chosen[target.name] = trial_from, trial_to
                        packings = self.packings(chosen, pools)
                        improved = True
                        break
                if improved:
                    break
            if not improved:
                break
        return {name: ts for name, ts in chosen.items() if ts}


def _pooled_bound(tests: list[_Test], is_cpu: bool, budget: float) -> float:
    """The bound of the module docstring over the tests of one arch."""
    pools = {p.name: p for t in tests for p in t.eligible}
    names = sorted(pools)
    bound = 0.0
    for t in tests:
        bound = max(bound, t.estimate.seconds + min(p.job_setup_s for p in t.eligible))
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(names, r):
            inside = set(subset)
            work = sum(
                (1 if is_cpu else t.selected.reg.num_gpus) * t.estimate.seconds
                for t in tests
                if {p.name for p in t.eligible} <= inside
            )
            if not work:
                continue
            capacity = sum(
                (1 if is_cpu else pools[n].gpus_per_runner) * pools[n].runners for n in subset
            )
            setup = min(pools[n].job_setup_s for n in subset)
            longest = max(
                t.estimate.seconds for t in tests if {p.name for p in t.eligible} <= inside
            )
            bound = max(bound, with_setups(work / capacity, setup, budget, longest))
    return bound


def _job_record(
    job_id: str,
    job: PackedJob,
    pool: Pool | CpuPool,
    arch: str | None,
    packing: Packing,
    info: dict[str, _Test],
    vendor: str | None,
) -> Job:
    """The :class:`~.model.Job` of one packed job: its tests in planned start order."""
    tests = []
    for slot in sorted(job.slots, key=lambda s: (s.start, -s.item.est_seconds, s.item.key)):
        t = info[slot.item.key]
        tests.append(
            PlannedTest(
                file=slot.item.key,
                num_gpus=t.selected.reg.num_gpus,
                est_seconds=round(t.estimate.seconds, 1),
                estimate=t.estimate.source,
                start_seconds=round(packing.setup + slot.start, 1),
                why=t.selected.why,
            )
        )
    return Job(
        id=job_id,
        lane=nox_session_name(arch),
        arch=arch,
        pool=pool.name,
        runs_on=tuple(pool.runs_on),
        runner_group=pool.runner_group,
        gpus=packing.gpus,
        timeout_minutes=min(
            MAX_JOB_TIMEOUT_MINUTES,
            math.ceil((packing.setup + job.seconds * TIMEOUT_FACTOR) / 60 + TIMEOUT_SLACK_MINUTES),
        ),
        over_budget=job.over_budget,
        est_seconds=round(packing.setup + job.seconds, 1),
        tests=tuple(tests),
        vendor=vendor,
    )
