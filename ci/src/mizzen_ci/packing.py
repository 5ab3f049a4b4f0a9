"""Packing tests into runner-jobs of one pool: how many jobs, which tests, in what order.

The model (the same one the GPU lane executes):
- A *job* holds one runner of the pool, which has ``gpus`` GPUs, for at most ``budget`` seconds.
- Inside a job, tests run side by side: in the job's order (longest first), each test starts as
  soon as ``num_gpus`` GPUs are free (the ``num_gpus``-th earliest free time) and takes those
  GPUs until it ends.  :func:`simulate_job` computes that schedule; a job's length is its end.
- The pool has ``runners`` runners; the pool's jobs are queued in the packing's order and each
  starts on the first runner that frees up.  The pool's *makespan* is when its last job ends.
- Lower bound of any schedule: ``max(total GPU-seconds / (gpus × runners), longest test)``.

The packer (every candidate below is scored by the pool makespan; the best one is kept, ties
going to fewer jobs):
1. A test longer than the budget opens a job of its own, timed by that test (the caller warns).
   Its spare GPUs take other tests only where they end before it does, so that job is never
   longer than its test and no budgeted job is stretched by it.
2. *Job count*: the budgeted jobs number at least ``ceil(W / (gpus × budget))`` (W: GPU-seconds
   not absorbed beside the long tests) and are spread over up to ``runners`` while each keeps
   ``min_job`` seconds of work (a job costs a runner's set-up); a few counts around that are
   packed longest first, each test into the job where it *finishes* earliest, never past the
   budget (a count that cannot hold them is rejected).
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

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """One test to run on one arch: a unique key, the GPUs it holds and its estimated seconds."""

    key: str
    gpus: int
    seconds: float

    @property
    def gpu_seconds(self) -> float:
        return self.gpus * self.seconds


@dataclass(frozen=True)
class Slot:
    """An item scheduled in a job: when it starts (seconds after the job starts) and on which
    GPUs (indices ``0..gpus-1`` of the job's runner)."""

    item: Item
    start: float
    gpu_ids: tuple[int, ...]

    @property
    def end(self) -> float:
        return self.start + self.item.seconds


@dataclass(frozen=True)
class Job:
    slots: tuple[Slot, ...]
    over_budget: bool = False  # a single test longer than the budget

    @property
    def seconds(self) -> float:
        return max((s.end for s in self.slots), default=0.0)


@dataclass(frozen=True)
class Packing:
    """The jobs of one pool (longest first) and how good the schedule is."""

    jobs: tuple[Job, ...]
    gpus: int
    runners: int
    budget: float
    makespan: float
    lower_bound: float
    strategy: str  # "longest-first" | "timeline" | "round-robin"

    @property
    def budgeted_jobs(self) -> int:
        """How many jobs hold no test over the budget."""
        return sum(not j.over_budget for j in self.jobs)

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0


class PackingError(ValueError):
    pass


def lower_bound(items: Sequence[Item], gpus: int, runners: int) -> float:
    if not items:
        return 0.0
    work = sum(i.gpu_seconds for i in items)
    return max(work / (gpus * runners), max(i.seconds for i in items))


def simulate_job(items: Sequence[Item], gpus: int) -> tuple[Slot, ...]:
    """The in-job schedule of ``items`` in the given order (see the module docstring)."""
    free = [(0.0, g) for g in range(gpus)]  # (free at, gpu id), kept sorted
    slots = []
    for item in items:
        if item.gpus > gpus:
            raise PackingError(f"{item.key} needs {item.gpus} GPUs; the runner has {gpus}")
        taken, free = free[: item.gpus], free[item.gpus :]
        start = taken[-1][0]
        end = start + item.seconds
        slots.append(Slot(item, start, tuple(sorted(g for _, g in taken))))
        for _, g in taken:
            _insort(free, (end, g))
    return tuple(slots)


def _insort(free: list[tuple[float, int]], entry: tuple[float, int]) -> None:
    lo, hi = 0, len(free)
    while lo < hi:
        mid = (lo + hi) // 2
        if free[mid] < entry:
            lo = mid + 1
        else:
            hi = mid
    free.insert(lo, entry)


def queue_makespan(job_seconds: Sequence[float], runners: int) -> float:
    """When the last of ``job_seconds`` (queued in this order) ends on ``runners`` runners."""
    if not job_seconds:
        return 0.0
    ends = [0.0] * min(runners, len(job_seconds))
    for s in job_seconds:
        heapq.heapreplace(ends, ends[0] + s)
    return max(ends)


def longest_first(items: Sequence[Item]) -> list[Item]:
    return sorted(items, key=lambda i: (-i.seconds, -i.gpus, i.key))


def _finalise(
    jobs: list[Job],
    gpus: int,
    runners: int,
    budget: float,
    lb: float,
    strategy: str,
    ordered: bool = False,
) -> Packing:
    """A :class:`Packing` of ``jobs`` queued in their order (longest first unless ``ordered``)."""
    if not ordered:
        jobs = sorted(jobs, key=lambda j: (-j.seconds, j.slots[0].item.key))
    makespan = queue_makespan([j.seconds for j in jobs], runners)
    return Packing(tuple(jobs), gpus, runners, budget, makespan, lb, strategy)


def _earliest_finish(
    items: list[Item], gpus: int, limits: Sequence[float], anchors: Sequence[Item] = ()
) -> list[Job | None] | None:
    """Longest-first, each item into the job where it finishes earliest within that job's
    budget; ``None`` when some item fits no job.

    Each anchor (a test over the budget) opens a job of its own whose budget is the anchor's
    length; its spare GPUs are filled first, since an item that ends before the anchor costs
    nothing there, and only what fits no anchor goes to the ``n`` budgeted jobs."""
    jobs = len(anchors) + len(limits)
    free = [[0.0] * gpus for _ in range(jobs)]  # per job, GPU free times sorted ascending
    limit = [a.seconds for a in anchors] + list(limits)
    placed: list[list[Item]] = [[] for _ in range(jobs)]
    for j, a in enumerate(anchors):
        placed[j].append(a)
        free[j] = [0.0] * (gpus - a.gpus) + [a.seconds] * a.gpus
    version = [0] * jobs
    sizes = sorted({i.gpus for i in items})
    groups = (range(len(anchors)), range(len(anchors), jobs))
    heaps = {
        (k, g): sorted((free[j][g - 1], j, 0) for j in group)
        for k, group in enumerate(groups)
        for g in sizes
    }

    def best_in(heap: list) -> tuple[float, int] | None:
        skipped, found = [], None
        while heap:
            start, j, ver = heapq.heappop(heap)
            if ver != version[j]:
                continue  # stale
            skipped.append((start, j, ver))
            if start + item.seconds <= limit[j]:
                found = (start, j)
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    for item in items:
        found = best_in(heaps[0, item.gpus]) or best_in(heaps[1, item.gpus])
        if found is None:
            return None
        start, j = found
        placed[j].append(item)
        f = free[j]
        end = start + item.seconds
        del f[: item.gpus]
        for _ in range(item.gpus):
            _insort_float(f, end)
        version[j] += 1
        k = 0 if j < len(anchors) else 1
        for g in sizes:
            heap = heaps[k, g]
            heapq.heappush(heap, (f[g - 1], j, version[j]))
            if len(heap) > 4 * jobs + 64:  # drop stale entries now and then
                heap[:] = [e for e in heap if e[2] == version[e[1]]]
                heapq.heapify(heap)
    return [
        Job(simulate_job(p, gpus), over_budget=j < len(anchors)) if p else None
        for j, p in enumerate(placed)
    ]


def _insort_float(values: list[float], x: float) -> None:
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    values.insert(lo, x)


def _round_robin(items: Sequence[Item], gpus: int, n: int) -> list[Job]:
    per_job: list[list[Item]] = [[] for _ in range(n)]
    for k, item in enumerate(items):
        per_job[k % n].append(item)
    return [Job(simulate_job(longest_first(p), gpus)) for p in per_job if p]


def job_counts(
    items: Sequence[Item],
    gpus: int,
    runners: int,
    budget: float,
    min_job: float,
    anchors: Sequence[Item] = (),
) -> list[int]:
    """The counts of budgeted jobs worth trying for ``items`` (besides one job per anchor)."""
    if not items:
        return [0]
    spare = sum((gpus - a.gpus) * a.seconds for a in anchors)  # room beside the anchors
    work = max(0.0, sum(i.gpu_seconds for i in items) - spare)
    longest = max(i.seconds for i in items)
    free_runners = max(1, runners - len(anchors))
    by_budget = math.ceil(work / (gpus * budget))
    spread = min(free_runners, math.ceil(work / (gpus * max(min_job, longest, 1e-9))))
    low = max(0 if anchors else 1, by_budget, spread)
    # a few counts above the least, as long as each job keeps ``min_job`` seconds of work
    counts = {low} | {
        c for c in range(low + 1, min(low + 3, len(items)) + 1) if work / (gpus * c) >= min_job
    }
    if low > free_runners:  # several waves: whole waves keep the runners busy to the end
        counts.add(min(len(items), math.ceil(low / free_runners) * free_runners))
    return sorted(counts)


def pack(
    items: Sequence[Item],
    *,
    gpus: int,
    runners: int,
    budget: float,
    min_job: float = 300.0,
) -> Packing:
    """Pack ``items`` into jobs of one pool (see the module docstring)."""
    if gpus < 1 or runners < 1 or budget <= 0:
        raise PackingError(f"bad pool: gpus={gpus}, runners={runners}, budget={budget}")
    keys = [i.key for i in items]
    if len(set(keys)) != len(keys):
        raise PackingError("item keys must be unique")
    for i in items:
        if i.gpus < 1 or i.gpus > gpus or not (i.seconds >= 0 and math.isfinite(i.seconds)):
            raise PackingError(f"{i.key}: {i.gpus} GPU(s), {i.seconds} s does not fit {gpus} GPUs")
    if not items:
        return Packing((), gpus, runners, budget, 0.0, 0.0, "longest-first")
    lb = lower_bound(items, gpus, runners)
    anchors = longest_first([i for i in items if i.seconds > budget])
    rest = longest_first([i for i in items if i.seconds <= budget])
    alone = [Job(simulate_job([a], gpus), over_budget=True) for a in anchors]

    best: Packing | None = None
    tried: set[int] = set()
    counts = job_counts(rest, gpus, runners, budget, min_job, anchors)
    while counts:
        n = counts.pop(0)
        tried.add(n)
        found = _earliest_finish(rest, gpus, [budget] * n, anchors)
        jobs = None if found is None else [j for j in found if j is not None]
        if jobs is None:  # too few jobs for the budget: try more
            bigger = min(len(rest), n + max(1, n // 8))
            if best is None and bigger not in tried:
                counts = sorted(set(counts) | {bigger})
            continue
        p = _finalise(jobs, gpus, runners, budget, lb, "longest-first")
        if best is None or _better(p, best):
            best = p
    assert best is not None  # n = len(rest) always fits: each item alone is within the budget
    timeline = _timeline_search(anchors, rest, gpus, runners, budget, min_job, lb, best.makespan)
    if timeline is not None and _better(timeline, best):
        best = timeline
    # Round-robin (in the given order) over as many budgeted jobs as the winner has: the result
    # is never worse than it.
    n = best.budgeted_jobs
    if n:
        rr = alone + _round_robin([i for i in items if i.seconds <= budget], gpus, n)
        if all(j.seconds <= budget for j in rr if not j.over_budget):
            candidate = _finalise(rr, gpus, runners, budget, lb, "round-robin")
            if _better(candidate, best):
                best = candidate
    return best


def _better(a: Packing, b: Packing) -> bool:
    return (a.makespan, len(a.jobs)) < (b.makespan, len(b.jobs))


def _timeline_pack(
    anchors: Sequence[Item],
    rest: list[Item],
    gpus: int,
    runners: int,
    budget: float,
    target: float,
) -> list[Job] | None:
    """Jobs that give each runner about ``target`` seconds, queued in the order that hands each
    runner its planned jobs; ``None`` when the tests do not fit.

    Anchors go to runners longest first (least loaded runner); each runner's remaining time up
    to ``target`` is cut into jobs of ``budget`` seconds and one shorter remainder, and the
    tests are placed
    into those jobs (and beside the anchors) by :func:`_earliest_finish`."""
    load = [0.0] * runners
    plan: list[list[int]] = [[] for _ in range(runners)]  # job indices per runner
    for k, a in enumerate(anchors):
        r = min(range(runners), key=lambda r: (load[r], r))
        load[r] += a.seconds
        plan[r].append(k)
    limits: list[float] = []
    for r in range(runners):
        room = target - load[r]
        if room <= 0 or not rest:
            continue
        full, remainder = divmod(room, budget)
        for limit in [budget] * int(full) + ([remainder] if remainder > 1e-6 * budget else []):
            plan[r].append(len(anchors) + len(limits))
            limits.append(limit)
    found = _earliest_finish(rest, gpus, limits, anchors)
    if found is None:
        return None
    # Queue order: replay the runners, the one that frees first taking its next planned job.
    order: list[Job] = []
    free = [(0.0, r) for r in range(runners)]
    heapq.heapify(free)
    cursor = [0] * runners
    while free:
        t, r = heapq.heappop(free)
        while cursor[r] < len(plan[r]) and found[plan[r][cursor[r]]] is None:
            cursor[r] += 1  # a planned job that received no test
        if cursor[r] == len(plan[r]):
            continue
        job = found[plan[r][cursor[r]]]
        cursor[r] += 1
        order.append(job)
        heapq.heappush(free, (t + job.seconds, r))
    return order


def _timeline_search(
    anchors: Sequence[Item],
    rest: list[Item],
    gpus: int,
    runners: int,
    budget: float,
    min_job: float,
    lb: float,
    upper: float,
) -> Packing | None:
    """The best :func:`_timeline_pack` over targets between the lower bound and ``upper``."""
    if not rest:
        return None
    work = sum(i.gpu_seconds for i in rest) + sum(a.gpu_seconds for a in anchors)
    longest = max(i.seconds for i in (*anchors, *rest))
    used = min(runners, max(len(anchors), math.ceil(work / (gpus * max(min_job, longest, 1e-9)))))
    used = max(used, 1)
    lo, hi = max(lb, work / (gpus * used)), max(upper, lb)
    best = None
    targets = [lo]
    for _ in range(14):
        target = targets.pop() if targets else (lo + hi) / 2
        jobs = _timeline_pack(anchors, rest, gpus, used, budget, target)
        if jobs is None:
            lo = target
        else:
            p = _finalise(jobs, gpus, runners, budget, lb, "timeline", ordered=True)
            if best is None or _better(p, best):
                best = p
            hi = target
        if hi - lo <= 0.002 * lb:
            break
    return best


def round_robin_makespan(
    items: Sequence[Item], *, gpus: int, runners: int, n: int, budget: float = math.inf
) -> float:
    """Plain round-robin (tests over ``budget`` alone, the rest dealt in order over ``n`` jobs,
    each run longest first), queued longest first: a baseline for tests and benchmarks."""
    alone = [Job(simulate_job([i], gpus), True) for i in items if i.seconds > budget]
    jobs = alone + _round_robin([i for i in items if i.seconds <= budget], gpus, n)
    return queue_makespan(sorted((j.seconds for j in jobs), reverse=True), runners)
