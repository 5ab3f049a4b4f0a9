"""Who reaches what: the inverted direct relations of a tree, for reverse searches.

A node (a module, or a file under ``tests/`` named by its path) *names* some dotted names
directly: :func:`mizzen_ci.imports.resolve.direct_names` (every import's target, in all scopes, and
``X.n`` for ``from X import n``).  Importing a name runs its parent packages first, but only those
that are modules of the tree.  So node N reaches X in one step when X is one of N's names, or when
X is a module of the tree and a strict dotted prefix of one of N's names (``parents_of``).  Two
more relations, not imports, are kept beside them:

- *paths*: the node's path literals (:mod:`mizzen_ci.imports.path_literals`); it names a file P
  when one of them does (:func:`~mizzen_ci.imports.path_literals.lookup_keys`);
- *wild*: the top-level packages a node imports from by computed names (``ModuleFacts.dynamic``:
  fail open): a module's own top-level package; for a file under ``tests/`` every top-level name
  it names, and :data:`ANY` (every workspace package, when none of its names is one).  Such a node
  reaches every name of those packages in one step.

:class:`ReachIndex` keeps them inverted::

    named[X]  nodes that name X
    under[X]  nodes that name something strictly below X (X.…)
    paths[L]  nodes with path literal L
    wild[N]   the fail-open packages of node N (one small table: such nodes are few)

``importers(X, modules)`` is ``named[X]`` plus, when X is a module, ``under[X]``, plus the wild
nodes of X's top-level package: the nodes whose :class:`~mizzen_ci.imports.graph.ImportGraph`
edges (with the parents they run) reach X, or that may import it by a computed name; found
without resolving any file at query time.  ``namers(P)``: the nodes whose literals name path P.
:func:`reach_of_graph` is the index of a built graph; the planner keeps one warm, parsing on
demand (:mod:`mizzen_ci.plan.index.lazy_reach`).

Invariants:
- The index does not depend on which names are modules (applied at query time), so a node's part
  changes only when its own bytes change: ``add``/``remove`` keep it exact incrementally, equal as
  sets to ``build`` over the same entries.
- A node appears at most once per list; list order is insertion order (callers use the members).
- Plain data (``to_data`` / ``from_data``), so that a cache can keep it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .graph import ImportGraph
from .path_literals import lookup_keys
from .resolve import direct_names, package_of

ANY = "*"  # in a node's wild packages: every workspace package, when it names none of them

# What a node contributes to the index: (names, parents_of(names), path literals, wild packages,
# sys.path folders it adds, what it loads that cannot be resolved ("LINE: what" or "")).
Entry = tuple[
    tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...], str
]


def parents_of(names: Iterable[str]) -> tuple[str, ...]:
    """The strict dotted prefixes of ``names`` (``a.b`` and ``a`` for ``a.b.c``), each once."""
    out: dict[str, None] = {}
    for n in names:
        i = n.rfind(".")
        while i != -1:
            n = n[:i]
            if n in out:
                break  # its own prefixes are in already
            out[n] = None
            i = n.rfind(".")
    return tuple(out)


def node_entry(
    node: str,
    imports: Iterable[tuple],
    package: str,
    paths: Iterable[str],
    dynamic: int,
    syspath: Iterable[str] = (),
    opaque: str = "",
) -> Entry:
    """The :data:`Entry` of ``node`` (a module name, or a path for a file under ``tests/``) from
    its facts: imports, the package its relative imports start from, path literals, whether it
    imports by a computed name (``dynamic``: a line, 0 for none), the ``sys.path`` folders it
    adds and what it loads that cannot be resolved (:mod:`mizzen_ci.imports.loaders`)."""
    names = direct_names(imports, package)
    wild: tuple[str, ...] = ()
    if dynamic:
        if "/" in node:  # a file under tests/: the packages it names (ANY if none is ours)
            wild = (*dict.fromkeys(n.partition(".")[0] for n in names), ANY)
        else:
            wild = (node.partition(".")[0],)
    return names, parents_of(names), tuple(paths), wild, tuple(syspath), opaque


class ReachIndex:
    """The inverted one-step relations; see the module docstring."""

    __slots__ = ("_wild_by_top", "named", "opaque", "paths", "syspath", "under", "wild")

    def __init__(
        self,
        named: dict[str, list[str]] | None = None,
        under: dict[str, list[str]] | None = None,
        paths: dict[str, list[str]] | None = None,
        wild: dict[str, tuple[str, ...]] | None = None,
        syspath: dict[str, tuple[str, ...]] | None = None,
        opaque: dict[str, str] | None = None,
    ):
        self.named: dict[str, list[str]] = named if named is not None else {}
        self.under: dict[str, list[str]] = under if under is not None else {}
        self.paths: dict[str, list[str]] = paths if paths is not None else {}
        self.wild: dict[str, tuple[str, ...]] = wild if wild is not None else {}
        # the few nodes that add sys.path folders / load what cannot be resolved
        self.syspath: dict[str, tuple[str, ...]] = syspath if syspath is not None else {}
        self.opaque: dict[str, str] = opaque if opaque is not None else {}
        self._wild_by_top: tuple[object, dict[str, list[str]]] | None = None

    @classmethod
    def build(cls, nodes: Mapping[str, Entry]) -> ReachIndex:
        """The index of ``{node: entry}``."""
        index = cls()
        for node, entry in nodes.items():
            index.add(node, entry)
        return index

    def add(self, node: str, entry: Entry) -> None:
        """Record ``node``'s ``entry`` ``(names, parents, paths, wild)``: it names ``names``
        (distinct) whose strict prefixes are ``parents``, has the path literals ``paths`` and the
        fail-open packages ``wild``."""
        names, parents, paths, wild, syspath, opaque = entry
        list_under(self.named, node, names)
        list_under(self.under, node, parents)
        if paths:
            list_under(self.paths, node, paths)
        if wild:
            self.wild[node] = wild
            self._wild_by_top = None
        if syspath:
            self.syspath[node] = syspath
        if opaque:
            self.opaque[node] = opaque

    def remove(self, node: str, entry: Entry) -> None:
        """Undo :meth:`add` of the same ``node`` and ``entry``."""
        names, parents, paths, wild, syspath, opaque = entry
        if syspath:
            self.syspath.pop(node, None)
        if opaque:
            self.opaque.pop(node, None)
        for table, keys in ((self.named, names), (self.under, parents), (self.paths, paths)):
            for k in keys:
                nodes = table.get(k)
                if nodes is not None and node in nodes:
                    nodes.remove(node)
                    if not nodes:
                        del table[k]
        if wild and self.wild.pop(node, None) is not None:
            self._wild_by_top = None

    def forget(self, node: str) -> None:
        """Drop what the per-node tables hold of ``node`` (``wild``, ``syspath``, ``opaque``):
        the whole entry of a node that names nothing (a file that could not be read)."""
        if self.wild.pop(node, None) is not None:
            self._wild_by_top = None
        self.syspath.pop(node, None)
        self.opaque.pop(node, None)

    def naming(self, name: str, below: bool) -> list[str]:
        """The nodes that name ``name`` (and, with ``below``, a name below it); a node may be
        listed twice."""
        found = self.named.get(name, [])
        if below:
            more = self.under.get(name)
            if more:
                return found + more
        return found

    def importers(self, name: str, modules: Mapping[str, object]) -> list[str]:
        """The nodes that reach ``name`` in one step (a node may be listed twice)."""
        found = self.naming(name, name in modules)
        if self.wild:
            wild = self._wild_for(name.partition(".")[0], modules)
            if wild:
                return found + wild
        return found

    def _wild_for(self, top: str, modules: Mapping[str, object]) -> list[str]:
        cached = self._wild_by_top
        if cached is None or cached[0] is not modules:
            cached = self._wild_by_top = (modules, {})
        by_top = cached[1]
        found = by_top.get(top)
        if found is None:
            found = by_top[top] = [
                node
                for node, packages in self.wild.items()
                if top in packages
                or (ANY in packages and not any(p in modules for p in packages if p != ANY))
            ]
        return found

    def namers(self, path: str, bare: bool = True) -> list[str]:
        """The nodes whose path literals name ``path`` (a node may be listed twice);
        ``bare=False``: by a literal holding a ``/`` (not by the file name alone)."""
        out: list[str] = []
        for key in lookup_keys(path, bare):
            found = self.paths.get(key)
            if found:
                out += found
        return out

    def to_data(self) -> tuple:
        return self.named, self.under, self.paths, self.wild, self.syspath, self.opaque

    @classmethod
    def from_data(cls, data: object) -> ReachIndex | None:
        """The index from :meth:`to_data`, or None when ``data`` is not one."""
        if not (
            isinstance(data, tuple) and len(data) == 6 and all(isinstance(t, dict) for t in data)
        ):
            return None
        return cls(*data)

    def same_as(self, other: ReachIndex) -> bool:
        """Equal as relations (list order aside)."""

        def norm(table):
            return {k: sorted(v) for k, v in table.items() if v}

        return (
            all(
                norm(getattr(self, t)) == norm(getattr(other, t))
                for t in ("named", "under", "paths")
            )
            and self.wild == other.wild
            and self.syspath == other.syspath
            and self.opaque == other.opaque
        )


def reach_of_graph(graph: ImportGraph) -> ReachIndex:
    """The :class:`ReachIndex` of a built graph (every node, all scopes)."""
    nodes = {}
    for node, facts in graph.facts.items():
        rel = graph.modules.get(node)
        package = package_of(node, rel.endswith("__init__.py")) if rel is not None else ""
        nodes[node] = node_entry(
            node, facts.imports, package, facts.paths, facts.dynamic, facts.syspath, facts.opaque
        )
    return ReachIndex.build(nodes)


def list_under(table: dict[str, list[str]], node: str, keys: Iterable[str]) -> None:
    """Append ``node`` to the list of each of ``keys`` in ``table`` (an inverted index)."""
    for k in keys:
        found = table.get(k)
        if found is None:
            table[k] = [node]
        else:
            found.append(node)
