"""Do two versions of the planner make the same plans?  (A refactor's proof, not a benchmark.)

Runs ``python3 -S -m mizzen_ci plan`` of two ``ci/src`` trees (``--old``, ``--new``) over the same
scenarios and compares what they print: the plan JSON (``--json``) and the verbose terminal table
(``--verbose``).  Scenarios:

- this repository (a scratch clone of it, its ``main`` set to its HEAD): for each of
  ``--repo-changes`` sampled files (every tracked file when the sample is larger), a working-tree
  change that appends a line to it;
  plus a few event variants (push, nightly and weekly schedules, labels, an untrusted fork,
  comment commands) on one change;
- the synthetic monorepo of :mod:`synthetic_monorepo` (``--modules``/``--tests``): leaf modules,
  random modules, test files, conftests, package data and docs, one change each.

Each scenario is planned without a cache, then twice through one cache directory (cold, warm), by
each version; every output must equal the old version's uncached one.  ``--ignore-field NAME``
drops a job field from both sides (a field the new version removed on purpose).  Whatever the
versions do, each version's cached plans must equal its own uncached one (a cache makes a plan
faster, never different): those are counted apart, as "cache changed the plan".  ``--explain``
prints, for each scenario whose plan the new version changes, the (test, arch) pairs it schedules
more or less and the reasons it words differently (for a version that changes plans on purpose).

Run from a checkout: ``python3 benchmarks/check_plan_equivalence.py --old /tmp/old/ci/src``
(``--new`` defaults to this checkout's ``ci/src``; ``git archive`` a revision to get an old one).
Exit 0 when every scenario matches, 1 otherwise (the first differences are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import synthetic_monorepo

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

EVENT_VARIANTS: tuple[tuple[str, ...], ...] = (
    ("--event", "push", "--base", "HEAD", "--head", "HEAD"),
    ("--event", "schedule", "--cadence", "nightly"),
    ("--event", "schedule", "--cadence", "weekly"),
    ("--label", "run-ci-lora,run-on-blackwell"),
    ("--label", "run-ci-all"),
    ("--fork", "--author-association", "NONE", "--label", "run-ci-all"),
    ("--comment", "MEMBER", "/run-ci train\n/run-on blackwell", "--comment", "NONE", "/run-ci all"),
)


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True
    ).stdout


def plan(ci_src: Path, root: Path, args: tuple[str, ...], cache: Path | None) -> tuple[str, str]:
    """(plan JSON, verbose table) of one planner version."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "GITHUB_"))}
    env["PYTHONPATH"] = str(ci_src)
    cache_args = ("--cache-dir", str(cache)) if cache else ("--no-cache",)
    out = []
    for mode in ("--json", "--verbose"):
        done = subprocess.run(
            [sys.executable, "-S", "-m", "mizzen_ci", "plan", "--root", str(root), mode,
             "--history", str(root / ".no-history"), *cache_args, *args],
            capture_output=True, text=True, env=env, cwd=root,
        )  # fmt: skip
        out.append(f"exit {done.returncode}\n{done.stdout}{done.stderr}")
    return out[0], out[1]


def normalise(text: str, ignore: tuple[str, ...]) -> str:
    head, _, body = text.partition("\n")
    if not ignore:
        return text
    try:
        data = json.loads(body)
    except ValueError:
        return text
    for job in data.get("jobs", []):
        for name in ignore:
            job.pop(name, None)
    return head + "\n" + json.dumps(data, indent=2)


def scenario_outputs(ci_src: Path, root: Path, args: tuple[str, ...], tmp: Path) -> list[tuple]:
    cache = Path(tempfile.mkdtemp(dir=tmp))
    runs = [plan(ci_src, root, args, None), plan(ci_src, root, args, cache)]
    runs.append(plan(ci_src, root, args, cache))
    shutil.rmtree(cache)
    return runs


EXPLAIN = False  # set by --explain
CACHE_CHANGED: list[str] = []  # scenarios where a version's cached plan differs from its own


def _scheduled(text: str) -> dict[tuple[str, str | None], str] | None:
    try:
        data = json.loads(text.partition("\n")[2])
    except ValueError:
        return None
    return {(t["file"], j["arch"]): t["why"] for j in data.get("jobs", []) for t in j["tests"]}


def explain(label: str, old_json: str, new_json: str) -> None:
    old, new = _scheduled(old_json), _scheduled(new_json)
    if old is None or new is None:
        print(f"EXPLAIN {label}: not both plans are JSON", flush=True)
        return
    more, less = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    reworded = sorted(k for k in new.keys() & old.keys() if new[k] != old[k])
    print(f"EXPLAIN {label}: +{len(more)} -{len(less)} reworded {len(reworded)}", flush=True)
    for k in more[:6]:
        print(f"    + {k[0]}{' @' + k[1] if k[1] else ''}: {new[k]}")
    for k in less[:6]:
        print(f"    - {k[0]}{' @' + k[1] if k[1] else ''}: was {old[k]}")
    for k in reworded[:3]:
        print(f"    ~ {k[0]}: {old[k]}  ->  {new[k]}")


def compare(label: str, old: Path, new: Path, root: Path, args, tmp: Path, ignore) -> list[str]:
    reference = [normalise(t, ignore) for t in plan(old, root, args, None)]
    problems = []
    for version, src in (("old", old), ("new", new)):
        runs = scenario_outputs(src, root, args, tmp)
        own = [normalise(t, ignore) for t in runs[0]]
        for k, run in enumerate(runs):
            kind = ("no cache", "cold cache", "warm cache")[k]
            for what, got, want, mine in zip(("json", "table"), run, reference, own, strict=True):
                if normalise(got, ignore) != want:
                    problems.append(f"{label}: {version} {what} differs ({kind})")
                if normalise(got, ignore) != mine:
                    CACHE_CHANGED.append(
                        f"{label}: {version} {what} ({kind}) differs from its own uncached plan"
                    )
        if EXPLAIN and version == "new" and own[0] != reference[0]:
            explain(label, reference[0], own[0])
    return problems


def change_file(root: Path, rel: str) -> None:
    path = root / rel
    with path.open("ab") as f:
        f.write(b"\n# changed by check_plan_equivalence\n")


def reset(root: Path) -> None:
    git(root, "checkout", "-q", "--", ".")
    git(root, "clean", "-qfdx", "-e", ".no-history")


def run_scenarios(label: str, root: Path, files: list[str], args_list, old, new, tmp, ignore):
    problems, n = [], 0
    for rel in files:
        change_file(root, rel)
        problems += compare(f"{label} {rel}", old, new, root, (), tmp, ignore)
        n += 1
        reset(root)
    if files:
        change_file(root, files[0])
        for args in args_list:
            problems += compare(f"{label} {files[0]} {' '.join(args)}", old, new, root, args, tmp, ignore)  # fmt: skip
            n += 1
        reset(root)
    return n, problems


def init_repo(root: Path) -> None:
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="ci/src of the reference version")
    p.add_argument("--new", type=Path, default=REPO / "ci" / "src")
    p.add_argument("--repo-changes", type=int, default=60)
    p.add_argument("--modules", type=int, default=600)
    p.add_argument("--tests", type=int, default=1200)
    p.add_argument("--synthetic-changes", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-field", action="append", default=[], help="a job field to drop")
    p.add_argument("--explain", action="store_true", help="what the new version plans otherwise")
    a = p.parse_args()
    global EXPLAIN
    EXPLAIN = a.explain
    rng = random.Random(a.seed)
    old, new, ignore = a.old.resolve(), a.new.resolve(), tuple(a.ignore_field)
    problems: list[str] = []
    total = 0
    with tempfile.TemporaryDirectory(prefix="mizzen-plan-eq-") as tmp_name:
        tmp = Path(tmp_name)
        clone = tmp / "repo"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        # Each scenario's change is its one file: the clone's main is its HEAD (a branch's own
        # commits would otherwise be part of every change, and a change to ci/ selects all).
        git(clone, "update-ref", "refs/heads/main", "HEAD")
        tracked = sorted(git(clone, "ls-files").split("\n")[:-1])
        files = tracked if a.repo_changes >= len(tracked) else rng.sample(tracked, a.repo_changes)
        n, found = run_scenarios("repo", clone, sorted(files), EVENT_VARIANTS, old, new, tmp, ignore)  # fmt: skip
        total, problems = total + n, problems + found
        print(f"this repository: {n} scenario(s), {len(found)} difference(s)", flush=True)

        syn = tmp / "synthetic"
        repo = synthetic_monorepo.generate(syn, modules=a.modules, tests=a.tests, seed=a.seed)
        (syn / "README.md").write_text("docs\n")
        (syn / "packages" / repo.packages[0] / "data.json").write_text("{}\n")
        init_repo(syn)
        leaves = synthetic_monorepo.leaf_modules(repo)
        k = a.synthetic_changes
        picks = [repo.modules[m] for m in rng.sample(leaves, min(k // 3, len(leaves)))]
        picks += [repo.modules[m] for m in rng.sample(sorted(repo.modules), k // 3)]
        picks += rng.sample(sorted(repo.tests), k // 6)
        picks += ["README.md", f"packages/{repo.packages[0]}/data.json"]
        picks += sorted(git(syn, "ls-files", "*conftest.py").split())[:2]
        n, found = run_scenarios("synthetic", syn, picks, EVENT_VARIANTS[1:4], old, new, tmp, ignore)  # fmt: skip
        total, problems = total + n, problems + found
        print(f"synthetic monorepo: {n} scenario(s), {len(found)} difference(s)", flush=True)
    for line in problems[:40]:
        print("DIFF", line)
    print(f"{total} scenario(s) × (no cache, cold, warm) × (json, table): "
          f"{'identical' if not problems else f'{len(problems)} difference(s)'}")  # fmt: skip
    for line in CACHE_CHANGED[:40]:
        print("CACHE", line)
    print(f"cache changed the plan: {len(CACHE_CHANGED)} time(s) (must be 0)")
    return 1 if problems or CACHE_CHANGED else 0


if __name__ == "__main__":
    sys.exit(main())
