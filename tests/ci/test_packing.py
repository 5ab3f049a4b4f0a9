"""Property tests of the packer: every test placed once, never more GPUs busy than a runner has
(checked on the schedule itself), the budget kept, every job's schedule the one the GPU lane's
packer produces for it, never worse than plain round-robin run the same way."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.packing import PackingError, PackItem, simulate
from mizzen_ci.plan.packing import lower_bound, pack

register_cpu_ci(est_time=25, labels=["ci"])

EPS = 1e-6


def lane_starts(items: list[PackItem], gpus: int) -> dict[str, float]:
    """Start time of each item when the GPU lane's packer runs them on ``gpus`` GPUs."""
    ran = simulate(items, [str(g) for g in range(gpus)])
    return {s.item.key: s.start for s in ran}


def queued_makespan(lengths: list[float], runners: int) -> float:
    ends = [0.0] * runners
    for s in lengths:
        heapq.heapreplace(ends, ends[0] + s)
    return max(ends)


def round_robin(items: list[PackItem], gpus: int, runners: int, budget: float, n: int):
    """(makespan, within budget) of: long tests alone, the rest dealt in order over n jobs."""
    alone = [i.est_seconds for i in items if i.est_seconds > budget]
    dealt: list[list[PackItem]] = [[] for _ in range(n)]
    for k, item in enumerate(i for i in items if i.est_seconds <= budget):
        dealt[k % n].append(item)
    lengths = []
    for job in dealt:
        if job:
            starts = lane_starts(job, gpus)
            lengths.append(max(starts[i.key] + i.est_seconds for i in job))
    ok = all(x <= budget + EPS for x in lengths)
    return queued_makespan(sorted(alone + lengths, reverse=True), runners), ok


@st.composite
def pools(draw):
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    runners = draw(st.integers(1, 6))
    budget = draw(st.floats(60, 3600))
    n = draw(st.integers(0, 60))
    items = [
        PackItem(
            f"tests/t{k}.py",
            draw(st.integers(1, gpus)),
            draw(st.one_of(st.floats(0, budget), st.floats(budget, 3 * budget))),
        )
        for k in range(n)
    ]
    min_job = draw(st.floats(0, 1800))
    return items, gpus, runners, budget, min_job


@settings(max_examples=250, deadline=None)
@given(pools())
def test_packing_properties(case):
    items, gpus, runners, budget, min_job = case
    p = pack(items, gpus=gpus, runners=runners, budget=budget, min_job=min_job)

    placed = [s.item.key for j in p.jobs for s in j.slots]
    assert sorted(placed) == sorted(i.key for i in items)  # each exactly once

    for job in p.jobs:
        # Never more GPUs busy than the runner has, and no GPU id shared at any instant.
        for s in job.slots:
            assert len(s.gpus) == s.item.num_gpus and set(s.gpus) <= {str(g) for g in range(gpus)}
            running = [o for o in job.slots if o.start <= s.start < o.end or o is s]
            assert sum(o.item.num_gpus for o in running) <= gpus
            ids = [g for o in running for g in o.gpus]
            assert len(ids) == len(set(ids))
        # The planned starts are what the GPU lane's packer does with the job's tests.
        expected = lane_starts([s.item for s in job.slots], gpus)
        for s in job.slots:
            assert s.start == pytest.approx(expected[s.item.key], abs=EPS)
        # The budget holds; a test over it opens its own job, timed by that test.
        longs = [s.item for s in job.slots if s.item.est_seconds > budget]
        if job.over_budget:
            assert len(longs) == 1 and job.seconds == pytest.approx(longs[0].est_seconds)
        else:
            assert not longs and job.seconds <= budget + EPS

    makespan = queued_makespan([j.seconds for j in p.jobs], runners) if p.jobs else 0.0
    assert p.makespan == pytest.approx(makespan)
    assert p.makespan >= lower_bound(items, gpus, runners) - EPS
    n = p.budgeted_jobs
    if n:
        rr, rr_within_budget = round_robin(items, gpus, runners, budget, n)
        if rr_within_budget:
            assert p.makespan <= rr + EPS


def test_a_big_realistic_pool_is_near_the_lower_bound():
    """Hundreds of 1-2 GPU tests on six 2-GPU runners: within 5 % of the lower bound."""
    items = [
        PackItem(f"tests/t{k}.py", 1 + (k % 3 == 0), 30 + (k * 7919) % 1500) for k in range(400)
    ]
    p = pack(items, gpus=2, runners=6, budget=3600)
    assert p.ratio <= 1.05, (p.makespan, p.lower_bound)
    assert all(j.seconds <= 3600 for j in p.jobs)


def test_bad_input_is_an_error_naming_the_test():
    with pytest.raises(PackingError, match=r"tests/x\.py: 4 GPU\(s\)"):
        pack([PackItem("tests/x.py", 4, 10.0)], gpus=2, runners=1, budget=60)
    with pytest.raises(PackingError, match="unique"):
        pack([PackItem("a", 1, 1.0), PackItem("a", 1, 2.0)], gpus=2, runners=1, budget=60)
