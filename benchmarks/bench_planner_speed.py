"""Planner speed on a synthetic monorepo, against a plain ``ast.parse`` of every file, same run.

The generator (:mod:`synthetic_monorepo`) writes 5,000 source modules and 10,000 test files (a
git repository with a one-leaf-module change on top of main).  Timed, in this order:

- baseline: read and ``ast.parse`` every ``.py`` file of the tree (one process);
- cold: the full plan of the change (registry, import graph, impact, selection, packing) with an
  empty cache directory;
- warm: the same plan again with the cache of the cold runs (checked to parse no file);
- CLI warm: ``python3 -S -m mizzen_ci plan --json`` as a subprocess (interpreter start included).

Baseline and cold alternate ``--repeat`` times (default 3) and each figure is the median of its
runs, so that a burst of load on a shared machine moves both rather than one; warm and CLI are
medians of three.  The ratio is of the medians.

Run: ``uv run python benchmarks/bench_planner_speed.py [--modules 5000] [--tests 10000] [--repeat 3]
[--keep DIR]``
Targets: cold <= 3 s, warm <= 0.5 s (absolute, on the reference machine); the ratios to the
baseline say how the same run compares on any machine.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import synthetic_monorepo

from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan.change import git_change
from mizzen_ci.plan.impact import Analyser
from mizzen_ci.plan.index import CACHE_FILE, build_index
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@invalid", "-c", "gc.auto=0"]


def git(root: Path, *args: str) -> None:
    subprocess.run([*GIT, *args], cwd=root, check=True, capture_output=True)


def make_repo(
    root: Path, modules: int, tests: int, seed: int
) -> tuple[synthetic_monorepo.Repo, str]:
    repo = synthetic_monorepo.generate(root, modules=modules, tests=tests, seed=seed)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "synthetic monorepo")
    leaf = leaf_module(repo)
    path = root / repo.modules[leaf]
    path.write_text(path.read_text() + "\n\ndef added_by_the_change():\n    return 1\n")
    git(root, "checkout", "-q", "-b", "change")
    git(root, "commit", "-qam", f"change {leaf}")
    return repo, leaf


def leaf_module(repo: synthetic_monorepo.Repo) -> str:
    """A module no other module imports (a leaf of the import graph), deterministic."""
    leaves = synthetic_monorepo.leaf_modules(repo)
    return leaves[len(leaves) // 2]


def baseline(root: Path) -> tuple[float, int]:
    files = [
        os.path.join(d, f)
        for d, dirs, fs in os.walk(root)
        if not dirs.__setitem__(slice(None), [x for x in dirs if x != ".git"])
        for f in fs
        if f.endswith(".py")
    ]
    t = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            ast.parse(fh.read(), f)
    return time.perf_counter() - t, len(files)


def plan_once(root: Path, cache: Path) -> tuple[float, dict]:
    fleet = load_fleet(root / "ci" / "fleet.toml")
    t = time.perf_counter()
    change = git_change(root)  # the working tree against its merge-base with main
    plan = build_plan(root, fleet, change, Inputs(), PlanOptions(cache_dir=cache)).to_json()
    return time.perf_counter() - t, plan


def parsed_by_a_plan(root: Path, cache: Path) -> int:
    """How many files a plan through ``cache`` parses, its impact search included (0 for a warm
    cache), not timed."""
    index = build_index(
        root, load_fleet(root / "ci" / "fleet.toml"), cache / CACHE_FILE, save=False
    )
    Analyser(index.tree, index.modules, index.source_dirs, index.reach, index.excludes).analyse(
        git_change(root)
    )
    return index.stats["parsed"]


def cli_once(root: Path, cache: Path) -> float:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO / "ci" / "src")}
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-S", "-m", "mizzen_ci", "plan", "--root", str(root), "--cache-dir",
         str(cache), "--json"],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modules", type=int, default=5000)
    p.add_argument("--tests", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="baseline/cold pairs (medians)")
    p.add_argument("--keep", type=Path, help="generate into DIR and keep it")
    a = p.parse_args()

    tmp = None if a.keep else tempfile.mkdtemp(prefix="mizzen-speed-")
    root = (a.keep or Path(tmp)) / "repo"
    try:
        t = time.perf_counter()
        repo, leaf = make_repo(root, a.modules, a.tests, a.seed)
        print(f"generated {len(repo.modules)} modules, {len(repo.tests)} test files, "
              f"changed {leaf} ({time.perf_counter() - t:.0f} s, not timed)")  # fmt: skip
        cache = root.parent / "cache"
        bases, colds = [], []
        for _ in range(a.repeat):
            base, n_files = baseline(root)
            shutil.rmtree(cache, ignore_errors=True)
            cold, plan = plan_once(root, cache)
            bases.append(base)
            colds.append(cold)
        base, cold = statistics.median(bases), statistics.median(colds)
        warms = [plan_once(root, cache)[0] for _ in range(3)]
        warm = statistics.median(warms)
        assert parsed_by_a_plan(root, cache) == 0, "the warm plan parsed files: no cache hit"
        cli = statistics.median(cli_once(root, cache) for _ in range(3))
        n_tests = sum(len(j["tests"]) for j in plan["jobs"])

        print(f"\nplan: {len(plan['jobs'])} jobs, {n_tests} test runs, "
              f"{len(plan['not_scheduled'])} not scheduled")  # fmt: skip
        print(f"\n{'what':34} {'seconds':>8} {'x baseline':>11} {'target':>8}")
        print(f"{'ast.parse of ' + str(n_files) + ' files (baseline)':34} {base:8.2f} {1:11.2f}")
        for label, secs, target in (
            (f"full plan, cold (median of {a.repeat})", cold, 3.0),
            ("full plan, warm (median of 3)", warm, 0.5),
            ("CLI python3 -S, warm (median 3)", cli, None),
        ):
            tgt = f"{target:.1f} s" if target else "-"
            print(f"{label:34} {secs:8.2f} {secs / base:11.2f} {tgt:>8}")
        print(f"\nruns: baseline {' '.join(f'{b:.2f}' for b in bases)}; "
              f"cold {' '.join(f'{c:.3f}' for c in colds)}; "
              f"warm {' '.join(f'{w:.3f}' for w in warms)}")  # fmt: skip
        print(f"machine: {os.cpu_count()} CPU(s); load average {os.getloadavg()[0]:.1f} "
              "(the figures scale with it; compare the ratios)")  # fmt: skip
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
