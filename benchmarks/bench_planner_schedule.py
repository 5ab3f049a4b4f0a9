"""Schedule quality of the planner's packing against a fixed-shard-count baseline, same run.

A realistic registration set (a few hundred GPU test files: est_time log-normal from 30 s to
2.5 h, 1/2/4/8 GPUs, hopper-only, blackwell-only and both, some needing rdma) is written as real
test files into a temporary tree with the repository's ``ci/fleet.toml``, and planned by the real
planner (nightly: every test on its auto arch; weekly: on every declared arch).  For each pool:

- planner: the plan's makespan (jobs queued on the pool's runners) over the lower bound
  ``max(total GPU-seconds / GPUs of the pool, longest test)``;
- baseline: what comparable CI systems do: a fixed number of shards per pool (``--shards``),
  tests dealt longest-first to the least-loaded shard, one test at a time per runner.

Run: ``python benchmarks/bench_planner_schedule.py [--tests 300] [--seeds 5] [--shards 4]``
Target: planner makespan / lower bound <= 1.05.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "ci" / "src"))

from mizzen_ci.fleet import load_fleet  # noqa: E402
from mizzen_ci.plan.change import Change  # noqa: E402
from mizzen_ci.plan.pipeline import PlanOptions, build_plan  # noqa: E402
from mizzen_ci.plan.request import Inputs  # noqa: E402

ARCHES = ((("hopper",), 0.45), (("blackwell",), 0.15), (("hopper", "blackwell"), 0.40))
GPUS = ((1, 0.50), (2, 0.25), (4, 0.15), (8, 0.10))
LABELS = ("train", "lora", "megatron", "attention", "rollout", "distributed")


def pick(rng: random.Random, table):
    values, weights = zip(*table, strict=True)
    return rng.choices(values, weights)[0]


def write_tree(root: Path, n: int, seed: int) -> None:
    """``n`` GPU test files with realistic registrations, plus the repository's fleet table."""
    rng = random.Random(seed)
    (root / "ci").mkdir(parents=True)
    shutil.copy(REPO / "ci" / "fleet.toml", root / "ci" / "fleet.toml")
    (root / "pyproject.toml").write_text('[project]\nname = "bench"\nversion = "0"\n')
    for k in range(n):
        est = int(min(9000, max(30, rng.lognormvariate(math.log(300), 1.1))))
        gpus = pick(rng, GPUS)
        hardware = list(pick(rng, ARCHES))
        needs = ["rdma"] if gpus == 8 and "hopper" in hardware and rng.random() < 0.2 else []
        if needs:
            hardware = ["hopper"]  # only the H100 pool has rdma
        d = root / "tests" / f"area{k % 12}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"test_gpu_{k:04d}.py").write_text(
            "from mizzen_ci import register_cuda_ci\n"
            f"register_cuda_ci(est_time={est}, hardware={hardware!r}, num_gpus={gpus}, "
            f"labels=[{rng.choice(LABELS)!r}], needs={needs!r})\n"
        )


def fixed_shards(tests: list[tuple[float, int]], shards: int, runners: int) -> float:
    """Makespan of the baseline: longest first onto the least-loaded of ``shards`` shards, each
    shard running its tests one at a time; shards queued longest first on ``runners``."""
    loads = [0.0] * shards
    for seconds, _ in sorted(tests, reverse=True):
        heapq.heapreplace(loads, loads[0] + seconds)
    ends = [0.0] * min(runners, shards)
    for s in sorted(loads, reverse=True):
        heapq.heapreplace(ends, ends[0] + s)
    return max(ends)


def whole_runner_optimum(tests: list[tuple[float, int]], gpus: int, runners: int) -> float | None:
    """The exact optimum when every test needs a whole runner and there are few of them (each
    runner then runs its tests one after another): brute force over assignments."""
    if len(tests) > 12 or any(g != gpus for _, g in tests):
        return None
    best = math.inf
    for code in range(runners ** len(tests)):
        loads = [0.0] * runners
        for seconds, _ in tests:
            code, r = divmod(code, runners)
            loads[r] += seconds
        best = min(best, max(loads))
    return best


def run(n: int, seeds: int, shards: int, budget_minutes: float) -> int:
    fleet = load_fleet(REPO / "ci" / "fleet.toml")
    rows, worst, runs, notes = [], 0.0, [], []
    started = time.perf_counter()
    for seed in range(seeds):
        with tempfile.TemporaryDirectory(prefix="mizzen-sched-") as tmp:
            root = Path(tmp)
            write_tree(root, n, seed)
            for cadence in ("nightly", "weekly"):
                plan = build_plan(
                    root,
                    fleet,
                    Change.from_entries(None, None, []),
                    Inputs(event="schedule", cadence=cadence),
                    PlanOptions(budget_seconds=budget_minutes * 60),
                ).to_json()
                assert not plan["errors"], plan["errors"][:3]
                runs.append(
                    max(p["makespan_seconds"] for p in plan["pools"])
                    / max(p["lower_bound_seconds"] for p in plan["pools"])
                )
                for pool in plan["pools"]:
                    tests = [
                        (t["est_seconds"], t["num_gpus"])
                        for j in plan["jobs"]
                        if j["pool"] == pool["pool"]
                        for t in j["tests"]
                    ]
                    ratio = pool["makespan_seconds"] / pool["lower_bound_seconds"]
                    base = fixed_shards(tests, shards, pool["runners"])
                    optimum = whole_runner_optimum(tests, pool["gpus_per_runner"], pool["runners"])
                    if optimum is not None and ratio > 1.05:
                        notes.append(
                            f"seed {seed} {cadence} {pool['pool']}: {len(tests)} whole-runner "
                            f"tests on {pool['runners']} runners; the exact optimum is "
                            f"{optimum / pool['lower_bound_seconds']:.3f} x the bound, the plan "
                            f"{pool['makespan_seconds'] / optimum:.3f} x the optimum"
                        )
                    worst = max(worst, ratio)
                    rows.append(
                        (
                            seed,
                            cadence,
                            pool["pool"],
                            pool["tests"],
                            pool["jobs"],
                            pool["lower_bound_seconds"] / 3600,
                            pool["makespan_seconds"] / 3600,
                            ratio,
                            base / 3600,
                            base / pool["lower_bound_seconds"],
                            pool["strategy"],
                        )
                    )
    head = (
        f"{'seed':>4} {'cadence':8} {'pool':15} {'tests':>5} {'jobs':>4} {'bound h':>8} "
        f"{'plan h':>7} {'plan/LB':>8} {'shards h':>9} {'shards/LB':>9}  strategy"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r[0]:>4} {r[1]:8} {r[2]:15} {r[3]:>5} {r[4]:>4} {r[5]:>8.2f} {r[6]:>7.2f} "
            f"{r[7]:>8.3f} {r[8]:>9.2f} {r[9]:>9.2f}  {r[10]}"
        )
    mean = sum(r[7] for r in rows) / len(rows)
    base_mean = sum(r[9] for r in rows) / len(rows)
    print(
        f"\n{n} GPU test files x {seeds} seeds x nightly/weekly, budget {budget_minutes:g} min, "
        f"baseline {shards} fixed shards per pool, one test at a time"
    )
    print(f"per pool, planner makespan / lower bound: mean {mean:.3f}, worst {worst:.3f}")
    print(
        f"per run (last pool done / the largest pool bound): mean {sum(runs) / len(runs):.3f}, "
        f"worst {max(runs):.3f} (target <= 1.05)"
    )
    for note in notes:
        print(f"  note: {note}")
    print(f"baseline makespan / lower bound: mean {base_mean:.2f}")
    print(f"planner vs baseline makespan: {base_mean / mean:.2f}x shorter on average")
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0 if max(runs) <= 1.05 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", type=int, default=300)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--budget-minutes", type=float, default=60)
    a = p.parse_args()
    return run(a.tests, a.seeds, a.shards, a.budget_minutes)


if __name__ == "__main__":
    sys.exit(main())
