"""Who reaches what: the inverted direct-import relation of a tree, for reverse searches.

A node (a module, or a file under ``tests/`` named by its path) *names* some dotted names
directly: :func:`mizzen_ci.import_graph.direct_names` (every import's target, in all scopes, and
``X.n`` for ``from X import n``).  Importing a name runs its parent packages first, but only those
that are modules of the tree.  So node N reaches X in one step when X is one of N's names, or when
X is a module of the tree and a strict dotted prefix of one of N's names (``parents_of``).

:class:`ReachIndex` keeps both relations inverted::

    named[X]  nodes that name X
    under[X]  nodes that name something strictly below X (X.…)

and ``importers(X, modules)`` is ``named[X]`` plus, when X is a module, ``under[X]``: the nodes
whose :class:`~mizzen_ci.import_graph.ImportGraph` edges (with the parents they run) reach X,
found without resolving any file at query time.

:class:`LazyReach` is the same relation over nodes some of which are not parsed yet
(:class:`~mizzen_ci.spelled_names.PendingNodes`): ``importers(X, modules)`` first parses the
pending nodes that may name X or below (``candidates``) and moves them into the index, then answers
from it, so its answer is the full index's; ``completed()`` is the full index (a copy).  Once
queries have parsed :data:`RESOLVE_ALL_AFTER` nodes (a change that reaches far), the rest is parsed
in one batch (in worker processes), which is cheaper than many small ones.

Invariants:
- ``LazyReach.importers`` equals ``ReachIndex.importers`` of the index over every node, parsed or
  pending, as a set (its ``resolve`` must give each node's names as the full index has them).
- The index does not depend on which names are modules (applied at query time), so a node's part
  changes only when its own names change: ``add``/``remove`` keep it exact incrementally, equal as
  sets to ``build`` over the same names.
- A node appears at most once per list; list order is insertion order (callers use the members).
- Plain data (``to_data`` / ``from_data``), so that a cache can keep it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from .spelled_names import PendingNodes, is_dict_pair


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
        for table, keys in ((self.named, names), (self.under, parents)):
            for k in keys:
                nodes = table.get(k)
                if nodes is None:
                    table[k] = [node]
                else:
                    nodes.append(node)

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


RESOLVE_ALL_AFTER = 256

Resolve = Callable[[list[str]], Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]]


class LazyReach:
    """A :class:`ReachIndex` of the parsed nodes plus the pending ones, parsed on demand by
    ``resolve(nodes) -> {node: (names, parents_of(names))}``; see the module docstring.
    ``modified`` is set when a query moved nodes into the index."""

    __slots__ = ("index", "modified", "pending", "resolve", "resolved")

    def __init__(self, index: ReachIndex, pending: PendingNodes, resolve: Resolve | None = None):
        self.index = index
        self.pending = pending
        self.resolve = resolve
        self.modified = False
        self.resolved = 0  # nodes parsed by queries

    def importers(self, name: str, modules: Mapping[str, object]) -> list[str]:
        """The nodes that reach ``name`` in one step (as :meth:`ReachIndex.importers`)."""
        if self.pending.nodes:
            found = self.pending.candidates(name)
            if found:
                self._move(found)
        return self.index.importers(name, modules)

    def _move(self, nodes: list[str]) -> None:
        if self.resolve is None:
            raise RuntimeError("pending nodes and no way to parse them")
        self.resolved += len(nodes)
        if self.resolved > RESOLVE_ALL_AFTER:
            nodes = list(self.pending.nodes)  # reaching far: the rest in one batch
        resolved = self.resolve(nodes)
        for node in nodes:
            self.pending.remove(node)
            self.index.add(node, *resolved[node])
        self.modified = True

    def completed(self) -> ReachIndex:
        """The index over every node (pending ones parsed), as a new index; this one is left
        as it is."""
        full = ReachIndex(
            {k: list(v) for k, v in self.index.named.items()},
            {k: list(v) for k, v in self.index.under.items()},
        )
        pending = list(self.pending.nodes)
        if pending:
            assert self.resolve is not None, "pending nodes and no way to parse them"
            resolved = self.resolve(pending)
            for node in pending:
                full.add(node, *resolved[node])
        return full

    def to_data(self) -> tuple:
        return (*self.index.to_data(), *self.pending.to_data())

    @classmethod
    def from_data(cls, data: object) -> LazyReach | None:
        """The index from :meth:`to_data` (without ``resolve``), or None when ``data`` is not one."""
        if not (isinstance(data, tuple) and len(data) == 4):
            return None
        index, pending = ReachIndex.from_data(data[:2]), PendingNodes.from_data(data[2:])
        if index is None or pending is None:
            return None
        return cls(index, pending)
