"""Packing tests into runner-jobs of one pool: how many jobs, which tests, in what order.

The model (the one the GPU lane executes):
- A *job* holds one runner of the pool, which has ``gpus`` GPUs, for at most ``budget`` seconds:
  ``setup`` seconds of set-up (checkout, environment, image) and then its tests, so the tests of
  a job have ``budget - setup`` seconds.
- Inside a job, tests run side by side the way the GPU lane runs them
  (:mod:`mizzen_ci.packing.gpus`, whose item, slot and error types this module shares): longest
  first, and whenever GPUs free up every waiting test that fits starts (backfill); files that
  share a GPU (``shares_gpu``) run :data:`SEATS` to one (the lane's default seats).  The bound
  and the placement count a sharing file 1/SEATS of its time (:func:`gpu_work`, the least it
  can cost); a pool's GPU-seconds are what the lane charges for its simulated jobs
  (:func:`job_gpu_seconds`).  :func:`simulate_job` is that packer run on the estimates; a job's
  length is when its last test ends.
- The pool has ``runners`` runners; the pool's jobs are queued in the packing's order and each
  starts on the first runner that frees up.  The pool's *makespan* is when its last job ends,
  set-up included: a job more costs a set-up more, so a count of jobs wins only when it ends the
  pool sooner.
- Lower bound of any schedule (:func:`lower_bound`): ``max(longest test + setup, T + setup ×
  ⌈T / (budget - setup)⌉)`` with ``T = total GPU-seconds / (gpus × runners)``: the busiest runner
  works at least ``T`` and, as a job's tests get ``budget - setup``, pays a set-up per job it
  needs (when no test is longer than that; else one set-up).

Placement decisions use a simpler, conservative model of a job (each test, in longest-first
order, starts when its ``num_gpus``-th GPU frees up, no backfill); every candidate is then
scored by simulating its jobs with the lane's packer and rejected if a job breaks the budget.

The packer (every candidate below is scored by the pool makespan; the best one is kept, ties
going to fewer jobs):
1. A test longer than the budget opens a job of its own, timed by that test (the caller warns),
   unless it fits beside a longer such test (then it joins that job).  Spare GPUs take other
   tests only where they end before the job's longest test does, so that job is never longer
   than its test and no budgeted job is stretched by it.
2. *Job count*: the budgeted jobs number at least ``ceil(W / (gpus × budget))`` (W: GPU-seconds
   not absorbed beside the long tests) and are spread over up to ``runners`` while each keeps
   ``min_job`` seconds of work (a job costs a runner's set-up); a few counts around that are
   packed longest first, each test into the job where it *finishes* earliest, never past the
   budget (a count that cannot hold them is rejected, and so is one whose simulated jobs break
   the budget).
3. *Timeline*: for a target makespan T (bisected between the lower bound and the best so far),
   the long tests go to runners longest first, each runner's remaining time up to T is cut into
   jobs of ``budget`` seconds plus one remainder, the tests are placed as in 2, and the jobs are
   queued in the order that hands every runner its planned jobs.  This balances the runners when
   the jobs cannot all be equally long.
4. Round-robin (tests dealt in the given order) over as many budgeted jobs as the winner has is
   computed too and wins if it is better: the result is never worse than round-robin.

Invariants: every item is placed exactly once; no job has more GPUs busy than it has at any
instant; pure and deterministic (ties broken by item key and job index).  Stdlib only.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .gpus import DEFAULT_GPU_SEATS as SEATS
from .gpus import PackingError, PackItem, Slot, split_held_time
from .gpus import simulate as lane_simulate


def gpu_work(item: PackItem) -> float:
    """The least GPU-seconds ``item`` can cost a job: a sharing file 1/:data:`SEATS` of its
    time (a full GPU); what the bound and the placement count."""
    return item.charged_gpu_seconds(SEATS)


def job_gpu_seconds(slots: Sequence[Slot]) -> float:
    """The GPU-seconds the lane would charge for a job that runs as ``slots``
    (:func:`mizzen_ci.packing.gpus.split_held_time`, the summary's accounting)."""
    charged, _ = split_held_time(
        (s.item.key, s.gpus, s.start, s.end, s.item.shares_gpu and SEATS > 1) for s in slots
    )
    return sum(charged.values())


@dataclass(frozen=True)
class PackedJob:
    """A runner job as packed: its tests' slots; ``over_budget`` when it holds one test longer than
    the budget."""

    slots: tuple[Slot, ...]
    over_budget: bool = False  # a single test longer than the budget

    @property
    def seconds(self) -> float:
        return max((s.end for s in self.slots), default=0.0)


@dataclass(frozen=True)
class Packing:
    """The jobs of one pool (longest first) and how good the schedule is."""

    jobs: tuple[PackedJob, ...]
    gpus: int
    runners: int
    budget: float
    makespan: float
    lower_bound: float
    strategy: str  # "longest-first" | "timeline" | "split" | "round-robin"
    setup: float = 0.0

    @property
    def budgeted_jobs(self) -> int:
        """How many jobs hold no test over the budget."""
        return sum(not j.over_budget for j in self.jobs)

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0


def lower_bound(
    items: Sequence[PackItem],
    gpus: int,
    runners: int,
    setup: float = 0.0,
    budget: float = math.inf,
) -> float:
    """The bound of the module docstring (``budget``: a job's, set-up included)."""
    if not items:
        return 0.0
    longest = max(i.est_seconds for i in items)
    fluid = sum(gpu_work(i) for i in items) / (gpus * runners)
    return max(longest + setup, with_setups(fluid, setup, budget, longest))


def with_setups(work: float, setup: float, budget: float, longest: float) -> float:
    """``work`` seconds on one runner plus the set-ups of the jobs it needs at least: one per
    ``budget - setup`` of work, when no test is longer than that (else one)."""
    span = budget - setup
    if not math.isfinite(span) or longest > span or work <= 0:
        return work + setup
    return work + setup * max(1, math.ceil(work / span - 1e-9))


def simulate_job(items: Sequence[PackItem], gpus: int) -> tuple[Slot, ...]:
    """The schedule the GPU lane follows for ``items`` on a runner of ``gpus`` GPUs: its own
    packer (:func:`mizzen_ci.packing.gpus.simulate`: longest first, every test that fits starts as
    GPUs free up), so a planned job's length is what the lane will take if estimates hold."""
    for item in items:
        if item.num_gpus > gpus:
            raise PackingError(f"{item.key} needs {item.num_gpus} GPUs; the runner has {gpus}")
    return tuple(lane_simulate(items, _GPU_NAMES[:gpus], seats=SEATS))


_GPU_NAMES = tuple(str(g) for g in range(1024))


def queue_makespan(job_seconds: Sequence[float], runners: int) -> float:
    """When the last of ``job_seconds`` (queued in this order) ends on ``runners`` runners."""
    if not job_seconds:
        return 0.0
    ends = [0.0] * min(runners, len(job_seconds))
    for s in job_seconds:
        heapq.heapreplace(ends, ends[0] + s)
    return max(ends)


def longest_first(items: Sequence[PackItem]) -> list[PackItem]:
    return sorted(items, key=lambda i: (-i.est_seconds, -i.num_gpus, i.key))


def _finalise(
    jobs: list[PackedJob],
    gpus: int,
    runners: int,
    budget: float,
    lb: float,
    strategy: str,
    ordered: bool = False,
    setup: float = 0.0,
) -> Packing:
    """A :class:`Packing` of ``jobs`` queued in their order (longest first unless ``ordered``),
    each holding its runner for ``setup`` seconds before its tests."""
    if not ordered:
        jobs = sorted(jobs, key=lambda j: (-j.seconds, j.slots[0].item.key))
    makespan = queue_makespan([setup + j.seconds for j in jobs], runners)
    return Packing(tuple(jobs), gpus, runners, budget, makespan, lb, strategy, setup)


def _fill_beside(
    anchors: Sequence[PackItem], items: list[PackItem], gpus: int
) -> tuple[list[PackedJob], list[PackItem]]:
    """One job per long test (over the budget), longest first; a long test that fits beside a
    longer one (its GPUs free, ending before it) joins that one's job instead of opening its own;
    the spare GPUs are then filled with tests that end before the job's longest test does,
    checked by simulating the job as the lane runs it.  Returns the jobs and the tests left."""
    contents: list[list[PackItem]] = []
    room: list[float] = []  # spare GPU-seconds under each job's longest test
    jobs: list[PackedJob] = []

    def place(item: PackItem) -> bool:
        for k in sorted(range(len(contents)), key=lambda k: (-room[k], k)):
            head = contents[k][0]
            if gpu_work(item) > room[k]:
                continue
            trial = PackedJob(simulate_job([*contents[k], item], gpus), over_budget=True)
            if trial.seconds <= head.est_seconds * (1 + 1e-9):
                contents[k].append(item)
                room[k] -= gpu_work(item)
                jobs[k] = trial
                return True
        return False

    for a in anchors:  # (longest first)
        if not place(a):
            contents.append([a])
            room.append((gpus - a.num_gpus) * a.est_seconds)
            jobs.append(PackedJob(simulate_job([a], gpus), over_budget=True))
    left = [item for item in items if not place(item)]
    return jobs, left


def _earliest_finish(
    items: list[PackItem], gpus: int, limits: Sequence[float]
) -> list[PackedJob | None] | None:
    """Longest-first, each item into the job where it finishes earliest within that job's
    limit (in the conservative model); ``None`` when some item fits no job."""
    jobs = len(limits)
    free = [[0.0] * gpus for _ in range(jobs)]  # per job, GPU free times sorted ascending
    version = [0] * jobs
    sizes = sorted({i.num_gpus for i in items})
    heaps = {g: [(0.0, j, 0) for j in range(jobs)] for g in sizes}
    placed: list[list[PackItem]] = [[] for _ in range(jobs)]
    for item in items:
        heap, skipped, found = heaps[item.num_gpus], [], None
        while heap:
            start, j, ver = heapq.heappop(heap)
            if ver != version[j]:
                continue  # stale
            skipped.append((start, j, ver))
            if start + item.est_seconds <= limits[j]:
                found = (start, j)
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if found is None:
            return None
        start, j = found
        placed[j].append(item)
        f = free[j]
        end = start + item.est_seconds
        del f[: item.num_gpus]
        for _ in range(item.num_gpus):
            bisect.insort(f, end)
        version[j] += 1
        for g in sizes:
            h = heaps[g]
            heapq.heappush(h, (f[g - 1], j, version[j]))
            if len(h) > 4 * jobs + 64:  # drop stale entries now and then
                h[:] = [e for e in h if e[2] == version[e[1]]]
                heapq.heapify(h)
    return [PackedJob(simulate_job(p, gpus)) if p else None for p in placed]


def _round_robin(items: Sequence[PackItem], gpus: int, n: int) -> list[PackedJob]:
    per_job: list[list[PackItem]] = [[] for _ in range(n)]
    for k, item in enumerate(items):
        per_job[k % n].append(item)
    return [PackedJob(simulate_job(longest_first(p), gpus)) for p in per_job if p]


def job_counts(
    items: Sequence[PackItem], gpus: int, runners: int, budget: float, min_job: float
) -> list[int]:
    """The counts of budgeted jobs worth trying for ``items`` on ``runners`` runners."""
    if not items:
        return [0]
    work = sum(gpu_work(i) for i in items)
    longest = max(i.est_seconds for i in items)
    by_budget = math.ceil(work / (gpus * budget))
    spread = min(runners, math.ceil(work / (gpus * max(min_job, longest, 1e-9))))
    low = max(1, by_budget, spread)
    # a few counts above the least, as long as each job keeps ``min_job`` seconds of work
    counts = {low} | {
        c for c in range(low + 1, min(low + 3, len(items)) + 1) if work / (gpus * c) >= min_job
    }
    if low > runners:  # several waves: whole waves keep the runners busy to the end
        counts.add(min(len(items), math.ceil(low / runners) * runners))
    return sorted(counts)


def pack(
    items: Sequence[PackItem],
    *,
    gpus: int,
    runners: int,
    budget: float,
    min_job: float = 300.0,
    setup: float = 0.0,
) -> Packing:
    """Pack ``items`` into jobs of one pool (see the module docstring)."""
    if gpus < 1 or runners < 1 or budget <= 0 or not 0 <= setup < budget:
        raise PackingError(
            f"bad pool: gpus={gpus}, runners={runners}, budget={budget}, set-up {setup} "
            "(the set-up must leave time for tests inside the budget)"
        )
    job_budget, budget = budget, budget - setup  # from here on, `budget` is the tests' time
    keys = [i.key for i in items]
    if len(set(keys)) != len(keys):
        raise PackingError("item keys must be unique")
    for i in items:
        if (
            i.num_gpus < 1
            or i.num_gpus > gpus
            or not (i.est_seconds >= 0 and math.isfinite(i.est_seconds))
        ):
            raise PackingError(
                f"{i.key}: {i.num_gpus} GPU(s), {i.est_seconds} s does not fit {gpus} GPUs"
            )
    if not items:
        return Packing((), gpus, runners, job_budget, 0.0, 0.0, "longest-first", setup)
    lb = lower_bound(items, gpus, runners, setup, job_budget)
    finalise = functools.partial(
        _finalise, gpus=gpus, runners=runners, budget=job_budget, lb=lb, setup=setup
    )
    anchors = longest_first([i for i in items if i.est_seconds > budget])
    anchor_jobs, rest = _fill_beside(
        anchors, longest_first([i for i in items if i.est_seconds <= budget]), gpus
    )
    free_runners = max(1, runners - len(anchor_jobs))

    best: Packing | None = None
    tried: set[int] = set()
    counts = job_counts(rest, gpus, free_runners, budget, min_job)
    while counts:
        n = counts.pop(0)
        tried.add(n)
        found = _earliest_finish(rest, gpus, [budget] * n) if n else []
        jobs = None if found is None else anchor_jobs + [j for j in found if j]
        if jobs is None or not _valid(jobs, budget):  # too few jobs for the budget: more
            bigger = min(len(rest), n + max(1, n // 8))
            if best is None and bigger not in tried:
                counts = sorted(set(counts) | {bigger})
            continue
        p = finalise(jobs, strategy="longest-first")
        if best is None or _better(p, best):
            best = p
    assert best is not None  # n = len(rest) always fits: each item alone is within the budget
    timeline = _timeline_search(
        anchor_jobs, rest, gpus, runners, budget, min_job, lb, best.makespan, setup, finalise
    )
    if timeline is not None and _better(timeline, best):
        best = timeline
    # Whole-runner tests in jobs of their own: they never wait for a runner to drain.
    wide = [i for i in rest if i.num_gpus == gpus]
    if wide and len(wide) < len(rest):
        narrow = [i for i in rest if i.num_gpus < gpus]
        parts = []
        for group in (wide, narrow):
            for n in [*job_counts(group, gpus, free_runners, budget, min_job), len(group)]:
                found = _earliest_finish(group, gpus, [budget] * n)
                if found is not None and _valid(got := [j for j in found if j], budget):
                    parts.append(got)
                    break
        if len(parts) == 2:
            p = finalise(anchor_jobs + parts[0] + parts[1], strategy="split")
            if _better(p, best):
                best = p
    # Round-robin (in the given order, long tests alone) over as many budgeted jobs as the
    # winner has: the result is never worse than it.
    n = best.budgeted_jobs
    if n:
        alone = [PackedJob(simulate_job([a], gpus), over_budget=True) for a in anchors]
        rr = alone + _round_robin([i for i in items if i.est_seconds <= budget], gpus, n)
        if _valid(rr, budget):
            candidate = finalise(rr, strategy="round-robin")
            if _better(candidate, best):
                best = candidate
    return best


def _valid(jobs: Sequence[PackedJob], budget: float) -> bool:
    """Every budgeted job within the budget, every long test's job no longer than that test."""
    for job in jobs:
        if job.over_budget:
            anchor = max(s.item.est_seconds for s in job.slots)
            if job.seconds > anchor * (1 + 1e-9):
                return False
        elif job.seconds > budget * (1 + 1e-9):
            return False
    return True


def _better(a: Packing, b: Packing) -> bool:
    return (a.makespan, len(a.jobs)) < (b.makespan, len(b.jobs))


def _timeline_pack(
    anchor_jobs: Sequence[PackedJob],
    rest: list[PackItem],
    gpus: int,
    runners: int,
    budget: float,
    target: float,
    setup: float = 0.0,
) -> list[PackedJob] | None:
    """Jobs that give each runner about ``target`` seconds, set-ups included, queued in the order
    that hands each runner its planned jobs; ``None`` when the tests do not fit.

    The long tests' jobs go to runners longest first (least loaded runner); each runner's
    remaining time up to ``target`` is cut into jobs of ``setup + budget`` seconds and one
    shorter remainder, and the tests are placed into those by :func:`_earliest_finish`."""
    load = [0.0] * runners
    plan: list[list[PackedJob | int]] = [
        [] for _ in range(runners)
    ]  # a job, or an index into found
    for job in anchor_jobs:
        r = min(range(runners), key=lambda r: (load[r], r))
        load[r] += setup + job.seconds
        plan[r].append(job)
    limits: list[float] = []
    for r in range(runners):
        room = target - load[r]
        if room <= setup or not rest:
            continue
        full, remainder = divmod(room, setup + budget)
        remainder -= setup
        for limit in [budget] * int(full) + ([remainder] if remainder > 1e-6 * budget else []):
            plan[r].append(len(limits))
            limits.append(limit)
    found = _earliest_finish(rest, gpus, limits) if rest else []
    if found is None:
        return None
    # Queue order: replay the runners, the one that frees first taking its next planned job.
    queue = [[x if isinstance(x, PackedJob) else found[x] for x in p] for p in plan]
    queue = [[j for j in q if j is not None] for q in queue]  # planned jobs that got no test
    order: list[PackedJob] = []
    free = [(0.0, r) for r in range(runners) if queue[r]]
    heapq.heapify(free)
    cursor = [0] * runners
    while free:
        t, r = heapq.heappop(free)
        job = queue[r][cursor[r]]
        cursor[r] += 1
        order.append(job)
        if cursor[r] < len(queue[r]):
            heapq.heappush(free, (t + setup + job.seconds, r))
    return order


def _timeline_search(
    anchor_jobs: Sequence[PackedJob],
    rest: list[PackItem],
    gpus: int,
    runners: int,
    budget: float,
    min_job: float,
    lb: float,
    upper: float,
    setup: float,
    finalise: functools.partial,
) -> Packing | None:
    """The best :func:`_timeline_pack` over targets between the lower bound and ``upper``."""
    if not rest:
        return None
    work = sum(gpu_work(i) for i in rest) + sum(gpus * j.seconds for j in anchor_jobs)
    longest = max([i.est_seconds for i in rest] + [j.seconds for j in anchor_jobs])
    spread = math.ceil(work / (gpus * max(min_job, longest, 1e-9)))
    used = max(1, min(runners, max(len(anchor_jobs), spread)))
    lo, hi = max(lb, work / (gpus * used) + setup), max(upper, lb)
    best = None
    targets = [lo]
    for _ in range(14):
        target = targets.pop() if targets else (lo + hi) / 2
        jobs = _timeline_pack(anchor_jobs, rest, gpus, used, budget, target, setup)
        if jobs is not None and not _valid(jobs, budget):
            jobs = None
        if jobs is None:
            lo = target
        else:
            p = finalise(jobs, strategy="timeline", ordered=True)
            if best is None or _better(p, best):
                best = p
            hi = target
        if hi - lo <= 0.002 * lb:
            break
    return best
