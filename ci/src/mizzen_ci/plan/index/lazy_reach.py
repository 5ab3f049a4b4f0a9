"""The planner's warm reach index: a :class:`~mizzen_ci.imports.reach.ReachIndex` of the parsed
nodes plus the nodes not parsed yet, parsed on demand.

:class:`LazyReach` is the reach relation over nodes some of which are not parsed yet
(:class:`~mizzen_ci.plan.index.spelled_names.PendingNodes`): ``importers(X, modules)`` and
``naming(X, below)`` first parse the pending nodes that may name X or below (``candidates``) and
move them into the index, then answer from it, so their answer is the full index's; ``namers(P)``
needs no parse (a pending node keeps its path literals); ``completed()`` is the full index (a
copy).  A pending node has no fail-open mark (it spells no dynamic import), so the index's wild
nodes are all of them.  Once queries have parsed :data:`RESOLVE_ALL_AFTER` nodes (a change that
reaches far), the rest is parsed in one batch (in worker processes), which is cheaper than many
small ones.

Invariants:
- ``importers``, ``naming`` and ``namers`` equal those of the index over every node, parsed or
  pending, as sets (``resolve`` must give each node's entry as the full index has it).
- Plain data (``to_data`` / ``from_data``), so that a cache can keep it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ...imports.reach import Entry, ReachIndex
from .spelled_names import PendingNodes

RESOLVE_ALL_AFTER = 256

Resolve = Callable[[list[str]], Mapping[str, Entry]]


class LazyReach:
    """A :class:`ReachIndex` of the parsed nodes plus the pending ones, parsed on demand by
    ``resolve(nodes) -> {node: entry}`` (:data:`~mizzen_ci.imports.reach.Entry`); see the module
    docstring.
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
        self._parse_candidates(name)
        return self.index.importers(name, modules)

    def naming(self, name: str, below: bool) -> list[str]:
        """The nodes that name ``name`` (or below it), as :meth:`ReachIndex.naming`."""
        self._parse_candidates(name)
        return self.index.naming(name, below)

    def namers(self, path: str, bare: bool = True) -> list[str]:
        """The nodes whose path literals name ``path`` (as :meth:`ReachIndex.namers`)."""
        return self.index.namers(path, bare) + self.pending.namers(path, bare)

    def _parse_candidates(self, name: str) -> None:
        if self.pending.nodes:
            found = self.pending.candidates(name)
            if found:
                self._move(found)

    def _move(self, nodes: list[str]) -> None:
        if self.resolve is None:
            raise RuntimeError("pending nodes and no way to parse them")
        self.resolved += len(nodes)
        if self.resolved > RESOLVE_ALL_AFTER:
            nodes = list(self.pending.nodes)  # reaching far: the rest in one batch
        resolved = self.resolve(nodes)
        for node in nodes:
            self.pending.remove(node)
            self.index.add(node, resolved[node])
        self.modified = True

    def completed(self) -> ReachIndex:
        """The index over every node (pending ones parsed), as a new index; this one is left
        as it is."""
        full = ReachIndex(
            {k: list(v) for k, v in self.index.named.items()},
            {k: list(v) for k, v in self.index.under.items()},
            {k: list(v) for k, v in self.index.paths.items()},
            dict(self.index.wild),
            dict(self.index.syspath),
            dict(self.index.opaque),
        )
        pending = list(self.pending.nodes)
        if pending:
            assert self.resolve is not None, "pending nodes and no way to parse them"
            resolved = self.resolve(pending)
            for node in pending:
                full.add(node, resolved[node])
        return full

    def to_data(self) -> tuple:
        return (*self.index.to_data(), *self.pending.to_data())

    @classmethod
    def from_data(cls, data: object) -> LazyReach | None:
        """The index from :meth:`to_data` (without ``resolve``), or None when ``data`` is not one."""
        if not (isinstance(data, tuple) and len(data) == 10):
            return None
        index, pending = ReachIndex.from_data(data[:6]), PendingNodes.from_data(data[6:])
        if index is None or pending is None:
            return None
        return cls(index, pending)
