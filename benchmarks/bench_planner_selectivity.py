"""Selectivity: how much GPU time a one-leaf-module change skips, with no test missed.

On the synthetic monorepo (:mod:`synthetic_monorepo`), for a sample of leaf modules (modules no
other module imports), the planner plans a pull request that changes only that module.  Against:

- run-all: every enabled GPU test on its auto arch (what ``run-ci-all`` or a changed source file
  does in comparable CI systems): the GPU-seconds skipped are the figure of merit;
- brute force: for every test file, its forward closure over *all* imports (lazy ones too) by the
  import graph's own ``closure``, from the test file and the ``conftest.py`` files above it; a
  test whose closure holds the changed module and that the plan did not schedule is *missed*.

Run: ``uv run python benchmarks/bench_planner_selectivity.py [--samples 20] [--modules 5000]
[--tests 10000]``.  Target: >= 80 % of GPU-seconds skipped, 0 missed.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import synthetic_monorepo

from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.impact import build_graph
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs
from mizzen_ci.registry import discover


def gpu_seconds(plan: dict) -> float:
    return sum(
        t["est_seconds"] * t["num_gpus"] for j in plan["jobs"] if j["arch"] for t in j["tests"]
    )


def conftests_above(test: str, conftests: set[str]) -> list[str]:
    parts = test.split("/")[:-1]
    return [
        c
        for i in range(1, len(parts) + 1)
        if (c := "/".join(parts[:i]) + "/conftest.py") in conftests
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--modules", type=int, default=5000)
    p.add_argument("--tests", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="mizzen-select-"))
    try:
        root = tmp / "repo"
        t0 = time.perf_counter()
        repo = synthetic_monorepo.generate(root, modules=a.modules, tests=a.tests, seed=a.seed)
        fleet = load_fleet(root / "ci" / "fleet.toml")
        cache = tmp / "cache"
        options = PlanOptions(cache_dir=cache)
        run_all = build_plan(
            root,
            fleet,
            Change.from_entries(None, None, []),
            Inputs(labels=("run-ci-all",)),
            options,
        ).to_json()
        all_gpu = gpu_seconds(run_all)

        tree = discover(root).tree
        graph, _ = build_graph(root, tree)
        conftests = set(tree.conftests)
        closures = {
            t: graph.closure([t, *conftests_above(t, conftests)], "all") for t in tree.tests
        }
        print(
            f"synthetic repo: {len(repo.modules)} modules, {len(repo.tests)} test files "
            f"({len(repo.gpu_tests)} GPU); run-all = {all_gpu / 3600:.1f} GPU-h "
            f"({time.perf_counter() - t0:.0f} s set-up)\n"
        )

        leaves = synthetic_monorepo.leaf_modules(repo)
        rng = random.Random(a.seed)
        groups = {
            "leaf": rng.sample(leaves, min(a.samples, len(leaves))),
            # for the record: any module, packages' __init__ included (no target)
            "any": rng.sample(sorted(repo.modules), min(a.samples, len(repo.modules))),
        }
        results: dict[str, list[float]] = {}
        missed_total = 0
        for group, modules in groups.items():
            print(
                f"{group + ' module changed':28} {'GPU tests':>9} {'GPU-h':>7} {'skipped':>8} "
                f"{'missed':>7} {'extra':>6}"
            )
            for module in modules:
                path = repo.modules[module]
                change = Change.from_entries("base", "head", [Entry("M", path)])
                plan = build_plan(root, fleet, change, Inputs(), options).to_json()
                runs = {(t["file"], j["arch"]) for j in plan["jobs"] for t in j["tests"]}
                files = {f for f, _ in runs}
                truth = {t for t, c in closures.items() if module in c}
                missed, extra = truth - files, files - truth
                frac = 1 - gpu_seconds(plan) / all_gpu
                results.setdefault(group, []).append(frac)
                missed_total += len(missed)
                n_gpu = sum(1 for _, arch in runs if arch)
                print(
                    f"{module:28} {n_gpu:>9} {gpu_seconds(plan) / 3600:>7.2f} {frac:>8.1%} "
                    f"{len(missed):>7} {len(extra):>6}"
                )
            print()
        leaf = results["leaf"]
        print(
            f"one-leaf-module change, GPU-seconds skipped against run-all: mean "
            f"{statistics.mean(leaf):.1%}, worst {min(leaf):.1%} (target >= 80 %)"
        )
        print(
            f"any-module change (for the record): mean {statistics.mean(results['any']):.1%}, "
            f"worst {min(results['any']):.1%}"
        )
        print(f"missed tests against the brute-force closure: {missed_total} (target 0)")
        print("(extra: scheduled although the closure does not hold the module; 0 expected)")
        skipped = leaf
        return 0 if missed_total == 0 and min(skipped) >= 0.8 else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
