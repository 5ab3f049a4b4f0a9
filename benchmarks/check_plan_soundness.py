"""Never under-plan: for random single-file changes, every test whose run can observe the change
is selected.  (A correctness check, not a benchmark; ``tests/ci/plan/test_soundness.py`` runs a
smaller sample of it in the CPU lane.)

The planner's selection (the index of :mod:`mizzen_ci.plan.index` and the impact analysis of
:mod:`mizzen_ci.plan.impact`, exactly as ``mizzen-ci plan`` runs them) is compared with an
*observer set* O(t) of every registered test t, computed by brute force from the tree and
independent of the planner's index (no reverse search, no byte-level rule, no lazy parsing; path
literals read here from the syntax trees, entry points from the ``pyproject.toml`` files):

- S(t): the test, the ``conftest.py`` files of its directory and above, and the helpers
  (``.py`` files under ``tests/`` that are not tests) of its directory and below; closed under
  the import graph's forward closure over *all* imports (``ImportGraph.closure(..., "all")``:
  lazy ones, parent packages, dynamic imports with literal names, sibling imports), under path
  literals (a node of S naming a Python file, a helper loaded by path or a script it runs, adds
  that file) and under computed dynamic imports (a node of S importing by a computed name adds
  every module of its own top-level package, or, for a file under ``tests/``, of the packages
  it names, or of every package when it names none);
- O(t): the files of S(t); every file a node of S(t) names by a string literal V (``V == P`` or
  P ends with ``/V``, V holding ``/`` or an extension; a bare ``__init__.py``, ``__main__.py`` or
  ``conftest.py`` only the one beside the node); every file under ``tests/`` in t's
  directory or below that is not a test, conftest or helper (its data, fixture trees included); the package data (what the rules table calls so) and the
  ``__main__`` and entry-point modules of every workspace package with a module in S(t); every
  path matching a glob t ``watches``.

A change of path P must select every t with P in O(t) (or everything).  ``missed`` counts the
tests it does not; ``extra`` the tests it selects beyond them (rules that over-approximate:
the folder rules, basename literals, fail-open imports).  With ``--old`` (the ``ci/src`` of
another version, e.g. ``git archive`` of main) the same changes are also planned by that version
and its selection is reported beside (its misses, and how many more tests this version selects).

Run: ``uv run python benchmarks/check_plan_soundness.py [--changes 600] [--repo-changes 300]
[--modules 600] [--tests 1200] [--seed 0] [--old /tmp/main/ci/src]``.  Exit 0 when nothing is
missed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import synthetic_monorepo

from mizzen_ci.fleet import load_fleet
from mizzen_ci.imports import ImportGraph, workspace_members, workspace_source_dirs
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.impact import Analyser
from mizzen_ci.plan.index import build_index
from mizzen_ci.plan.path_rules import PACKAGE_DATA, glob_matches, rule_for
from mizzen_ci.registry import discover, read_registry, registry_excludes

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

_SKIP = {".git", "__pycache__", ".venv", "node_modules", ".ci-artifacts"}
_CONVENTIONS = {"__init__.py", "__main__.py", "conftest.py"}  # named bare: only the one beside


def tree_files(root: Path) -> list[str]:
    """Every file of ``root`` (root-relative POSIX), hidden and cache directories left out."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP and not x.startswith("."))
        rel = os.path.relpath(d, root)
        for f in sorted(files):
            out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
    return out


def _has_extension(segment: str) -> bool:
    return "." in segment[1:-1]


def string_literals(source: bytes) -> list[str]:
    """The string literals of a source as the brief defines them: every ``str`` constant in an
    expression (docstrings and bare strings are statements, not uses) and, of an f-string, its
    text after the last replacement field when that starts with ``/``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    out = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.append(n.value)
        elif isinstance(n, ast.JoinedStr) and n.values:
            last = n.values[-1]
            if isinstance(last, ast.Constant) and last.value.startswith("/"):
                out.append(last.value[1:])
    return [v for v in out if v and ("/" in v or _has_extension(v.rpartition("/")[2]))]


@dataclass
class Oracle:
    """The observer sets of a tree (see the module docstring)."""

    root: Path
    files: list[str]
    graph: ImportGraph
    tests: list[str]
    observed: dict[str, set[str]] = field(default_factory=dict)  # test -> paths it observes
    module_files: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, root: Path) -> Oracle:
        root = root.resolve()
        excludes = registry_excludes(root)
        tree = discover(root, excludes).tree
        graph = ImportGraph.build(root, workspace_source_dirs(root), tree.all)
        files = tree_files(root)
        fleet = load_fleet(root / "ci" / "fleet.toml")
        registrations = {r.path: r for r in read_registry(root, fleet).registrations}
        oracle = cls(root, files, graph, sorted(registrations), {}, set(graph.modules.values()))
        oracle._compute(tree, registrations)
        return oracle

    def _compute(self, tree, registrations) -> None:
        graph, root = self.graph, self.root
        by_suffix: dict[str, list[str]] = {}  # every whole-segment suffix of every file
        for f in self.files:
            parts = f.split("/")
            for i in range(len(parts)):
                by_suffix.setdefault("/".join(parts[i:]), []).append(f)
        node_of_file = {f: n for n, f in graph.files.items()}
        named: dict[str, set[str]] = {}
        for node, rel in graph.files.items():
            try:
                source = (root / rel).read_bytes()
            except OSError:
                continue
            found = set()
            here = rel.rpartition("/")[0]
            for v in string_literals(source):
                for f in by_suffix.get(v, ()):
                    if v not in _CONVENTIONS or f.rpartition("/")[0] == here:
                        found.add(f)
            named[node] = found
        modules = graph.modules
        member_of: dict[str, str] = {}  # module -> packages/<name>
        for m, f in modules.items():
            parts = f.split("/")
            if parts[0] == "packages" and len(parts) > 2:
                member_of[m] = "/".join(parts[:2])
        runs_alone: dict[str, set[str]] = {}  # member -> its __main__ and entry-point files
        for m in modules:
            if m.endswith(".__main__") and m in member_of:
                runs_alone.setdefault(member_of[m], set()).add(modules[m])
        for member in workspace_members(root):
            project = tomllib.loads((member / "pyproject.toml").read_text()).get("project", {})
            tables = [project.get("scripts"), project.get("gui-scripts")]
            tables += list((project.get("entry-points") or {}).values())
            for table in tables:
                for value in (table or {}).values():
                    module = value.partition(":")[0].strip()
                    if module in modules and module in member_of:
                        runs_alone.setdefault(member_of[module], set()).add(modules[module])
        package_data: dict[str, set[str]] = {}
        for f in self.files:
            parts = f.split("/")
            if len(parts) > 2 and parts[0] == "packages" and rule_for(f).effect == PACKAGE_DATA:
                package_data.setdefault("/".join(parts[:2]), set()).add(f)
        tops = {m.partition(".")[0] for m in modules}
        by_top: dict[str, list[str]] = {}
        for m in modules:
            by_top.setdefault(m.partition(".")[0], []).append(m)
        helpers = tree.helpers
        conftests = set(tree.conftests)
        data_by_dir: dict[str, list[str]] = {}
        graph_nodes = set(tree.all)
        for f in self.files:  # data: any other file (fixture trees of excluded files too)
            if f.startswith("tests/") and f not in graph_nodes:
                data_by_dir.setdefault(f.rpartition("/")[0], []).append(f)

        def dynamic_scope(node: str) -> list[str]:
            if "/" not in node:
                return by_top.get(node.partition(".")[0], [])
            named_tops = set()
            for e in graph.edges(node):
                top = e.target.partition(".")[0]
                if top in tops:
                    named_tops.add(top)
            return [m for t in (named_tops or tops) for m in by_top[t]]

        for t in self.tests:
            directory = t.rpartition("/")[0]
            start = {t} | {h for h in helpers if _under(h.rpartition("/")[0], directory)}
            parts = directory.split("/")
            for i in range(1, len(parts) + 1):
                c = "/".join(parts[:i]) + "/conftest.py"
                if c in conftests:
                    start.add(c)
            seen: set[str] = set()
            files: set[str] = set()
            frontier = set(start)
            while frontier:
                seen |= frontier
                reached = {n for n in graph.closure(frontier, "all") if n in graph.files}
                more = set()
                for n in frontier | reached:
                    for f in named.get(n, ()):
                        files.add(f)
                        if f in node_of_file:
                            more.add(node_of_file[f])
                    if graph.facts[n].dynamic:
                        more.update(dynamic_scope(n))
                frontier = (reached | more) - seen
            seen |= frontier
            files |= {graph.files[n] for n in seen}
            for d, fs in data_by_dir.items():
                if _under(d, directory):
                    files.update(fs)
            for member in {member_of[n] for n in seen if n in member_of}:
                files |= package_data.get(member, set()) | runs_alone.get(member, set())
            for glob in registrations[t].watches:
                files.update(f for f in self.files if glob_matches(glob, f))
            self.observed[t] = files

    def observers(self, path: str) -> set[str]:
        return {t for t, files in self.observed.items() if path in files}


def _under(d: str, ancestor: str) -> bool:
    return d == ancestor or d.startswith(ancestor + "/")


def kind_of(oracle: Oracle, path: str) -> str:
    """The kind of file ``path`` is, for sampling and for the report."""
    if path in oracle.module_files:
        name = path.rpartition("/")[2]
        return "module (__main__)" if name == "__main__.py" else "module"
    if path.startswith("tests/") and path.endswith(".py"):
        return "test" if path.rpartition("/")[2].startswith("test_") else "helper"
    if path.startswith("tests/"):
        return "test data"
    if rule_for(path).effect == PACKAGE_DATA:
        return "package data"
    return "other"


def sample_changes(oracle: Oracle, n: int, rng: random.Random) -> list[str]:
    """``n`` paths, drawn evenly from kinds of file (modules, test files, helpers and conftests,
    data under tests/, package data, everything else) and uniformly within each."""
    kinds: dict[str, list[str]] = {}
    for f in oracle.files:
        kinds.setdefault(kind_of(oracle, f).partition(" (")[0], []).append(f)
    names = sorted(kinds)
    return [rng.choice(kinds[rng.choice(names)]) for _ in range(n)]


def plan_selections(root: Path, paths: Iterable[str]) -> dict[str, list[str] | None]:
    """``{path: selected test files, or None for everything}`` of this version's planner for a
    change of each path alone (one index, as ``mizzen-ci plan`` builds it without a cache)."""
    fleet = load_fleet(root / "ci" / "fleet.toml")
    index = build_index(root, fleet, None, save=False)
    analyser = Analyser.of_index(index)
    out: dict[str, list[str] | None] = {}
    for path in paths:
        impact = analyser.analyse(Change.from_entries("a" * 40, "b" * 40, [Entry("M", path)]))
        out[path] = None if impact.everything else sorted(impact.tests)
    return out


# The same, for another version of the planner: run in its own interpreter (`-S`, its ci/src).
_DRIVER = """
import json, sys
from pathlib import Path
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.impact import Analyser
from mizzen_ci.plan.index import build_index
job = json.load(sys.stdin)
root = Path(job["root"])
index = build_index(root, load_fleet(root / "ci" / "fleet.toml"), None, save=False)
if hasattr(Analyser, "of_index"):
    analyser = Analyser.of_index(index)
else:
    analyser = Analyser(index.tree, index.modules, index.source_dirs, index.reach, index.excludes)
out = {}
for path in job["paths"]:
    impact = analyser.analyse(Change.from_entries("a" * 40, "b" * 40, [Entry("M", path)]))
    out[path] = None if impact.everything else sorted(impact.tests)
json.dump(out, sys.stdout)
"""


def old_selections(ci_src: Path, root: Path, paths: list[str]) -> dict[str, list[str] | None]:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ci_src)}
    done = subprocess.run(
        [sys.executable, "-S", "-c", _DRIVER],
        input=json.dumps({"root": str(root), "paths": sorted(set(paths))}),
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the planner of {ci_src} failed:\n{done.stderr}")
    return json.loads(done.stdout)


@dataclass
class Result:
    """What a run of changes found."""

    label: str
    changes: int = 0
    everything: int = 0
    missed: list[tuple[str, str]] = field(default_factory=list)  # (changed path, test)
    extra: list[int] = field(default_factory=list)  # per change: selected beyond O
    selected: list[int] = field(default_factory=list)
    old_selected: list[int] = field(default_factory=list)
    old_missed: int = 0
    by_kind: dict[str, list[tuple[int, int | None]]] = field(default_factory=dict)

    def report(self) -> str:
        lines = [
            f"{self.label}: {self.changes} change(s), {self.everything} select everything; "
            f"missed {len(self.missed)}",
        ]
        if self.selected:
            lines.append(
                f"  selected per change: mean {statistics.mean(self.selected):.1f} tests, "
                f"of which beyond the observers {statistics.mean(self.extra):.1f}"
            )
        if self.old_selected:
            lines.append(
                f"  the old planner: mean {statistics.mean(self.old_selected):.1f} tests, "
                f"missing {self.old_missed} observer(s) in all; this one selects "
                f"{statistics.mean(self.selected) - statistics.mean(self.old_selected):+.1f} "
                "tests per change"
            )
        if self.old_selected:
            lines.append("  per kind of changed file: changes, mean selected (old planner)")
            for kind, pairs in sorted(self.by_kind.items()):
                new = statistics.mean(p[0] for p in pairs)
                old = statistics.mean(p[1] for p in pairs)
                lines.append(f"    {kind:20} {len(pairs):4}  {new:7.1f} ({old:.1f})")
        for path, test in self.missed[:20]:
            lines.append(f"  MISSED {test} observes {path}")
        return "\n".join(lines)


def check(label: str, root: Path, n: int, rng: random.Random, old: Path | None = None) -> Result:
    oracle = Oracle.of(root)
    paths = sample_changes(oracle, n, rng)
    new = plan_selections(root, set(paths))
    before = old_selections(old, root, paths) if old is not None else None
    result = Result(label)
    for path in paths:
        result.changes += 1
        truth = oracle.observers(path)
        got = new[path]
        if got is None:
            result.everything += 1
            continue
        chosen = set(got)
        result.missed += [(path, t) for t in sorted(truth - chosen)]
        result.extra.append(len(chosen - truth))
        result.selected.append(len(chosen))
        if before is not None:
            was = before[path]
            was = set(oracle.tests) if was is None else set(was)
            result.old_selected.append(len(was))
            result.old_missed += len(truth - was)
            pair = (len(chosen), len(was))
            result.by_kind.setdefault(kind_of(oracle, path), []).append(pair)
    return result


def copy_of_repository(dest: Path) -> Path:
    """A copy of this repository's tracked (and untracked, not ignored) files."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / rel)
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--changes", type=int, default=600, help="on the synthetic monorepo")
    p.add_argument("--repo-changes", type=int, default=300, help="on a copy of this repository")
    p.add_argument("--modules", type=int, default=600)
    p.add_argument("--tests", type=int, default=1200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--old", type=Path, help="ci/src of a planner to compare with")
    a = p.parse_args()
    rng = random.Random(a.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="mizzen-soundness-") as tmp:
        t0 = time.perf_counter()
        syn = Path(tmp) / "synthetic"
        synthetic_monorepo.generate(syn, modules=a.modules, tests=a.tests, seed=a.seed, hidden=True)
        results.append(check("synthetic monorepo", syn, a.changes, rng, a.old))
        print(results[-1].report(), flush=True)
        repo = copy_of_repository(Path(tmp) / "repo")
        results.append(check("this repository", repo, a.repo_changes, rng, a.old))
        print(results[-1].report())
        total = sum(r.changes for r in results)
        missed = sum(len(r.missed) for r in results)
        print(f"{total} change(s) in {time.perf_counter() - t0:.0f} s: {missed} missed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
