"""The planner's index of a tree: its registry and who imports what, kept warm between runs.

``build_index(root, fleet, cache_path=None, workers=None, with_reach=True, save=True) -> PlanIndex``:

1. Discovery, once of each kind: the registry's one walk of the tree
   (:func:`mizzen_ci.registry.discover`: test files, and the Python files under ``tests/``) and
   the workspace's modules (:func:`mizzen_ci.imports.source_modules`).
2. One pass over those files through :class:`~.facts_cache.FactsCache`: each file is
   parsed at most once (in worker processes on a cold run), and from its facts the planner derives
   per file what it needs: a test file's validated registration (kept in the cache by path,
   content hash and :func:`cache_context`) and a graph node's entry in the reach index (the
   names its imports name directly with their parent packages, its path literals and its
   fail-open packages: :func:`mizzen_ci.imports.reach.node_entry`, for this run's index only).
   A graph file that is not a test file is not parsed when its bytes allow
   (:mod:`.spelled_names`): its words and path literals are kept instead, and it is parsed only
   when a query of the impact search may need its names.  A warm run with nothing changed costs the
   walks, one ``stat`` per file and one cache load: no file is read, parsed or resolved.  Each
   answer is used as soon as it is ready (a cold run overlaps the parse workers).
3. The registry, assembled in discovery order from the registrations.
4. The :class:`~.lazy_reach.LazyReach` (who reaches what: an index of the parsed
   nodes, the pending ones by their words), kept in the cache as a section and updated only for
   the files whose content changed (their old names come from the facts of their old content, or
   they were pending), or built in full when there is none.  Queries parse pending nodes through
   the same cache; :meth:`PlanIndex.save` (called by ``build_index`` unless ``save=False``, by the
   planner after its impact search) keeps what they parsed.

``with_reach=False`` (a run that selects everything) reads only the registry's test files and
keeps the cached facts of the others for the next run.  ``index.entry_points`` and
``index.entry_table`` are read from the workspace members' ``pyproject.toml`` on every run (a
handful of small files; not cached).

Invariants:
- ``index.registry`` equals :func:`mizzen_ci.registry.read_registry` of the same tree (same
  registrations, same violations, same order); ``index.reach.completed()`` equals, as a
  relation, :func:`mizzen_ci.imports.reach_of_graph` of ``ImportGraph.build`` over the same files,
  and its
  ``importers`` answers as that relation does (tested through edits, additions, deletions,
  renames and fleet changes in ``test_plan_cache.py``).
- The cache context is the fleet table's bytes and the code of this module, of the reach index,
  of name resolution, of the word rule and of what a scan reads from the bytes (dynamic-import
  spellings, path literals): a change to any re-derives (re-validates, re-resolves) without
  re-parsing.
- Without a cache path nothing is kept; a cache that cannot be written leaves the answer as is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from ...fleet import Fleet
from ...imports import (
    EntryPointDecl,
    ReachIndex,
    entry_point_modules,
    entry_point_table,
    package_of,
    relative_dirs,
    source_modules,
    workspace_source_dirs,
)
from ...imports import facts as _facts_module
from ...imports import loaders as _loaders_module
from ...imports import path_literals as _path_literals_module
from ...imports import reach as _reach_module
from ...imports import resolve as _resolve_module
from ...imports.path_literals import path_literals
from ...imports.reach import Entry, node_entry
from ...registry import (
    TESTS_DIR,
    Backend,
    Registration,
    Registry,
    TestTree,
    Violation,
    discover,
    registry_excludes,
)
from ...registry.discover import outside_tests
from ...registry.rules import validate_row
from . import lazy_reach as _lazy_reach_module
from . import spelled_names as _spelled_names_module
from .facts_cache import FactsCache
from .lazy_reach import LazyReach
from .source_facts import FileFacts
from .spelled_names import PendingNodes, spelled_words

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
    reach: LazyReach
    excludes: tuple[str, ...]
    cache: FactsCache
    with_reach: bool = True
    reach_modified: bool = False  # the reach section differs from the one loaded
    # module -> how it is an entry point (see mizzen_ci.imports.workspace.entry_point_modules)
    entry_points: dict[str, list[str]] = field(default_factory=dict)
    # every entry point by group (mizzen_ci.imports.workspace.entry_point_table)
    entry_table: list[EntryPointDecl] = field(default_factory=list)

    @property
    def stats(self) -> dict[str, int]:
        """Files parsed, scanned (words only), answered from the cache, derived afresh (so far:
        queries of ``reach`` may parse more)."""
        c = self.cache
        return {
            "parsed": c.parsed,
            "scanned": c.scanned,
            "cached": c.hits,
            "derived": len(c.recomputed),
        }

    def save(self) -> None:
        """Keep what this run learnt (also what queries of ``reach`` parsed) in the cache file,
        atomically; a cache that cannot be written leaves the answers as they are."""
        if self.cache.path is None:
            return
        if self.with_reach:
            modified = self.reach_modified or self.reach.modified
            self.cache.set_section(_REACH_SECTION, self.reach.to_data(), modified=modified)
        with contextlib.suppress(OSError):  # a read-only checkout plans too, only slower
            self.cache.save(keep_unseen=not self.with_reach)  # registry-only: keep the graph's


def cache_context(fleet: Fleet) -> str:
    """What the cached per-file answers depend on besides the files and the extraction code: the
    fleet table and the code of this module, of name resolution and of the reach indexes (a
    change re-derives, without re-parsing)."""
    h = hashlib.sha256()
    for path in (
        fleet.path,
        Path(__file__),
        Path(_reach_module.__file__),
        Path(_resolve_module.__file__),
        Path(_lazy_reach_module.__file__),
        Path(_spelled_names_module.__file__),
        Path(_facts_module.__file__),
        Path(_loaders_module.__file__),
        Path(_path_literals_module.__file__),
    ):
        try:
            h.update(Path(path).read_bytes())
        except OSError:
            h.update(str(path).encode())
    return h.hexdigest()


def _derive(fleet: Fleet, key: str, arg: tuple, facts: FileFacts) -> tuple:
    """``(kept, extra)`` of one file (``arg``: (package or None, is_test)): ``kept`` is a test
    file's encoded registration (None otherwise), kept in the cache; ``extra`` is a graph node's
    :data:`~mizzen_ci.imports.reach.Entry`, for this run's reach index only (None otherwise)."""
    package, is_test = arg
    kept = extra = None
    if is_test:
        row, violations = validate_row(facts.registration, key, fleet)
        kept = (row, tuple([(v.line, v.rule, v.message, v.fix) for v in violations]))
    if package is not None:
        extra = _entry(key, facts, package)
    return kept, extra


# The field types of a registration row (``Registration(*row)``), in order.
_ROW_TYPES = (
    str, int, str, (int, float), tuple, bool, (str, type(None)), tuple, int, tuple, tuple, bool
)  # fmt: skip


def _is(value: object, kind: type | tuple[type, ...]) -> bool:
    if kind is bool:
        return type(value) is bool
    return isinstance(value, kind) and type(value) is not bool


def _is_registration_row(row: object) -> bool:
    return (
        type(row) is tuple
        and len(row) == len(_ROW_TYPES)
        and all(_is(v, t) for v, t in zip(row, _ROW_TYPES, strict=True))
        and row[2] in {b.value for b in Backend}
        and all(type(x) is str for field in (row[4], row[7], row[9], row[10]) for x in field)
    )


def valid_kept(arg: object, kept: object) -> bool:
    """Whether a kept value read back from the cache has the shape :func:`_derive` (or
    :func:`_scan`) gives for ``arg``: a test file's (registration row or None, violations), a
    scanned module's (words, path literals), or None."""
    if not (isinstance(arg, tuple) and len(arg) == 2):
        return False
    _package, is_test = arg
    if not is_test:
        return kept is None or (
            type(kept) is tuple
            and len(kept) == 2
            and all(type(part) is tuple and all(type(w) is str for w in part) for part in kept)
        )
    if not (type(kept) is tuple and len(kept) == 2 and type(kept[1]) is tuple):
        return False
    row, violations = kept
    if row is not None and not _is_registration_row(row):
        return False
    return all(
        type(v) is tuple
        and len(v) == 4
        and type(v[0]) is int
        and all(type(x) is str for x in v[1:])
        for v in violations
    )


def _scan(key: str, arg: tuple, source: bytes) -> tuple | None:
    """A graph file that is not a test file: ``(its words, its path literals)`` when its bytes
    allow (not parsed)."""
    package, is_test = arg
    if is_test or package is None:
        return None
    words = spelled_words(source)
    if words is None:
        return None
    literals = path_literals(source)
    if literals is None:
        return None
    return words, literals


def _entry(key: str, facts: FileFacts | None, package: str) -> Entry:
    if facts is None:  # not read in this run (gone): nothing to index
        return (), (), (), (), (), ""
    return node_entry(
        key, facts.imports, package, facts.paths, facts.dynamic, facts.syspath, facts.opaque
    )


def build_index(
    root: Path | str,
    fleet: Fleet,
    cache_path: Path | None = None,
    workers: int | None = None,
    with_reach: bool = True,
    save: bool = True,
) -> PlanIndex:
    """The index of ``root`` (see the module docstring).  ``with_reach=False`` (a run that
    selects everything) reads only the registry's test files and leaves ``reach`` empty.
    ``save=False``: the caller calls ``index.save()`` (after its queries)."""
    # Tens of thousands of small tuples and no reference cycles: the cyclic GC would only
    # rescan them (a tenth of a warm run); it is back on when the index is built.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        index = _build_index(Path(root).resolve(), fleet, cache_path, workers, with_reach)
        if save:
            index.save()
        return index
    finally:
        if gc_was_enabled:
            gc.enable()


def _build_index(
    root: Path, fleet: Fleet, cache_path: Path | None, workers: int | None, with_reach: bool
) -> PlanIndex:
    excludes = registry_excludes(root)
    prefix = str(root) + os.sep
    cache = FactsCache(cache_path, context=cache_context(fleet), valid_kept=valid_kept)
    derive = functools.partial(_derive, fleet)

    # One item per file: (path, key, (package or None, is_test)); key: module name or rel path.
    # Without the graph (a run that selects everything) only the test files are read, with the
    # graph's own `arg`, so that a run with and a run without the graph reuse each other's answers.
    found = discover(root, excludes)
    tree = found.tree
    items: list[tuple[str, str, tuple]] = []
    paths: dict[str, str] = {}  # graph node -> path to read it from
    modules: dict[str, str] = {}
    dirs: list[Path] = []
    if with_reach:
        dirs = workspace_source_dirs(root)
        found_modules, _ = source_modules(root, dirs)  # duplicates: the graph reports them
        for name, path, rel in found_modules:
            modules[name] = rel
            paths[name] = path
            items.append((path, name, (package_of(name, rel.endswith("__init__.py")), False)))
        tests = set(tree.tests)
        for rel in tree.all:
            paths[rel] = prefix + rel
            items.append((prefix + rel, rel, ("", rel in tests)))
    else:
        tests = [rel for rel in found.test_files if rel.startswith(TESTS_DIR + "/")]
        items = [(prefix + rel, rel, ("", True)) for rel in tests]
        tree = TestTree()
    results = cache.derive_iter(items, derive, workers, _scan)

    loaded = LazyReach.from_data(cache.section(_REACH_SECTION)) if with_reach else None
    fresh = LazyReach(ReachIndex(), PendingNodes()) if with_reach and loaded is None else None
    answers: dict[str, tuple] = {}
    # graph node -> (package, its Entry or None, its words if it was not parsed or None)
    nodes: dict[str, tuple] = {}
    # Each value is used as soon as it is ready: on a cold run this overlaps the parse workers.
    for i, (kept, extra) in results:
        _, key, (package, is_test) = items[i]
        if is_test:
            row, violations = kept
            answers[key] = (Registration(*row) if row is not None else None, violations)
            kept = None
        if package is not None:
            nodes[key] = (package, extra, kept)
            if fresh is not None:
                if extra is not None:
                    fresh.index.add(key, extra)
                elif kept is not None:
                    fresh.pending.add(key, *kept)

    registry = Registry(root, violations=list(found.violations))  # the walk's, first
    for rel in found.test_files:
        if not rel.startswith(TESTS_DIR + "/"):
            registry.violations.append(outside_tests(rel))
            continue
        registration, violations = answers[rel]
        if registration is not None:
            registry.registrations.append(registration)
        if violations:
            registry.violations.extend(Violation(rel, *v) for v in violations)

    reach, modified = LazyReach(ReachIndex(), PendingNodes()), False
    if with_reach:
        reach, modified = _update_reach(cache, nodes, loaded, fresh)
        reach.resolve = functools.partial(_resolve, cache, paths, modules, workers)
    source_dirs = relative_dirs(dirs, root)
    return PlanIndex(
        root,
        registry,
        tree,
        source_dirs,
        modules,
        reach,
        tuple(excludes),
        cache,
        with_reach,
        modified,
        entry_point_modules(root) if with_reach else {},
        entry_point_table(root) if with_reach else [],
    )


def _resolve(
    cache: FactsCache,
    paths: dict[str, str],
    modules: dict[str, str],
    workers: int | None,
    nodes: list[str],
) -> dict[str, tuple]:
    """``{node: entry}`` of pending graph nodes, parsed through the cache (in workers when there
    are many)."""
    found = cache.facts_for_many([(paths[n], n) for n in nodes], workers)
    out = {}
    for node, facts in zip(nodes, found, strict=True):
        rel = modules.get(node)
        package = package_of(node, rel.endswith("__init__.py")) if rel is not None else ""
        out[node] = _entry(node, facts, package)
    return out


def _update_reach(
    cache: FactsCache, nodes: dict[str, tuple], loaded: LazyReach | None, fresh: LazyReach | None
) -> tuple[LazyReach, bool]:
    """``(reach, modified)``: the ``loaded`` one with the changed files swapped (their old names
    come from the facts of their old content, or they were pending), or ``fresh`` (built from
    what this run derived) completed with the files whose derived value was reused."""
    if loaded is not None:
        index, pending = loaded.index, loaded.pending
        previous = cache.previous_derived()
        changed = cache.recomputed | (previous.keys() - nodes.keys())
        for key in sorted(changed):
            old = previous.get(key)
            if key in pending.nodes:
                pending.remove(key)
            elif old is None:  # new, or unreadable last run (nothing kept: no names indexed)
                index.forget(key)
            elif old[1][0] is not None:
                facts = cache.facts_of(old[0])
                if facts is None:  # the old names are unknown: build afresh
                    break
                index.remove(key, _entry(key, facts, old[1][0]))
            if key in nodes:
                package, extra, spelled = nodes[key]
                if spelled is not None:
                    pending.add(key, *spelled)
                else:
                    sha = cache.sha_of(key)
                    index.add(key, extra or _entry(key, cache.facts_of(sha), package))
        else:
            return loaded, bool(changed)
        fresh = LazyReach(ReachIndex(), PendingNodes())
        for key, (_, extra, spelled) in nodes.items():
            if extra is not None:
                fresh.index.add(key, extra)
            elif spelled is not None:
                fresh.pending.add(key, *spelled)
    for key, (package, extra, spelled) in nodes.items():
        if extra is None and spelled is None:
            sha = cache.sha_of(key)
            fresh.index.add(key, _entry(key, cache.facts_of(sha) if sha else None, package))
    return fresh, True
