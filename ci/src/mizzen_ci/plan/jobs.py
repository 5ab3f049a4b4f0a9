"""From the selected tests to runner jobs: per pool, estimates, packing and the job records.

Invariants:
- Pools are visited in the fleet's order (the CPU pool first); within a pool the tests are packed
  by :func:`mizzen_ci.plan.packing.pack` from their estimates (recorded p90 or ``est_time``).
- Job ids are unique, stable names: ``cpu-<k>`` and ``<arch>-<pool>-<k>``; a job's lane is
  :func:`mizzen_ci.fleet.lane_name` of its arch; its tests are in planned start order.
- A job's timeout is its estimate × :data:`TIMEOUT_FACTOR` plus :data:`TIMEOUT_SLACK_MINUTES`.
- A test estimated over the budget gets a job of its own, and a warning saying so.
"""

from __future__ import annotations

import math

from .. import history
from ..fleet import CpuPool, Fleet, Pool, lane_name
from ..lane.packing import PackItem
from .model import Job, PlannedTest, PoolSummary
from .packing import PackedJob, pack
from .selection import Selected

TIMEOUT_FACTOR = 1.25  # a job's timeout over its estimate (estimates are p90s, not maxima)
TIMEOUT_SLACK_MINUTES = 15  # set-up (checkout, environment) on top of the tests


def pack_jobs(
    selected: list[Selected],
    fleet: Fleet,
    estimator: history.Estimator,
    budget_seconds: float,
    min_job_seconds: float,
) -> tuple[list[Job], list[PoolSummary], list[str]]:
    """``(jobs, one summary per pool used, warnings)`` for the selected tests."""
    jobs: list[Job] = []
    pools: list[PoolSummary] = []
    warnings: list[str] = []
    by_pool: dict[str, list[Selected]] = {}
    for s in selected:
        by_pool.setdefault(s.pool.name, []).append(s)
    for pool_name in [fleet.cpu_pool.name] + [p.name for p in fleet.pools]:
        chosen = by_pool.get(pool_name)
        if not chosen:
            continue
        pool = fleet.pool(pool_name)
        is_cpu = pool_name == fleet.cpu_pool.name
        gpus = 1 if is_cpu else pool.gpus_per_runner
        items, info = [], {}
        for s in sorted(chosen, key=lambda s: s.reg.path):
            est = estimator.estimate(s.reg.path, s.arch, s.reg.est_time)
            items.append(PackItem(s.reg.path, 1 if is_cpu else s.reg.num_gpus, est.seconds))
            info[s.reg.path] = (s, est)
        packing = pack(
            items, gpus=gpus, runners=pool.runners, budget=budget_seconds, min_job=min_job_seconds
        )
        arch = None if is_cpu else pool.arch
        for k, job in enumerate(packing.jobs, 1):
            job_id = f"cpu-{k}" if is_cpu else f"{arch}-{pool_name}-{k}"
            jobs.append(_job_record(job_id, job, pool, arch, gpus, info))
            if job.over_budget:
                longest = max(job.slots, key=lambda s: s.item.est_seconds).item
                warnings.append(
                    f"{longest.key} ({arch or 'cpu'}) is estimated at "
                    f"{longest.est_seconds / 60:.0f} min, over the {budget_seconds / 60:.0f}-min "
                    f"job budget: it has a job of its own ({job_id}); split the test or raise "
                    "--budget-minutes"
                )
        pools.append(
            PoolSummary(
                pool=pool_name,
                lane=lane_name(arch),
                jobs=len(packing.jobs),
                runners=pool.runners,
                gpus_per_runner=gpus,
                tests=len(items),
                gpu_seconds=round(sum(i.gpu_seconds for i in items), 1),
                makespan_seconds=round(packing.makespan, 1),
                lower_bound_seconds=round(packing.lower_bound, 1),
                strategy=packing.strategy,
            )
        )
    return jobs, pools, warnings


def _job_record(
    job_id: str,
    job: PackedJob,
    pool: Pool | CpuPool,
    arch: str | None,
    gpus: int,
    info: dict[str, tuple[Selected, history.Estimate]],
) -> Job:
    """The :class:`~.model.Job` of one packed job: its tests in planned start order."""
    tests = []
    for slot in sorted(job.slots, key=lambda s: (s.start, -s.item.est_seconds, s.item.key)):
        s, est = info[slot.item.key]
        tests.append(
            PlannedTest(
                file=slot.item.key,
                num_gpus=s.reg.num_gpus,
                est_seconds=round(est.seconds, 1),
                estimate=est.source,
                start_seconds=round(slot.start, 1),
                why=s.why,
            )
        )
    return Job(
        id=job_id,
        lane=lane_name(arch),
        arch=arch,
        pool=pool.name,
        runs_on=tuple(pool.runs_on),
        runner_group=pool.runner_group,
        gpus=gpus,
        timeout_minutes=math.ceil(job.seconds * TIMEOUT_FACTOR / 60 + TIMEOUT_SLACK_MINUTES),
        over_budget=job.over_budget,
        est_seconds=round(job.seconds, 1),
        tests=tuple(tests),
    )
