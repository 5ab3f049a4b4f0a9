"""Impact analysis: which test files a change reaches, and why.

Built on :mod:`mizzen_ci.import_graph` (the one import graph of the repository); the path rules
come from :mod:`mizzen_ci.change_rules`.

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
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .change import Change
from .change_rules import EVERYTHING, NOTHING, PACKAGE_DATA, PYTHON, RULES, TESTS, Rule, rule_for
from .import_graph import (
    FactsCache,
    GraphProblem,
    ImportGraph,
    iter_source_modules,
    workspace_source_dirs,
)
from .registry import TESTS_DIR, is_excluded

SCOPE = "all"  # tests run function bodies: lazy imports count


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


@dataclass
class TestTree:
    """The Python files under ``tests/`` that the graph needs: test files, conftests, helpers."""

    tests: list[str]
    conftests: list[str]
    helpers: list[str]

    @property
    def all(self) -> list[str]:
        return self.tests + self.conftests + self.helpers


def scan_tests_dir(root: Path, excludes: Iterable[str]) -> TestTree:
    """Every ``.py`` file under ``root/tests`` outside the registry's excluded trees, sorted."""
    excludes = tuple(excludes)
    tests, conftests, helpers = [], [], []
    base = root / TESTS_DIR
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".")
            and d != "__pycache__"
            and not is_excluded(f"{rel_dir}/{d}", excludes)
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = f"{rel_dir}/{name}"
            if is_excluded(rel, excludes):
                continue
            if name == "conftest.py":
                conftests.append(rel)
            elif name.startswith("test_"):
                tests.append(rel)
            else:
                helpers.append(rel)
    return TestTree(tests, conftests, helpers)


def build_graph(
    root: Path, tree: TestTree, cache: FactsCache | None = None
) -> tuple[ImportGraph, list[str]]:
    """The import graph of the workspace's source dirs plus the Python files under tests/, and
    the source dirs (root-relative) it was built from.

    This is :meth:`ImportGraph.build` (same discovery, facts cache with its parallel parse,
    problems and constructor) except that the extra files' root-relative paths are taken as
    given instead of resolving each one, which costs seconds on 10,000 test files.  It should
    fold back into ``ImportGraph.build`` once that skips the per-file ``resolve()``."""
    root = root.resolve()
    cache = cache if cache is not None else FactsCache(None)
    prefix = str(root) + os.sep
    source_dirs = [d if d.is_absolute() else root / d for d in workspace_source_dirs(root)]
    modules: dict[str, str] = {}
    files: dict[str, str] = {}
    problems: list[GraphProblem] = []
    wanted: list[tuple[str, str, str]] = []  # (node, path, root-relative path)
    for sd in source_dirs:
        for name, path in iter_source_modules(sd):
            path = os.fspath(path)
            rel = path[len(prefix) :].replace(os.sep, "/") if path.startswith(prefix) else path
            if name in modules:
                problems.append(
                    GraphProblem(rel, 1, f"module {name} is also defined by {modules[name]}")
                )
                continue
            modules[name] = files[name] = rel
            wanted.append((name, path, rel))
    for rel in tree.all:
        files[rel] = rel
        wanted.append((rel, prefix + rel, rel))
    found = cache.facts_for_many([(path, rel) for _, path, rel in wanted])
    facts = {node: f for (node, _, _), f in zip(wanted, found, strict=True)}
    for node, f in facts.items():
        if f.error is not None:
            problems.append(GraphProblem(files[node], f.error_line, f"cannot parse: {f.error}"))
    graph = ImportGraph(root, modules, files, facts, problems)
    return graph, [_rel(d, root) for d in source_dirs]


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


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
    """Impact analysis over one graph; reusable for several changes (benchmarks, brute force)."""

    def __init__(
        self,
        root: Path,
        graph: ImportGraph,
        source_dirs: list[str],
        tree: TestTree,
        excludes: Iterable[str] = (),
    ):
        self.root = root
        self.excludes = tuple(excludes)
        self.graph = graph
        self.source_dirs = source_dirs
        self.tree = tree
        self.test_set = set(tree.tests)
        self.tests_by_dir: dict[str, list[str]] = {}
        for t in tree.tests:
            self.tests_by_dir.setdefault(_dir(t), []).append(t)
        self._reached: dict[str, frozenset[str]] = {}
        self._index: dict[str, list[str]] | None = None

    # -- graph

    def reached(self, node: str) -> frozenset[str]:
        """Every name importing ``node``'s code can run directly, over all its imports (lazy ones
        too): each resolved target with the parent packages it runs first
        (:meth:`ImportGraph.with_parents`) and, for ``from pkg import name``, ``pkg.name`` (a
        submodule, or one that is gone)."""
        got = self._reached.get(node)
        if got is None:
            graph, names = self.graph, set()
            for edge in graph.edges(node):
                names.update(graph.with_parents(edge.target))
                if edge.kind == "from":
                    for n in edge.names:
                        if n != "*":
                            names.update(graph.with_parents(f"{edge.target}.{n}"))
            got = self._reached[node] = frozenset(names)
        return got

    def _mentions(self) -> dict[str, list[str]]:
        """``{name component: nodes whose imports, as written, could resolve to a name ending in
        it}``: every component of each written module and imported name, plus the importer's own
        package for relative imports.  A superset; :meth:`reached` decides."""
        if self._index is None:
            index: dict[str, list[str]] = {}
            for node, facts in self.graph.facts.items():
                keys: set[str] = set()
                relative = False
                for imp in facts.imports:
                    if imp.module:
                        keys.update(imp.module.split("."))
                    keys.update(imp.names)
                    relative = relative or imp.level > 0
                if relative and node in self.graph.modules:
                    keys.update(node.split("."))
                for k in keys:
                    index.setdefault(k, []).append(node)
            self._index = index
        return self._index

    def importers_with_origin(self, changed: dict[str, str]) -> dict[str, str]:
        """``{node: why}`` for every node whose closure (all imports, lazy ones too) reaches a
        name in ``changed`` (``{module name: why it changed}``): a reverse breadth-first search
        that resolves only the nodes whose written imports could name the frontier."""
        mentions = self._mentions()
        origin: dict[str, str] = {}
        queue = deque(changed.items())
        seen = set(changed)
        while queue:
            name, why = queue.popleft()
            for node in mentions.get(name.rpartition(".")[2], ()):
                if node not in seen and name in self.reached(node):
                    seen.add(node)
                    origin[node] = why
                    if node in self.graph.modules:  # an extra file is imported by no one
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
                modules = [m for m, f in self.graph.modules.items() if f.startswith(package_dir)]
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


def analyse(
    root: Path | str,
    change: Change,
    excludes: Iterable[str] = (),
    cache: FactsCache | None = None,
) -> Impact:
    """Impact of ``change`` on the test files under ``root`` (one-shot convenience)."""
    root = Path(root).resolve()
    excludes = tuple(excludes)
    tree = scan_tests_dir(root, excludes)
    graph, source_dirs = build_graph(root, tree, cache)
    return Analyser(root, graph, source_dirs, tree, excludes).analyse(change)
