"""The import graph of Python source trees, built from each file's import facts.

This is the one import-graph builder of the repository: the lazy-import check
(:mod:`mizzen_ci.lazy_imports.static`) and the planner's impact analysis both build on it.

**ImportGraph.build(root, source_dirs, extra_files=(), cache=None, workers=None)**

- ``source_dirs``: directories that are ``sys.path`` entries (``packages/train/src``); every
  package and module below them (:func:`mizzen_ci.imports.workspace.source_modules`) is a node
  named by its dotted module name.
- ``extra_files``: files that are not importable modules (test files); each is a node named by its
  root-relative POSIX path (it contains ``/``, so it never collides with a module name).
- Paths are root-relative POSIX strings (absolute when outside ``root``).
- ``cache``: where the facts come from — anything with ``facts_for_many([(path, key)], workers)``
  returning objects with ``module_facts()`` (the planner's content-hash cache,
  :class:`mizzen_ci.plan.index.facts_cache.FactsCache`, which parses in ``workers`` processes);
  without one each file is read and parsed here.

Attributes and queries (``scope``: "module" follows only module-scope edges, i.e. what importing
runs; "all" follows lazy edges too, i.e. what calling anything might run):

- ``graph.modules``: ``{module name: file}``; ``graph.files``: ``{node: file}`` (modules + extras)
- ``graph.facts[node]``: its ModuleFacts; ``graph.problems``: ``[GraphProblem(file, line, msg)]``
  (syntax errors, relative imports beyond the top-level package, duplicate modules)
- ``graph.edges(node)``: resolved ``ImportEdge(target, line, lazy, guarded, kind, scope, names)``
  in source order.  Resolution: relative imports become absolute; ``from pkg import name`` gives
  an edge to ``pkg`` (kind "from") and, when ``pkg.name`` is a module of the graph, one to it
  (kind "submodule").  Targets outside the graph are kept as written (external modules).
  An extra file's absolute import also resolves, as at run time (a script runs with its own
  directory on ``sys.path``; pytest's ``--import-mode=importlib`` adds none), to its *siblings*
  (:func:`mizzen_ci.imports.resolve.sibling_files`): ``import X`` / ``from X import n`` in
  ``d/f.py`` gives an edge (kind "sibling") to the extra file ``d/X.py`` or ``d/X/__init__.py``
  (and to ``d/X/n.py``, ``d/X/n/__init__.py``), besides the edge to ``X``.
- ``graph.successors(node, scope)``: ``tuple[Hop, ...]``.  Importing ``a.b.c`` runs ``a`` and
  ``a.b`` first: each edge to a module of the graph yields hops to its parent packages that are in
  the graph (``hop.parent_of`` names the imported module), then to the module itself.  A node's
  own parent packages are not its successors (ask for them with :meth:`ImportGraph.with_parents`).
  PEP 562 re-exports: a module-scope ``from P import n`` where ``P`` has a ``__getattr__`` that
  imports, and ``P``'s module scope does not bind ``n``, runs that ``__getattr__``: in scope
  "module" it also yields a hop to the virtual node ``"P:__getattr__"`` (``GETATTR_SUFFIX``), whose
  successors are the imports inside ``P.__getattr__``.  Virtual nodes are walked by every query
  but never returned by ``closure``/``importers`` nor offered to predicates.
- ``graph.closure(starts, scope)``: every name reached (graph modules and external targets).
- ``graph.importers(targets, scope)``: every node that reaches one of ``targets`` (reverse
  closure, one pass; what a planner asks for changed modules).
- ``graph.chains_to(predicate, scope)``: ``{node: shortest list[Hop]}`` for every node that
  reaches a name satisfying ``predicate``, in one reverse pass (what a check over all modules
  wants).
- ``graph.chain(starts, predicate, scope)``: the shortest ``list[Hop]`` from ``starts`` to a
  name for which ``predicate(name)`` holds, or None.  The predicate sees every name reached
  (not the starts); for ``from X import n`` with ``X`` outside the graph it sees ``X`` and
  ``X.n`` (``n`` may be a submodule), and the last hop names the one that matched.  Cycles are
  fine (visited set).  ``str(hop)`` is ``file:line imports target (module scope)`` style.

Invariants: stdlib only; building never raises for bad source (problems are recorded); results are
deterministic (sorted discovery, source-order edges, breadth-first chains).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from ..sources import read_bytes
from .facts import ModuleFacts, RawImport, parse_facts, unreadable_facts
from .resolve import package_of, relative_base, sibling_files
from .workspace import GraphProblem, root_relative, source_modules


class FactsSource(Protocol):
    """Where a graph's facts come from when not parsed by the graph itself (a cache)."""

    def facts_for_many(self, items: Sequence[tuple[str, str]], workers: int | None = None) -> list:
        """One object with ``module_facts()`` per ``(path, key)``, in order."""
        ...


def read_facts(path: str) -> ModuleFacts:
    """The facts of one file read and parsed here (an unreadable file is a fact, not an error)."""
    try:
        source, _ = read_bytes(path)
    except OSError as e:  # over the size cap, a link, gone: opaque, never a file without edges
        return unreadable_facts(e)
    return parse_facts(source, path)


GETATTR_SUFFIX = ":__getattr__"  # virtual node: a module's PEP 562 __getattr__ run by an importer


class ImportEdge(NamedTuple):
    """One resolved import of a node: an absolute target module name."""

    target: str
    line: int
    lazy: bool
    guarded: bool
    kind: str  # "import" | "from" | "submodule" | "sibling" | "importlib" | "__import__" | …
    scope: str
    names: tuple[str, ...] = ()  # for kind "from": the imported names


_WHERE = {
    "module": "module scope",
    "function": "lazy: inside a function",
    "type-checking": "lazy: under TYPE_CHECKING",
    "getattr": "lazy: inside module __getattr__",
    "subprocess": "lazy: run in a subprocess",
}
_KIND_NOTES = {
    "importlib": "importlib.import_module",
    "__import__": "__import__",
    "importorskip": "pytest.importorskip",
    "run": "run as `python -m` / runpy.run_module",
    "sibling": "a file beside the importer, found on sys.path",
}


class Hop(NamedTuple):
    """One step of a chain: ``source`` (a node, in ``file``) imports ``target`` at ``line``."""

    source: str
    file: str
    line: int
    target: str
    edge: ImportEdge
    parent_of: str | None = None  # set when target is a parent package run first

    def describe(self) -> str:
        e = self.edge
        notes = [_WHERE[e.scope]]
        if e.guarded:
            notes.append("guarded by try/except ImportError")
        if e.kind in _KIND_NOTES:
            notes.append(_KIND_NOTES[e.kind])
        if self.parent_of is not None:
            notes.append(f"parent package of {self.parent_of}, its __init__ runs first")
        if self.target.endswith(GETATTR_SUFFIX):
            module = self.target[: -len(GETATTR_SUFFIX)]
            names = ", ".join(e.names)
            return (
                f"{self.file}:{self.line} imports {names} from {module} ({', '.join(notes)}; "
                f"a name {module} does not bind, so its module __getattr__ runs)"
            )
        if self.source.endswith(GETATTR_SUFFIX):
            notes[0] = "inside module __getattr__, run by the import above"
        return f"{self.file}:{self.line} imports {self.target} ({', '.join(notes)})"

    __str__ = describe


class ImportGraph:
    """Modules (and extra files) of a tree with their resolved imports; see the module docstring."""

    def __init__(
        self,
        root: Path,
        modules: dict[str, str],
        files: dict[str, str],
        facts: dict[str, ModuleFacts],
        problems: list[GraphProblem],
    ):
        self.root = root
        self.modules = modules
        self.files = files
        self.facts = facts
        self.problems = problems
        self._edges: dict[tuple[str, bool], tuple[ImportEdge, ...]] = {}
        self._succ: dict[tuple[str, str], tuple[Hop, ...]] = {}
        self._pred: dict[str, dict[str, list[Hop]]] = {}
        self._parents: dict[str, tuple[str, ...]] = {}
        for node, f in facts.items():  # relative imports that reach outside their package
            for imp in f.imports:
                if imp.level and self._relative_base(node, imp.level) is None:
                    package = self._package_of(node)
                    where = f"beyond package {package}" if package else "outside any package"
                    problems.append(
                        GraphProblem(
                            files[node],
                            imp.line,
                            f"relative import {_spelled(imp)} reaches {where}",
                        )
                    )

    # ---- building

    @classmethod
    def build(
        cls,
        root: Path | str,
        source_dirs: Iterable[Path | str],
        extra_files: Iterable[Path | str] = (),
        cache: FactsSource | None = None,
        workers: int | None = None,
    ) -> ImportGraph:
        root = Path(root).resolve()
        found_modules, problems = source_modules(root, source_dirs)
        modules = {name: rel for name, _, rel in found_modules}
        files = dict(modules)
        wanted = list(found_modules)  # (node, path, root-relative path)
        for p in extra_files:
            path, rel = root_relative(p, root)
            files[rel] = rel
            wanted.append((rel, path, rel))
        if cache is None:
            found = [read_facts(path) for _, path, _ in wanted]
        else:
            items = [(path, rel) for _, path, rel in wanted]
            found = [f.module_facts() for f in cache.facts_for_many(items, workers)]
        facts: dict[str, ModuleFacts] = dict(zip((w[0] for w in wanted), found, strict=True))
        for node, f in facts.items():
            if f.error is not None:
                problems.append(GraphProblem(files[node], f.error_line, f"cannot parse: {f.error}"))
        return cls(root, modules, files, facts, problems)

    def _package_of(self, node: str) -> str:
        """The package a module's relative imports start from ("" for extra files)."""
        rel = self.modules.get(node)
        if rel is None:
            return ""
        return package_of(node, rel.endswith("__init__.py"))

    def _relative_base(self, node: str, level: int) -> str | None:
        return relative_base(self._package_of(node), level)

    def _resolve(self, node: str, module_scope_only: bool) -> tuple[ImportEdge, ...]:
        modules = self.modules
        out: list[ImportEdge] = []
        extra = node not in modules  # a script or test file: its siblings are importable
        for module, level, names, line, scope, guarded, kind in self.facts[node].imports:
            lazy = scope != "module"
            if lazy and module_scope_only:
                continue
            if level:
                base = self._relative_base(node, level)
                if base is None:
                    continue  # recorded in problems when the graph was built
                target = f"{base}.{module}" if module else base
            else:
                target = module
            if kind == "from":
                out.append(ImportEdge(target, line, lazy, guarded, "from", scope, names))
                for n in names:
                    sub = f"{target}.{n}"
                    if sub in modules:
                        out.append(ImportEdge(sub, line, lazy, guarded, "submodule", scope))
            else:
                out.append(ImportEdge(target, line, lazy, guarded, kind, scope))
            if extra and not level:
                for sibling in sibling_files(node, target, names, self.files):
                    out.append(ImportEdge(sibling, line, lazy, guarded, "sibling", scope))
        return tuple(out)

    # ---- queries

    def edges(self, node: str) -> tuple[ImportEdge, ...]:
        return self._scoped_edges(node, "all")

    def _scoped_edges(self, node: str, scope: str) -> tuple[ImportEdge, ...]:
        key = (node, scope == "module")
        found = self._edges.get(key)
        if found is None:
            if node not in self.facts:
                return ()
            found = self._edges[key] = self._resolve(node, key[1])
        return found

    def with_parents(self, module: str) -> list[str]:
        """``module`` preceded by its parent packages that are in the graph (what importing runs)."""
        parts = module.split(".")
        out = [".".join(parts[:i]) for i in range(1, len(parts))]
        return [p for p in out if p in self.modules] + [module]

    def _parents_of(self, name: str) -> tuple[str, ...]:
        """The parent packages of ``name`` that are modules of the graph, outermost first."""
        found = self._parents.get(name)
        if found is None:
            parts = name.split(".")
            cands = (".".join(parts[:i]) for i in range(1, len(parts)))
            found = self._parents[name] = tuple(p for p in cands if p in self.modules)
        return found

    def successors(self, node: str, scope: str = "module") -> tuple[Hop, ...]:
        key = (node, scope)
        hops = self._succ.get(key)
        if hops is not None:
            return hops
        if scope not in ("module", "all"):
            raise ValueError(f"scope must be 'module' or 'all', not {scope!r}")
        if node.endswith(GETATTR_SUFFIX):  # a module's PEP 562 __getattr__, entered by name
            return self._getattr_successors(node)
        file = self.files.get(node, node)
        parents_of = self._parents_of
        facts = self.facts
        out: list[Hop] = []
        for e in self._scoped_edges(node, scope):
            t = e.target
            if "." in t and "/" not in t:  # (a sibling file's parents are files of their own)
                for p in parents_of(t):
                    out.append(Hop(node, file, e.line, p, e, t))
            out.append(Hop(node, file, e.line, t, e))
            if e.kind == "from" and scope == "module" and t in facts:
                bound = facts[t].bound
                if bound is not None and any(n not in bound for n in e.names):
                    out.append(Hop(node, file, e.line, t + GETATTR_SUFFIX, e))
        hops = tuple(out)
        self._succ[key] = hops
        return hops

    def _getattr_successors(self, node: str) -> tuple[Hop, ...]:
        module = node[: -len(GETATTR_SUFFIX)]
        file = self.files[module]
        out: list[Hop] = []
        for e in self._scoped_edges(module, "all"):
            if e.scope != "getattr":
                continue
            for p in self._parents_of(e.target) if "." in e.target else ():
                out.append(Hop(node, file, e.line, p, e, e.target))
            out.append(Hop(node, file, e.line, e.target, e))
        hops = tuple(out)
        self._succ[node, "module"] = self._succ[node, "all"] = hops
        return hops

    def closure(self, starts: str | Iterable[str], scope: str = "module") -> set[str]:
        """Every name reachable from ``starts`` (graph nodes and external targets)."""
        todo = [starts] if isinstance(starts, str) else list(starts)
        seen: set[str] = set()
        while todo:
            n = todo.pop()
            for h in self.successors(n, scope):
                if h.target not in seen:
                    seen.add(h.target)
                    if h.target in self.files or h.target.endswith(GETATTR_SUFFIX):
                        todo.append(h.target)
        return {n for n in seen if not n.endswith(GETATTR_SUFFIX)}

    def _predecessors(self, scope: str) -> dict[str, list[Hop]]:
        """{target: hops leading to it} over every node (built once per scope)."""
        pred = self._pred.get(scope)
        if pred is None:
            pred = {}
            todo = list(self.files)
            seen_virtual: set[str] = set()
            while todo:
                n = todo.pop()
                for h in self.successors(n, scope):
                    pred.setdefault(h.target, []).append(h)
                    t = h.target
                    if t.endswith(GETATTR_SUFFIX) and t not in seen_virtual:
                        seen_virtual.add(t)
                        todo.append(t)
            for hops in pred.values():  # source order, whatever order the walk took
                hops.sort(key=lambda h: (h.source, h.line))
            self._pred[scope] = pred
        return pred

    def importers(self, targets: str | Iterable[str], scope: str = "module") -> set[str]:
        """Every node whose closure holds one of ``targets`` (one reverse breadth-first pass)."""
        pred = self._predecessors(scope)
        todo = [targets] if isinstance(targets, str) else list(targets)
        seen: set[str] = set()
        while todo:
            t = todo.pop()
            for h in pred.get(t, ()):
                if h.source not in seen:
                    seen.add(h.source)
                    todo.append(h.source)
        return {n for n in seen if not n.endswith(GETATTR_SUFFIX)}

    def chains_to(
        self, predicate: Callable[[str], bool], scope: str = "module"
    ) -> dict[str, list[Hop]]:
        """{node: its shortest chain to a name satisfying ``predicate``} for every node that has
        one, in one multi-source reverse breadth-first pass (O(edges), not O(nodes x edges)).
        Each chain is as short as :meth:`chain` finds; among equally short ones the choice may
        differ."""
        pred = self._predecessors(scope)
        modules = self.modules
        memo: dict[str, bool] = {}

        def predicate_(name: str, _p=predicate) -> bool:
            v = memo.get(name)
            if v is None:
                v = memo[name] = bool(_p(name))
            return v

        # Phase 1, per distinct target (not per hop): each node's first matching hop in source
        # order, as chain() would take it.
        first: dict[str, tuple[tuple, Hop]] = {}
        for target, hops in pred.items():
            if target.endswith(GETATTR_SUFFIX):
                continue
            if predicate_(target):
                for h in hops:
                    _keep_first(first, h, h)
            elif target not in modules:
                for h in hops:
                    e = h.edge
                    if e.kind == "from" and h.parent_of is None:
                        for n in e.names:
                            if n != "*" and predicate_(f"{target}.{n}"):
                                _keep_first(first, h, h._replace(target=f"{target}.{n}"))
                                break
        nxt: dict[str, Hop] = {n: hit for n, (_, hit) in first.items()}
        terminal = set(nxt)
        frontier = sorted(nxt)
        while frontier:
            following: list[str] = []
            for t in frontier:
                for h in pred.get(t, ()):
                    if h.source not in nxt:
                        nxt[h.source] = h
                        following.append(h.source)
            frontier = following
        out: dict[str, list[Hop]] = {}
        for n in nxt:
            chain, cur = [], n
            while True:
                h = nxt[cur]
                chain.append(h)
                if cur in terminal:
                    break
                cur = h.target
            out[n] = chain
        return out

    def chain(
        self,
        starts: str | Sequence[str],
        predicate: Callable[[str], bool],
        scope: str = "module",
    ) -> list[Hop] | None:
        """The shortest chain of hops from ``starts`` to a name satisfying ``predicate``."""
        starts = [starts] if isinstance(starts, str) else list(starts)
        files = self.files
        back: dict[str, Hop | None] = {s: None for s in starts}
        queue = deque(starts)
        while queue:
            n = queue.popleft()
            for h in self.successors(n, scope):
                hit = self._match(h, predicate)
                if hit is not None:
                    out = [hit]
                    prev = back[n]
                    while prev is not None:
                        out.append(prev)
                        prev = back[prev.source]
                    out.reverse()
                    return out
                t = h.target
                if t not in back:
                    back[t] = h
                    if t in files or t.endswith(GETATTR_SUFFIX):
                        queue.append(t)
        return None

    def _match(self, h: Hop, predicate: Callable[[str], bool]) -> Hop | None:
        if h.target.endswith(GETATTR_SUFFIX):
            return None
        if predicate(h.target):
            return h
        e = h.edge
        if e.kind == "from" and h.parent_of is None and h.target not in self.modules:
            for n in e.names:
                if n != "*" and predicate(f"{h.target}.{n}"):
                    return h._replace(target=f"{h.target}.{n}")
        return None


def _keep_first(first: dict[str, tuple[tuple, Hop]], hop: Hop, hit: Hop) -> None:
    """Keep, per source node, the matching hop that comes first in its successor order (by line;
    on one line parent packages first, outermost first)."""
    order = (hop.edge.line, 0 if hop.parent_of else 1, hop.target.count("."), hop.target)
    old = first.get(hop.source)
    if old is None or order < old[0]:
        first[hop.source] = (order, hit)


def _spelled(imp: RawImport) -> str:
    rel = "." * imp.level + imp.module
    if imp.kind == "from":
        return f"`from {rel} import {', '.join(imp.names)}`"
    return f"`import_module({rel!r}, __package__)`"
