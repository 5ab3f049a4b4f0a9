"""Impact analysis: which test files a change reaches, and why.

Built on the one import graph of the repository, read as a :class:`~mizzen_ci.imports.reach.
ReachIndex` (who names what, all scopes, inverted; the planner keeps it warm in
:mod:`mizzen_ci.plan.index`); the path rules come from :mod:`mizzen_ci.plan.path_rules`; the
files under ``tests/`` from the registry's one walk (:mod:`mizzen_ci.registry.discover`).

A test file is impacted when
- it changed itself;
- its import closure reaches a changed module, following *every* import, lazy ones too (tests
  run function bodies), through parent packages' ``__init__``, ``from pkg import sub``, dynamic
  imports with literal names (``import_module``, ``importorskip``, ``python -m``, through aliases)
  and *sibling* imports between files under ``tests/`` (``import slot_kit`` beside
  ``slot_kit.py``: :func:`mizzen_ci.imports.resolve.sibling_names`);
- something in that closure imports by a computed name (fail open): a module that does reaches
  every module of its own top-level package; a file under ``tests/`` that does, every module of
  the packages it names (of every workspace package if it names none of them);
- it, or anything its closure reaches, *names* a changed file by a path literal
  (:mod:`mizzen_ci.imports.path_literals`): a test reading ``data/x.json``, a conftest loading
  ``fake_engine.py`` by path (then the tests that conftest serves), a module naming its data
  file; whatever names a file is impacted as if it were that file's importer (a bare
  ``"conftest.py"``, ``"__init__.py"`` or ``"__main__.py"`` names only the one beside it:
  :func:`mizzen_ci.imports.path_literals.names`);
- a ``conftest.py`` of its directory or any directory above changed, or is impacted;
- a file it reads under ``tests/`` changed: a helper or data file in its directory or below
  (helpers are loaded by path, so a helper that is impacted counts too);
- a non-Python file of a package whose modules it reaches changed;
- a package's ``__main__`` module, or a module the package's ``pyproject.toml`` declares as an
  entry point (:func:`mizzen_ci.imports.workspace.entry_point_modules`), changed and it reaches
  any module of that package (``python -m pkg`` and console scripts run code no import shows);
- a changed path matches a glob its registration ``watches``;
- something in its closure *loads* a changed module without an import statement
  (:mod:`mizzen_ci.imports.loaders`): runs it in a subprocess (``python -m``, ``python -c``
  code, a console script of the workspace mapped through ``[project.scripts]``), loads an
  entry-point group the module is a target of (``entry_points(group=…)``: the group's targets
  are that loader's dependencies), or imports it through a folder some file adds to
  ``sys.path`` (``sys.path`` is one per process: every file's imports resolve against every such
  folder).  These are one-step relations of *virtual* nodes ``script:NAME`` and
  ``entry-points:GROUP`` built from the workspace's entry points each run;
- a ``pytest11`` target (or a ``-p`` plugin of the root's pytest ``addopts``) reaches a changed
  module: pytest loads it in every session, so every test is selected;
- something in its closure loads code the planner cannot resolve (a computed program, a
  ``sys.path`` folder it cannot evaluate or whose files it does not read, a file over a size cap
  or unreadable: ``ReachIndex.opaque``) and any source changed: selected with the reason
  ``runs code the planner cannot resolve: file:line (what)``.

Invariants:
- A changed path's meaning is decided only by the rules table; a path no rule knows, a Python
  file outside every source directory, or an unusable diff selects everything (fail open).
  Naming and ``watches`` apply to every changed path whatever its rule (a README a test reads
  selects that test).
- Renamed and deleted modules are looked up by name among the *targets* of imports, so a test
  still importing a module that is gone is impacted; a deleted file is looked up among the path
  literals, so a test still naming it is impacted.
- Every impacted test carries one reason naming the changed path that reached it.
- The reverse search visits only what reaches a changed module or file (one index lookup per
  step); over imports alone its answer equals the importers that :meth:`ImportGraph.importers`
  finds over all scopes (sibling imports included).
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

from ..imports import (
    UNKNOWN_GROUP,
    EntryPointDecl,
    ImportGraph,
    ReachIndex,
    parents_of,
    reach_of_graph,
    relative_dirs,
    workspace_source_dirs,
)
from ..imports.loaders import resolve_dir
from ..imports.path_literals import CONVENTION_NAMES
from ..imports.resolve import sibling_names
from ..registry import TESTS_DIR, TestTree, is_excluded
from .change import Change
from .path_rules import (
    EVERYTHING,
    NOTHING,
    PACKAGE_DATA,
    PYTHON,
    RULES,
    TESTS,
    Rule,
    glob_matches,
    package_of,
    rule_for,
)


@dataclass
class Impact:
    """The outcome of impact analysis."""

    everything: bool = False
    everything_because: list[str] = field(default_factory=list)
    tests: dict[str, str] = field(default_factory=dict)  # test file -> why it is impacted
    # (path, rule's why) of the paths whose rule selects nothing (tests that name or watch one
    # are selected all the same)
    ignored: list[tuple[str, str]] = field(default_factory=list)

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
    ``reach``: the :class:`ReachIndex` (or the planner's lazy one) of those modules and of every
    Python file of ``tree``; ``watches``: ``{test file: its registration's watches globs}``;
    ``entry_points``: ``{module: how it is an entry point}``
    (:func:`mizzen_ci.imports.workspace.entry_point_modules`)."""

    def __init__(
        self,
        tree: TestTree,
        modules: Mapping[str, str],
        source_dirs: list[str],
        reach: ReachIndex,
        excludes: Iterable[str] = (),
        *,
        watches: Mapping[str, Iterable[str]] | None = None,
        entry_points: Mapping[str, Iterable[str]] | None = None,
        entry_table: Iterable[EntryPointDecl] = (),
    ):
        self.excludes = tuple(excludes)
        self.modules = modules
        self.reach = reach
        self.source_dirs = source_dirs
        self.tree = tree
        self.test_set = set(tree.tests)
        self.tree_files = set(tree.all)
        self.watches = {t: tuple(g) for t, g in (watches or {}).items() if g}
        self.entry_points = {m: list(how) for m, how in (entry_points or {}).items()}
        self.rank = {n: i for i, n in enumerate(itertools.chain(modules, tree.all))}
        self.tests_by_dir: dict[str, list[str]] = {}
        for t in tree.tests:
            self.tests_by_dir.setdefault(_dir(t), []).append(t)
        self._virtual(list(entry_table))

    @classmethod
    def of_graph(
        cls,
        graph: ImportGraph,
        source_dirs: list[str],
        tree: TestTree,
        excludes=(),
        **kwargs,
    ) -> Analyser:
        return cls(tree, graph.modules, source_dirs, reach_of_graph(graph), excludes, **kwargs)

    @classmethod
    def of_index(cls, index) -> Analyser:
        """The analyser of a :class:`mizzen_ci.plan.index.PlanIndex` (what the planner uses)."""
        watches = {r.path: r.watches for r in index.registry.registrations if r.watches}
        return cls(
            index.tree,
            index.modules,
            index.source_dirs,
            index.reach,
            index.excludes,
            watches=watches,
            entry_points=index.entry_points,
            entry_table=index.entry_table,
        )

    # -- code loaded without an import statement

    def _virtual(self, table: list[EntryPointDecl]) -> None:
        """The virtual nodes of the workspace's entry points: ``script:NAME`` (a console script)
        and ``entry-points:GROUP`` each load their targets (with their parent packages)."""
        nodes: dict[str, list[str]] = {}
        self.unknown_members: list[tuple[str, str]] = []  # (folder/, why)
        self.every_session: dict[str, str] = {}  # virtual node -> how pytest loads its targets
        for decl in table:
            if decl.group == UNKNOWN_GROUP:
                self.unknown_members.append((decl.module, decl.how))
                continue
            keys = [f"entry-points:{decl.group}"]
            if decl.group in ("console_scripts", "gui_scripts"):
                keys.append(f"script:{decl.name}")
            for key in keys:
                nodes.setdefault(key, []).append(decl.module)
            if decl.group == "pytest11":
                known = self.every_session.get(keys[0])
                self.every_session[keys[0]] = f"{known}; {decl.how}" if known else decl.how
        self.virtual = ReachIndex()
        for key, targets in nodes.items():
            names = tuple(dict.fromkeys(targets))
            self.virtual.add(key, (names, parents_of(names), (), (), (), ""))

    def virtual_importers(self, module: str) -> list[str]:
        """The virtual nodes that load ``module`` (or a module below it, whose parent packages
        run first), and for a module of a member whose entry points are unknown, every loader
        of any group or script."""
        found = self.virtual.importers(module, self.modules)
        if self.unknown_members:
            file = self.modules.get(module, "")
            if any(file.startswith(folder) for folder, _ in self.unknown_members):
                found = found + self._every_loader()
        return found

    def _every_loader(self) -> list[str]:
        named = self.reach.index.named if hasattr(self.reach, "index") else self.reach.named
        return [
            n
            for key, nodes in named.items()
            if key.startswith(("script:", "entry-points:"))
            for n in nodes
        ]

    def loaders_of(self, virtual: str) -> list[str]:
        """The nodes that run a console script / load an entry-point group (an unknown group,
        ``entry-points:*``, loads every group)."""
        found = self.reach.naming(virtual, False)
        if virtual.startswith("entry-points:"):
            found = found + self.reach.naming("entry-points:*", False)
        return found

    def syspath_dirs(self) -> tuple[dict[str, str], dict[str, str]]:
        """``({folder: the node adding it}, {node: why it is opaque})``: the root-relative folders
        files add to ``sys.path`` (one ``sys.path`` per process: every file's imports resolve
        against each), and the nodes whose folder the planner cannot follow (outside the
        repository, or holding files it does not read: outside ``tests/`` and every source
        dir)."""
        table = self.reach.index.syspath if hasattr(self.reach, "index") else self.reach.syspath
        folders: dict[str, str] = {}
        opaque: dict[str, str] = {}
        readable = [*(d.rstrip("/") for d in self.source_dirs), TESTS_DIR]
        for node in sorted(table):
            file = self.modules.get(node, node)
            for encoded in table[node]:
                folder = resolve_dir(encoded, file)
                if folder is None:
                    opaque.setdefault(node, f"adds {encoded} to sys.path, outside the repository")
                elif not any(_under(folder, d) or _under(d, folder) for d in readable):
                    opaque.setdefault(
                        node,
                        f"adds {folder or '.'}/ to sys.path, whose files the planner does not read",
                    )
                else:
                    folders.setdefault(folder, node)
        return folders, opaque

    def through_syspath(self, file: str) -> list[str]:
        """The nodes that may import ``file`` through a folder on ``sys.path``."""
        found: list[str] = []
        if not file.endswith(".py"):
            return found
        for folder in self._folders:
            prefix = folder + "/" if folder else ""
            if not file.startswith(prefix):
                continue
            parts = file[len(prefix) : -3].split("/")
            if parts[-1] == "__init__":
                parts.pop()
            if parts and all(p.isidentifier() for p in parts):
                found += self.reach.naming(".".join(parts), True)
        return found

    # -- graph

    def importers_with_origin(
        self, changed: dict[str, str], paths: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """``{node: why}`` for every node that reaches a name in ``changed`` (``{module name or
        file under tests/: why it changed}``), following every import (lazy ones too, sibling
        imports, fail-open dynamic ones) and path literals (a node naming the file of anything
        reached is reached too), or that names a path in ``paths`` (``{changed path: why}``):
        a reverse breadth-first search over the reach index, visiting only nodes that reach the
        frontier.  A node reached from several changes takes the why of the first in ``changed``
        order at the least depth (independent of the index's list order)."""
        reach, modules, rank, tree_files = self.reach, self.modules, self.rank, self.tree_files
        last = len(rank)

        def tree_order(node: str) -> tuple[int, str]:
            return rank.get(node, last), node

        origin: dict[str, str] = {}
        self._folders, _ = self.syspath_dirs()
        named = set(paths or ())  # paths whose namers are looked up (changed paths: below)
        queue = deque((name, why, False) for name, why in changed.items())
        queue.extend((path, why, True) for path, why in (paths or {}).items())
        seen = set(changed)
        while queue:
            key, why, is_path = queue.popleft()
            found: list[str] = []
            if is_path:
                found = self.namers(key) + self.through_syspath(key)
            elif key.startswith(("script:", "entry-points:")):  # a virtual node: its loaders
                found = self.loaders_of(key)
                file = None
            else:
                if "/" in key:  # a file under tests/: who imports it as a sibling
                    for directory, dotted in sibling_names(key, tree_files):
                        found += [
                            n
                            for n in reach.naming(dotted, True)
                            if "/" in n and n.rpartition("/")[0] == directory
                        ]
                    file = key if key in tree_files else None
                else:
                    found = reach.importers(key, modules) + self.virtual_importers(key)
                    file = modules.get(key)
                if file is not None:  # who imports its file through a sys.path folder
                    found = found + self.through_syspath(file)
                if file is not None and file not in named:  # who names its file
                    named.add(file)
                    found = found + self.namers(file)
            for node in sorted(set(found), key=tree_order) if len(found) > 1 else found:
                if node not in seen:
                    seen.add(node)
                    origin[node] = why
                    queue.append((node, why, False))
        return origin

    def namers(self, path: str) -> list[str]:
        """The nodes that name ``path`` by a path literal
        (:func:`mizzen_ci.imports.path_literals.names`: a file of a conventional name, by its
        bare name only from beside it)."""
        directory, _, name = path.rpartition("/")
        if name not in CONVENTION_NAMES:
            return self.reach.namers(path)
        modules = self.modules
        return self.reach.namers(path, bare=False) + [
            n
            for n in self.reach.namers(name)
            if (modules.get(n) or n).rpartition("/")[0] == directory
        ]

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

    # -- package-wide changes

    def package_modules(self, path: str) -> list[str]:
        """The modules of the workspace package holding ``path`` (``packages/<name>/``)."""
        package = package_of(path)
        if package is None:
            return []
        prefix = package + "/"
        return [m for m, f in self.modules.items() if f.startswith(prefix)]

    def runs_without_import(self, module: str, path: str) -> str | None:
        """How ``module`` (at ``path``) runs without being imported (``python -m``, an entry
        point; any module of a package whose entry points are unknown), or None."""
        if module == "__main__" or module.endswith(".__main__"):
            package = module.rpartition(".")[0]
            return f"`python -m {package}` runs it" if package else "it runs as a script"
        found = self.entry_points.get(module)
        if found:
            return "; ".join(found)
        for key, why in self.entry_points.items():
            if key.endswith("/") and path.startswith(key):
                return "; ".join(why)
        return None

    # -- the analysis

    def analyse(self, change: Change, rules: tuple[Rule, ...] = RULES) -> Impact:
        impact = Impact()
        if not change.usable:
            impact.everything = True
            impact.everything_because.append(f"the diff is unusable ({change.reason})")
            return impact
        changed: dict[str, str] = {}  # module names and files under tests/ -> why
        changed_paths: dict[str, str] = {}  # every changed path -> why (for who names it)
        selected: dict[str, str] = {}
        source_changed = False  # a workspace source or a Python file under tests/ changed

        def select(tests: Iterable[str], why: str) -> None:
            for t in tests:
                selected.setdefault(t, why)

        for path in sorted(change.paths):
            rule = rule_for(path, rules)
            if rule.effect == EVERYTHING:
                impact.everything = True
                impact.everything_because.append(f"{path} changed ({rule.why})")
                continue
            changed_paths[path] = f"names {path}, which changed"
            if rule.effect in (PYTHON, PACKAGE_DATA) or (
                rule.effect == TESTS and path.endswith(".py")
            ):
                source_changed = True
            if rule.effect == NOTHING:
                impact.ignored.append((path, rule.why))
            elif rule.effect == PYTHON:
                module = module_of(path, self.source_dirs)
                if module is None:
                    impact.everything = True
                    impact.everything_because.append(
                        f"{path} changed: Python outside every workspace source dir (fail open)"
                    )
                else:
                    changed.setdefault(module, f"reaches {module} ({path} changed)")
                    how = self.runs_without_import(module, path)
                    if how is not None:
                        package = package_of(path)
                        why = f"reaches {package} ({path} changed: {how})"
                        for m in self.package_modules(path):
                            changed.setdefault(m, why)
            elif rule.effect == TESTS:
                select(self.tests_for_test_path(path), f"{path} changed")
                if path.endswith(".py"):  # a helper imported by its siblings
                    changed.setdefault(path, f"reaches {path} ({path} changed)")
            elif rule.effect == PACKAGE_DATA:
                package_dir = "/".join(path.split("/")[:2]) + "/"
                modules = self.package_modules(path)
                if not modules:
                    impact.everything = True
                    impact.everything_because.append(
                        f"{path} changed in {package_dir} which has no modules (fail open)"
                    )
                for m in modules:
                    changed.setdefault(m, f"reaches {package_dir} ({path} changed)")
            for test, globs in self.watches.items():
                for glob in globs:
                    if glob_matches(glob, path):
                        selected.setdefault(test, f"{path} changed (the test watches {glob})")
                        break
        if impact.everything:
            return impact

        origin = self.importers_with_origin(changed, changed_paths)
        if source_changed:  # what loads code it cannot resolve may load the change
            opaque = {n: why for n, why in self.opaque_nodes().items() if n not in changed}
            for node, why in opaque.items():
                origin.setdefault(node, why)
            for node, why in self.importers_with_origin(opaque).items():
                origin.setdefault(node, why)  # (a reason naming the change comes first)
        for virtual, how in self.every_session.items():
            if virtual in origin:
                select(
                    self.tree.tests, f"{origin[virtual]}; {how}: pytest loads it in every session"
                )
        for node, why in origin.items():
            if node in self.test_set:
                selected.setdefault(node, why)
            elif node.startswith(TESTS_DIR + "/"):
                select(self.tests_for_test_path(node), f"{node} {why}")
        impact.tests = selected
        return impact

    def opaque_nodes(self) -> dict[str, str]:
        """``{node: why}`` of the nodes that load code the planner cannot resolve, in the tree's
        order (see :meth:`syspath_dirs` for the ``sys.path`` folders it cannot follow)."""
        table = dict(self.reach.index.opaque if hasattr(self.reach, "index") else self.reach.opaque)
        _, folders = self.syspath_dirs()
        out: dict[str, str] = {}
        last = len(self.rank)
        for node in sorted({*table, *folders}, key=lambda n: (self.rank.get(n, last), n)):
            file = self.modules.get(node, node)
            what = table.get(node)
            if what:
                line, _, what = what.partition(": ")
            else:
                line, what = "1", folders[node]
            out[node] = f"runs code the planner cannot resolve: {file}:{line} ({what})"
        return out
