"""The planner's index of a tree: its registry and who imports what, kept warm between runs.

``build_index(root, fleet, cache_path=None, workers=None, with_reach=True) -> PlanIndex``:

1. Discovery, once of each kind: the workspace's modules
   (:func:`mizzen_ci.import_graph.source_modules`) and the Python files under ``tests/``
   (:func:`mizzen_ci.impact.scan_tests_dir`) first, so that on a cold run their reading starts
   while the registry's own walk (:func:`mizzen_ci.registry.discover`) runs.
2. One pass over those files through :class:`mizzen_ci.facts_cache.FactsCache`: each file is
   parsed at most once (in worker processes on a cold run), and from its facts the planner derives
   per file what it needs: a test file's validated registration (kept in the cache by path,
   content hash and :func:`cache_context`) and the names a file's imports name directly, with
   their parent packages (for this run's index only).  A warm run with nothing changed costs the
   walks, one ``stat`` per file and one cache load: no file is read, parsed or resolved.  Each
   answer is used as soon as it is ready (a cold run overlaps the parse workers).
3. The registry, assembled in discovery order from the registrations.
4. The :class:`~mizzen_ci.reach_index.ReachIndex` (who reaches what), kept in the cache as a
   section and updated only for the files whose content changed (their old names come from the
   facts of their old content), or built in full when there is none.

``with_reach=False`` (a run that selects everything) reads only the registry's test files and
keeps the cached facts of the others for the next run.

Invariants:
- ``index.registry`` equals :func:`mizzen_ci.registry.read_registry` of the same tree (same
  registrations, same errors, same order); ``index.reach`` equals, as a relation,
  :func:`mizzen_ci.impact.reach_of_graph` of ``ImportGraph.build`` over the same files (tested
  through edits, additions, deletions, renames and fleet changes in ``test_plan_cache.py``).
- The cache context is the fleet table's bytes and the code of this module and of the reach
  index: a change to either re-derives (re-validates, re-resolves) without re-parsing.
- Without a cache path nothing is kept; a cache that cannot be written leaves the answer as is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from . import reach_index as _reach_index_module
from .facts_cache import FactsCache
from .fleet import Fleet
from .impact import TestTree, relative_dirs, scan_tests_dir
from .import_graph import direct_names, package_of, source_modules, workspace_source_dirs
from .reach_index import ReachIndex, parents_of
from .registry import (
    TESTS_DIR,
    Registration,
    Registry,
    RegistryError,
    discover,
    outside_tests,
    registry_excludes,
    validate_row,
)
from .source_facts import FileFacts

CACHE_FILE = "plan-facts.marshal"
_REACH_SECTION = "reach"


@dataclass
class PlanIndex:
    """What the planner knows about a tree (see the module docstring)."""

    root: Path
    registry: Registry
    tree: TestTree
    source_dirs: list[str]  # root-relative POSIX (absolute when outside the root)
    modules: dict[str, str]  # module name -> root-relative file
    reach: ReachIndex
    excludes: tuple[str, ...]
    stats: dict[str, int]  # files parsed, files answered from the cache, files derived afresh


def cache_context(fleet: Fleet) -> str:
    """What the cached per-file answers depend on besides the files: the fleet table and the
    code of this module and of the reach index (a change re-derives, without re-parsing)."""
    h = hashlib.sha256()
    for path in (fleet.path, Path(__file__), Path(_reach_index_module.__file__)):
        try:
            h.update(Path(path).read_bytes())
        except OSError:
            h.update(str(path).encode())
    return h.hexdigest()


def _derive(fleet: Fleet, key: str, arg: tuple, facts: FileFacts) -> tuple:
    """``(kept, extra)`` of one file (``arg``: (package or None, is_test)): ``kept`` is a test
    file's encoded registration (None otherwise), kept in the cache; ``extra`` is a graph node's
    ``(names, parents)``, for this run's reach index only (None otherwise)."""
    package, is_test = arg
    kept = extra = None
    if is_test:
        row, errors = validate_row(facts.registration, key, fleet)
        kept = (row, tuple([(e.line, e.rule, e.message, e.fix) for e in errors]))
    if package is not None:
        names = direct_names(facts.imports, package)
        extra = (names, parents_of(names))
    return kept, extra


def _names(facts: FileFacts | None, package: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    names = direct_names(facts.imports, package) if facts is not None else ()
    return names, parents_of(names)


def build_index(
    root: Path | str,
    fleet: Fleet,
    cache_path: Path | None = None,
    workers: int | None = None,
    with_reach: bool = True,
) -> PlanIndex:
    """The index of ``root`` (see the module docstring).  ``with_reach=False`` (a run that
    selects everything) reads only the registry's test files and leaves ``reach`` empty."""
    # Tens of thousands of small tuples and no reference cycles: the cyclic GC would only
    # rescan them (a tenth of a warm run); it is back on when the index is built.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_index(Path(root).resolve(), fleet, cache_path, workers, with_reach)
    finally:
        if gc_was_enabled:
            gc.enable()


def _build_index(
    root: Path, fleet: Fleet, cache_path: Path | None, workers: int | None, with_reach: bool
) -> PlanIndex:
    excludes = registry_excludes(root)
    prefix = str(root) + os.sep
    cache = FactsCache(cache_path, context=cache_context(fleet))
    derive = functools.partial(_derive, fleet)

    # One item per file: (path, key, (package or None, is_test)); key: module name or rel path.
    # The graph's files first: on a cold run their reading starts while the registry's own
    # discovery walks the tree.
    items: list[tuple[str, str, tuple]] = []
    modules: dict[str, str] = {}
    tree = TestTree([], [], [])
    dirs: list[Path] = []
    if with_reach:
        tree = scan_tests_dir(root, excludes)
        dirs = workspace_source_dirs(root)
        found_modules, _ = source_modules(root, dirs)  # duplicates: the graph reports them
        for name, path, rel in found_modules:
            modules[name] = rel
            items.append((path, name, (package_of(name, rel.endswith("__init__.py")), False)))
        tests = set(tree.tests)
        for rel in tree.all:
            items.append((prefix + rel, rel, ("", rel in tests)))
    results = cache.derive_iter(items, derive, workers)
    test_files = discover(root, excludes)
    registry_tests = {rel for rel in test_files if rel.startswith(TESTS_DIR + "/")}
    in_tree = set(tree.tests)
    # Not part of the graph: the registry's test files outside the scanned tree (symlinked
    # directories, …), or all of them without the graph (with the graph's own `arg`, so that
    # a run with and a run without the graph reuse each other's answers).
    other = None if with_reach else ""
    more = [(prefix + rel, rel, (other, True)) for rel in sorted(registry_tests - in_tree)]
    if more:  # test files the registry reads that are not part of the graph (symlinked dirs, …)
        start = len(items)
        items += more

        def after_the_graph():  # (read when the first batch is done: one batch at a time)
            for i, value in cache.derive_iter(more, derive, workers):
                yield start + i, value

        results = itertools.chain(results, after_the_graph())

    loaded = ReachIndex.from_data(cache.section(_REACH_SECTION)) if with_reach else None
    fresh = ReachIndex() if with_reach and loaded is None else None
    answers: dict[str, tuple] = {}
    nodes: dict[str, tuple] = {}  # graph node -> (package, (names, parents) or None if reused)
    # Each value is used as soon as it is ready: on a cold run this overlaps the parse workers.
    for i, (kept, extra) in results:
        _, key, (package, is_test) = items[i]
        if is_test:
            row, errors = kept
            answers[key] = (Registration(*row) if row is not None else None, errors)
        if package is not None:
            nodes[key] = (package, extra)
            if fresh is not None and extra is not None:
                fresh.add(key, *extra)

    registry = Registry(root)
    for rel in test_files:
        if rel not in registry_tests:
            registry.errors.append(outside_tests(rel))
            continue
        registration, errors = answers[rel]
        if registration is not None:
            registry.registrations.append(registration)
        if errors:
            registry.errors.extend(RegistryError(rel, *e) for e in errors)

    reach = ReachIndex()
    if with_reach:
        reach = _update_reach(cache, nodes, loaded, fresh)
    if cache_path is not None:
        with contextlib.suppress(OSError):  # a read-only checkout plans too, only slower
            cache.save(keep_unseen=not with_reach)  # a registry-only run keeps the graph's files
    source_dirs = relative_dirs(dirs, root)
    stats = {"parsed": cache.parsed, "cached": cache.hits, "derived": len(cache.recomputed)}
    return PlanIndex(root, registry, tree, source_dirs, modules, reach, tuple(excludes), stats)


def _update_reach(
    cache: FactsCache, nodes: dict[str, tuple], loaded: ReachIndex | None, fresh: ReachIndex | None
) -> ReachIndex:
    """The reach index: the ``loaded`` one with the changed files' names swapped (their old names
    come from the facts of their old content), or ``fresh`` (built from the names derived in
    this run) completed with the names of the files whose derived value was reused."""
    if loaded is not None:
        previous = cache.previous_derived()
        changed = cache.recomputed | (previous.keys() - nodes.keys())
        for key in sorted(changed):
            old = previous.get(key)
            if old is not None and old[1][0] is not None:
                facts = cache.facts_of(old[0])
                if facts is None:  # the old names are unknown: build afresh
                    break
                loaded.remove(key, *_names(facts, old[1][0]))
            if key in nodes:
                package, extra = nodes[key]
                loaded.add(key, *(extra or _names(cache.facts_of(cache.sha_of(key)), package)))
        else:
            cache.set_section(_REACH_SECTION, loaded.to_data(), modified=bool(changed))
            return loaded
        fresh = ReachIndex.build({k: e for k, (_, e) in nodes.items() if e is not None})
    for key, (package, extra) in nodes.items():
        if extra is None:
            sha = cache.sha_of(key)
            fresh.add(key, *_names(cache.facts_of(sha) if sha else None, package))
    cache.set_section(_REACH_SECTION, fresh.to_data())
    return fresh
