"""Impact analysis: which test files a change reaches, and why.

Built on the one import graph of the repository, read as a :class:`~mizzen_ci.imports.reach.
ReachIndex` (who names what, all scopes, inverted; the planner keeps it warm in
:mod:`mizzen_ci.plan.index`); the path rules come from :mod:`mizzen_ci.plan.path_rules`; the
files under ``tests/`` from the registry's one walk (:mod:`mizzen_ci.registry.discover`).

A test file is impacted when
- it changed itself;
- its import closure reaches a changed module, following *every* import, lazy ones too (tests
  run function bodies), through parent packages' ``__init__`` and ``from pkg import sub``;
- a ``conftest.py`` of its directory or any directory above changed, or reaches a changed
  module;
- a file it reads under ``tests/`` changed: a helper or data file in its directory or below
  (helpers are loaded by path, so a helper that reaches a changed module counts too);
- a non-Python file of a package whose modules it reaches changed.

Invariants:
- A changed path's meaning is decided only by the rules table; a path no rule knows, a Python
  file outside every source directory, or an unusable diff selects everything (fail open).
- Renamed and deleted modules are looked up by name among the *targets* of imports, so a test
  still importing a module that is gone is impacted.
- Every impacted test carries one reason naming the changed path that reached it.
- The reverse search visits only what reaches a changed module (one index lookup per step); its
  answer equals the importers that :meth:`ImportGraph.importers` finds over all scopes.
- Deterministic whatever the order of the index's lists (a cold index is filled as parse workers
  finish, a lazy one as queries parse files): each step takes its importers in the tree's order
  (modules as discovered, then the files under ``tests/``), so a test reached through several
  helpers names the same helper every time.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..imports import ImportGraph, ReachIndex, reach_of_graph, relative_dirs, workspace_source_dirs
from ..registry import TESTS_DIR, TestTree, is_excluded
from .change import Change
from .path_rules import EVERYTHING, NOTHING, PACKAGE_DATA, PYTHON, RULES, TESTS, Rule, rule_for


@dataclass
class Impact:
    """The outcome of impact analysis."""

    everything: bool = False
    everything_because: list[str] = field(default_factory=list)
    tests: dict[str, str] = field(default_factory=dict)  # test file -> why it is impacted
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (path, rule's why)

    def why(self, test: str) -> str | None:
        if self.everything:
            return self.everything_because[0] if self.everything_because else "everything"
        return self.tests.get(test)


def build_graph(root: Path, tree: TestTree, cache=None) -> tuple[ImportGraph, list[str]]:
    """The import graph of the workspace's source dirs plus the Python files under tests/, and
    the source dirs (root-relative) it was built from (for benchmarks and brute-force checks;
    the planner reads the same facts through :mod:`mizzen_ci.plan.index`)."""
    root = root.resolve()
    source_dirs = workspace_source_dirs(root)
    graph = ImportGraph.build(root, source_dirs, tree.all, cache)
    return graph, relative_dirs(source_dirs, root)


def module_of(path: str, source_dirs: Iterable[str]) -> str | None:
    """The dotted module name of a ``.py`` path under one of ``source_dirs``, else ``None``."""
    for sd in source_dirs:
        prefix = sd.rstrip("/") + "/"
        if path.startswith(prefix) and path.endswith(".py"):
            parts = list(PurePosixPath(path[len(prefix) :]).with_suffix("").parts)
            if parts and parts[-1] == "__init__":
                parts.pop()
            if parts and all(p.isidentifier() for p in parts):
                return ".".join(parts)
    return None


def _dir(path: str) -> str:
    return path.rpartition("/")[0]


def _under(path_dir: str, ancestor: str) -> bool:
    return path_dir == ancestor or path_dir.startswith(ancestor + "/")


class Analyser:
    """Impact analysis over one tree; reusable for several changes (benchmarks, brute force).

    ``modules``: ``{module name: root-relative file}`` of the workspace's source dirs;
    ``reach``: the :class:`ReachIndex` of those modules and of every Python file of ``tree``."""

    def __init__(
        self,
        tree: TestTree,
        modules: Mapping[str, str],
        source_dirs: list[str],
        reach: ReachIndex,
        excludes: Iterable[str] = (),
    ):
        self.excludes = tuple(excludes)
        self.modules = modules
        self.reach = reach
        self.source_dirs = source_dirs
        self.tree = tree
        self.test_set = set(tree.tests)
        self.rank = {n: i for i, n in enumerate(itertools.chain(modules, tree.all))}
        self.tests_by_dir: dict[str, list[str]] = {}
        for t in tree.tests:
            self.tests_by_dir.setdefault(_dir(t), []).append(t)

    @classmethod
    def of_graph(
        cls, graph: ImportGraph, source_dirs: list[str], tree: TestTree, excludes=()
    ) -> Analyser:
        return cls(tree, graph.modules, source_dirs, reach_of_graph(graph), excludes)

    # -- graph

    def importers_with_origin(self, changed: dict[str, str]) -> dict[str, str]:
        """``{node: why}`` for every node whose closure (all imports, lazy ones too) reaches a
        name in ``changed`` (``{module name: why it changed}``): a reverse breadth-first search
        over the reach index, visiting only nodes that reach the frontier.  A node reached from
        several changed modules takes the why of the first in ``changed`` order at the least
        depth (independent of the index's list order)."""
        importers, modules, rank = self.reach.importers, self.modules, self.rank
        last = len(rank)

        def tree_order(node: str) -> tuple[int, str]:
            return rank.get(node, last), node

        origin: dict[str, str] = {}
        queue = deque(changed.items())
        seen = set(changed)
        while queue:
            name, why = queue.popleft()
            found = importers(name, modules)
            for node in sorted(found, key=tree_order) if len(found) > 1 else found:
                if node not in seen:
                    seen.add(node)
                    origin[node] = why
                    if node in modules:  # a file under tests/ is imported by no one
                        queue.append((node, why))
        return origin

    # -- test-tree rules

    def tests_below(self, directory: str) -> list[str]:
        """Test files in ``directory`` or below (a conftest's reach)."""
        return [t for d, ts in self.tests_by_dir.items() if _under(d, directory) for t in ts]

    def tests_above(self, directory: str) -> list[str]:
        """Test files in ``directory`` or a directory above it, up to ``tests/`` (who may read a
        helper or data file there)."""
        out = []
        d = directory
        while d and (d == TESTS_DIR or d.startswith(TESTS_DIR + "/")):
            out += self.tests_by_dir.get(d, [])
            d = _dir(d)
        return out

    def tests_for_test_path(self, path: str) -> list[str]:
        """What a changed (or impacted) path under tests/ selects."""
        if path in self.test_set:
            return [path]
        name = path.rpartition("/")[2]
        if (
            name.startswith("test_")
            and name.endswith(".py")
            and not is_excluded(path, self.excludes)
        ):
            return []  # a test file that is gone (or not registered): nothing reads it
        if name == "conftest.py":
            return self.tests_below(_dir(path))
        return self.tests_above(_dir(path))

    # -- the analysis

    def analyse(self, change: Change, rules: tuple[Rule, ...] = RULES) -> Impact:
        impact = Impact()
        if not change.usable:
            impact.everything = True
            impact.everything_because.append(f"the diff is unusable ({change.reason})")
            return impact
        changed_modules: dict[str, str] = {}
        selected: dict[str, str] = {}

        def select(tests: Iterable[str], why: str) -> None:
            for t in tests:
                selected.setdefault(t, why)

        for path in sorted(change.paths):
            rule = rule_for(path, rules)
            if rule.effect == EVERYTHING:
                impact.everything = True
                impact.everything_because.append(f"{path} changed ({rule.why})")
            elif rule.effect == NOTHING:
                impact.ignored.append((path, rule.why))
            elif rule.effect == PYTHON:
                module = module_of(path, self.source_dirs)
                if module is None:
                    impact.everything = True
                    impact.everything_because.append(
                        f"{path} changed: Python outside every workspace source dir (fail open)"
                    )
                else:
                    changed_modules.setdefault(module, f"reaches {module} ({path} changed)")
            elif rule.effect == TESTS:
                why = f"{path} changed"
                select(self.tests_for_test_path(path), why)
            elif rule.effect == PACKAGE_DATA:
                package_dir = "/".join(path.split("/")[:2]) + "/"
                modules = [m for m, f in self.modules.items() if f.startswith(package_dir)]
                if not modules:
                    impact.everything = True
                    impact.everything_because.append(
                        f"{path} changed in {package_dir} which has no modules (fail open)"
                    )
                for m in modules:
                    changed_modules.setdefault(m, f"reaches {package_dir} ({path} changed)")
        if impact.everything:
            return impact

        for node, why in self.importers_with_origin(changed_modules).items():
            if node in self.test_set:
                selected.setdefault(node, why)
            elif node.startswith(TESTS_DIR + "/"):
                select(self.tests_for_test_path(node), f"{node} {why}")
        impact.tests = selected
        return impact
