"""Who reaches what: the inverted direct-import relation of a tree, for reverse searches.

A node (a module, or a file under ``tests/`` named by its path) *names* some dotted names
directly: :func:`mizzen_ci.imports.resolve.direct_names` (every import's target, in all scopes, and
``X.n`` for ``from X import n``).  Importing a name runs its parent packages first, but only those
that are modules of the tree.  So node N reaches X in one step when X is one of N's names, or when
X is a module of the tree and a strict dotted prefix of one of N's names (``parents_of``).

:class:`ReachIndex` keeps both relations inverted::

    named[X]  nodes that name X
    under[X]  nodes that name something strictly below X (X.…)

and ``importers(X, modules)`` is ``named[X]`` plus, when X is a module, ``under[X]``: the nodes
whose :class:`~mizzen_ci.imports.graph.ImportGraph` edges (with the parents they run) reach X,
found without resolving any file at query time.  :func:`reach_of_graph` is the index of a built
graph; the planner keeps one warm, parsing on demand (:mod:`mizzen_ci.plan.index.lazy_reach`).

Invariants:
- The index does not depend on which names are modules (applied at query time), so a node's part
  changes only when its own names change: ``add``/``remove`` keep it exact incrementally, equal as
  sets to ``build`` over the same names.
- A node appears at most once per list; list order is insertion order (callers use the members).
- Plain data (``to_data`` / ``from_data``), so that a cache can keep it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .graph import ImportGraph
from .resolve import direct_names, package_of


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


class ReachIndex:
    """The inverted one-step reach relation; see the module docstring."""

    __slots__ = ("named", "under")

    def __init__(
        self, named: dict[str, list[str]] | None = None, under: dict[str, list[str]] | None = None
    ):
        self.named: dict[str, list[str]] = named if named is not None else {}
        self.under: dict[str, list[str]] = under if under is not None else {}

    @classmethod
    def build(cls, nodes: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]) -> ReachIndex:
        """The index of ``{node: (names, parents_of(names))}``."""
        index = cls()
        for node, (names, parents) in nodes.items():
            index.add(node, names, parents)
        return index

    def add(self, node: str, names: Iterable[str], parents: Iterable[str]) -> None:
        """Record that ``node`` names ``names`` (distinct) whose strict prefixes are ``parents``."""
        list_under(self.named, node, names)
        list_under(self.under, node, parents)

    def remove(self, node: str, names: Iterable[str], parents: Iterable[str]) -> None:
        """Undo :meth:`add` of the same arguments."""
        for table, keys in ((self.named, names), (self.under, parents)):
            for k in keys:
                nodes = table.get(k)
                if nodes is not None and node in nodes:
                    nodes.remove(node)
                    if not nodes:
                        del table[k]

    def importers(self, name: str, modules: Mapping[str, object]) -> list[str]:
        """The nodes that reach ``name`` in one step (a node may be listed twice)."""
        found = self.named.get(name, [])
        if name in modules:
            below = self.under.get(name)
            if below:
                return found + below
        return found

    def to_data(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        return self.named, self.under

    @classmethod
    def from_data(cls, data: object) -> ReachIndex | None:
        """The index from :meth:`to_data`, or None when ``data`` is not one."""
        return cls(data[0], data[1]) if is_dict_pair(data) else None

    def same_as(self, other: ReachIndex) -> bool:
        """Equal as relations (list order aside)."""

        def norm(table):
            return {k: sorted(v) for k, v in table.items() if v}

        return norm(self.named) == norm(other.named) and norm(self.under) == norm(other.under)


def reach_of_graph(graph: ImportGraph) -> ReachIndex:
    """The :class:`ReachIndex` of a built graph (every node, all scopes)."""
    nodes = {}
    for node, facts in graph.facts.items():
        rel = graph.modules.get(node)
        package = package_of(node, rel.endswith("__init__.py")) if rel is not None else ""
        names = direct_names(facts.imports, package)
        nodes[node] = (names, parents_of(names))
    return ReachIndex.build(nodes)


def list_under(table: dict[str, list[str]], node: str, keys: Iterable[str]) -> None:
    """Append ``node`` to the list of each of ``keys`` in ``table`` (an inverted index)."""
    for k in keys:
        found = table.get(k)
        if found is None:
            table[k] = [node]
        else:
            found.append(node)


def is_dict_pair(data: object) -> bool:
    """Whether cached ``data`` has the shape of a ``to_data()`` of two tables."""
    return (
        isinstance(data, tuple)
        and len(data) == 2
        and isinstance(data[0], dict)
        and isinstance(data[1], dict)
    )
