"""Property tests of the packer: every test placed once, never more GPUs busy than a runner has
(checked on the schedule itself; files that share a GPU at most ``SEATS`` to one, never beside an
exclusive file), the budget kept, every job's schedule the one the GPU lane's packer produces for
it, never worse than plain round-robin run the same way."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.packing.gpus import PackingError, PackItem, Slot, simulate
from mizzen_ci.packing.pool import SEATS, job_gpu_seconds, lower_bound, pack

register_cpu_ci(est_time=25, labels=["ci"])

EPS = 1e-6


def lane_starts(items: list[PackItem], gpus: int) -> dict[str, float]:
    """Start time of each item when the GPU lane's packer runs them on ``gpus`` GPUs."""
    ran = simulate(items, [str(g) for g in range(gpus)], seats=SEATS)
    return {s.item.key: s.start for s in ran}


def queued_makespan(lengths: list[float], runners: int) -> float:
    ends = [0.0] * runners
    for s in lengths:
        heapq.heapreplace(ends, ends[0] + s)
    return max(ends)


def round_robin(
    items: list[PackItem], gpus: int, runners: int, budget: float, n: int, setup: float = 0.0
):
    """(makespan, within budget) of: long tests alone, the rest dealt in order over n jobs; each
    job pays ``setup`` first (``budget``: the tests' time)."""
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
    jobs = sorted((setup + x for x in alone + lengths), reverse=True)
    return queued_makespan(jobs, runners), ok


@st.composite
def pools(draw):
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    runners = draw(st.integers(1, 6))
    budget = draw(st.floats(60, 3600))
    n = draw(st.integers(0, 60))
    items = []
    for k in range(n):
        num_gpus = draw(st.integers(1, gpus))
        seconds = draw(st.one_of(st.floats(0, budget), st.floats(budget, 3 * budget)))
        shares = num_gpus == 1 and draw(st.booleans())
        items.append(PackItem(f"tests/t{k}.py", num_gpus, seconds, shares))
    min_job = draw(st.floats(0, 1800))
    setup = draw(st.one_of(st.just(0.0), st.floats(0, 0.5 * budget)))
    return items, gpus, runners, budget, min_job, setup


@settings(max_examples=250, deadline=None)
@given(pools())
def test_packing_properties(case):
    items, gpus, runners, job_budget, min_job, setup = case
    p = pack(items, gpus=gpus, runners=runners, budget=job_budget, min_job=min_job, setup=setup)
    budget = job_budget - setup  # what a job's tests get

    placed = [s.item.key for j in p.jobs for s in j.slots]
    assert sorted(placed) == sorted(i.key for i in items)  # each exactly once

    for job in p.jobs:
        # Never more GPUs busy than the runner has, and no GPU id shared at any instant.
        for s in job.slots:
            assert len(s.gpus) == s.item.num_gpus and set(s.gpus) <= {str(g) for g in range(gpus)}
            running = [o for o in job.slots if o.start <= s.start < o.end or o is s]
            for gpu in {g for o in running for g in o.gpus}:
                holders = [o.item for o in running if gpu in o.gpus]
                if len(holders) > 1:  # only sharing files hold a GPU together, SEATS at most
                    assert all(h.shares_gpu for h in holders) and len(holders) <= SEATS
        # The planned starts are what the GPU lane's packer does with the job's tests.
        expected = lane_starts([s.item for s in job.slots], gpus)
        for s in job.slots:
            assert s.start == pytest.approx(expected[s.item.key], abs=EPS)
        # The budget holds; a test over it opens its own job, timed by that test.
        longs = [s.item for s in job.slots if s.item.est_seconds > budget]
        if job.over_budget:  # timed by its longest test (long tests may share one such job)
            assert longs and job.seconds == pytest.approx(max(i.est_seconds for i in longs))
        else:
            assert not longs and job.seconds <= budget + EPS

    makespan = queued_makespan([setup + j.seconds for j in p.jobs], runners) if p.jobs else 0.0
    assert p.makespan == pytest.approx(makespan)  # every job pays its set-up
    assert p.makespan >= lower_bound(items, gpus, runners, setup) - EPS
    n = p.budgeted_jobs
    if n:
        rr, rr_within_budget = round_robin(items, gpus, runners, budget, n, setup)
        if rr_within_budget:
            assert p.makespan <= rr + EPS


@pytest.mark.parametrize("runners", [1, 2, 3, 5])
@pytest.mark.parametrize("setup", [0.0, 120.0, 600.0])
def test_with_set_up_the_packer_finds_the_best_job_count_for_equal_tests(runners, setup):
    # 24 one-minute tests: the best plan over every job count (tests split evenly, jobs queued
    # on the runners, each paying its set-up) is what the packer must match.
    items = [PackItem(f"tests/t{k:02d}.py", 1, 60.0) for k in range(24)]
    best = float("inf")
    for n in range(1, len(items) + 1):
        q, extra = divmod(len(items), n)
        lengths = sorted((setup + 60.0 * (q + (j < extra)) for j in range(n)), reverse=True)
        if lengths[0] <= 3600:
            best = min(best, queued_makespan(lengths, runners))
    p = pack(items, gpus=1, runners=runners, budget=3600, min_job=0, setup=setup)
    assert p.makespan <= best + EPS, (p.makespan, best, len(p.jobs))
    with_more_jobs = pack(items, gpus=1, runners=runners, budget=3600, min_job=0, setup=0.0)
    if setup and len(with_more_jobs.jobs) > runners:
        assert len(p.jobs) <= len(with_more_jobs.jobs)  # a set-up never buys more waves


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


def test_files_that_share_a_gpu_are_planned_side_by_side_as_the_lane_runs_them():
    """The hopper lane of RESULTS.md (seven sharing one-GPU files, cold estimates): one job on a
    one-GPU runner, as long as its longest file (the lane runs four at a time), not their sum;
    its GPU-seconds are the shares the lane charges, and the bound is that job."""
    seconds = {"nemotron": 212.8, "rl": 161.1, "sft": 139.9, "deepseek": 108.1, "causal": 99.6,
               "lora": 22.0, "basics": 8.6}  # fmt: skip
    items = [PackItem(f"tests/{k}.py", 1, v, shares_gpu=True) for k, v in seconds.items()]
    p = pack(items, gpus=1, runners=1, budget=3600, setup=300)
    assert len(p.jobs) == 1 and p.makespan == pytest.approx(300 + 212.8)
    starts = {s.item.key: s.start for s in p.jobs[0].slots}
    assert [k for k, t in starts.items() if t == 0] == [f"tests/{k}.py" for k in list(seconds)[:4]]
    assert sum(i.charged_gpu_seconds(SEATS) for i in items) == pytest.approx(
        sum(seconds.values()) / 4
    )
    assert p.lower_bound == pytest.approx(300 + 212.8)
    # what the lane charges: the GPU's time split between the files holding it, i.e. the span
    # it was held (0 to 212.8 s), not the sum of walls (852.1) nor a quarter of it (213.0)
    assert job_gpu_seconds(p.jobs[0].slots) == pytest.approx(212.8)
    late = [*items[:1], PackItem("tests/late.py", 1, 10.0, shares_gpu=True)]
    slots = (Slot(late[0], ("0",), 0.0, 212.8), Slot(late[1], ("0",), 300.0, 310.0))
    assert job_gpu_seconds(slots) == pytest.approx(222.8)  # a gap is not charged
    exclusive = Slot(PackItem("tests/wide.py", 2, 5.0), ("0", "1"), 0.0, 5.0)
    assert job_gpu_seconds((*slots, exclusive)) == pytest.approx(232.8)
    alone = [PackItem(i.key, 1, i.est_seconds) for i in items]  # the same files, exclusive
    assert pack(alone, gpus=1, runners=1, budget=3600, setup=300).makespan == pytest.approx(
        300 + sum(seconds.values())
    )
