"""Folder-level rules of a package's imports: folders never import each other in a circle, and no
private name crosses a folder (DESIGN.md, "Dependency direction").

Nodes: inside a package, each sub-folder is a node named by its path relative to the package root
(``plan``, ``plan/index``); each module directly in the package root is a node of its own
(``cli.py``), so a root ``cli`` that dispatches to every folder makes no cycle.  Edges: every
import of a module of the same package written in another node (:meth:`ImportGraph.edges`:
lazy imports, inside functions or under ``TYPE_CHECKING``, count; a ``python -m`` run in a
subprocess is no import).  An import names the module it reaches, never the parent packages that
run first.

Rules (:func:`check_package`; each :class:`FolderFinding` prints as
``file:line: [rule] message. Fix: …``):
- ``folder-cycle``: one finding per strongly connected component of the folder graph, naming one
  whole cycle through it, each step with the ``file:line`` of its import, and every node of the
  component.
- ``private-crossing``: ``from M import _name`` (a ``_name``, not a dunder, that is no
  submodule) or an import of a private module (a ``_name`` component) where M lies in another
  node.

Invariants: stdlib only; read from syntax trees, nothing imported; deterministic (sorted nodes,
source-order edges, breadth-first cycles).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .graph import ImportEdge, ImportGraph

#: Edge kinds that run no import in this process (a subprocess's ``python -m``).
NOT_AN_IMPORT = frozenset({"run"})

CYCLE_FIX = (
    "move what the folders share into a module or folder that both import (it imports neither), "
    "or dispatch from a root module above them, so that the imports go one way"
)
PRIVATE_FIX = (
    "make the name public API of its folder (no underscore, documented), or move it to a module "
    "both folders import"
)


@dataclass(frozen=True)
class FolderFinding:
    """One broken folder rule, at the import that breaks it."""

    path: str
    line: int
    rule: str  # "folder-cycle" | "private-crossing"
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}. Fix: {self.fix}"


@dataclass(frozen=True)
class FolderEdge:
    """Node ``source`` imports ``target`` (a module of node ``into``) at ``path:line``."""

    source: str
    into: str
    path: str
    line: int
    target: str
    names: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


class FolderGraph:
    """The folder graph of one package of an :class:`ImportGraph`."""

    def __init__(self, graph: ImportGraph, package: str):
        self.package = package
        self.modules = {
            m: f for m, f in graph.modules.items() if m == package or m.startswith(package + ".")
        }
        self.edges: list[FolderEdge] = []
        for module in sorted(self.modules):
            for edge in graph.edges(module):
                self._add(module, edge)

    def node_of(self, module: str) -> str:
        """``plan/index`` for a module of that folder, ``cli.py`` for a root module."""
        parts = PurePosixPath(self.modules[module]).parts
        depth = module.count(".") + (parts[-1] == "__init__.py")  # components below the root
        below = parts[len(parts) - depth :]
        return "/".join(below[:-1]) if len(below) > 1 else below[0]

    def _module_of(self, target: str) -> str | None:
        """The package's module an import target names (the longest prefix that is one)."""
        while target and target not in self.modules:
            target = target.rpartition(".")[0]
        return target or None

    def _add(self, module: str, edge: ImportEdge) -> None:
        if edge.kind in NOT_AN_IMPORT or edge.kind == "submodule":
            return  # a submodule edge repeats its "from" edge's line
        target = self._module_of(edge.target)
        if target is None:
            return
        source, into = self.node_of(module), self.node_of(target)
        if source != into:
            names = edge.names if edge.kind == "from" else ()
            found = FolderEdge(source, into, self.modules[module], edge.line, edge.target, names)
            self.edges.append(found)

    def successors(self) -> dict[str, list[FolderEdge]]:
        out: dict[str, list[FolderEdge]] = {}
        for e in self.edges:
            out.setdefault(e.source, []).append(e)
        return out


def check_package(graph: ImportGraph, package: str) -> list[FolderFinding]:
    """Every folder cycle and private crossing of ``package``, cycles first."""
    folders = FolderGraph(graph, package)
    return cycle_findings(folders) + private_findings(folders)


def cycle_findings(folders: FolderGraph) -> list[FolderFinding]:
    succ = folders.successors()
    out = []
    for component in strongly_connected(succ):
        steps = shortest_cycle(component[0], set(component), succ)
        first = steps[0]
        route = " -> ".join([s.source for s in steps] + [first.source])
        message = (
            f"folders of {folders.package} import each other in a circle: {route} ("
            + "; ".join(str(s) for s in steps)
            + f"); the circle's component is {{{', '.join(component)}}}"
        )
        out.append(FolderFinding(first.path, first.line, "folder-cycle", message, CYCLE_FIX))
    return out


def private_findings(folders: FolderGraph) -> list[FolderFinding]:
    out = []
    for e in folders.edges:
        private = [n for n in e.names if _private(n) and f"{e.target}.{n}" not in folders.modules]
        inner = e.target.removeprefix(folders.package + ".").split(".")
        private += [f"module {part}" for part in inner if _private(part)]
        for name in private:
            message = (
                f"folder {e.source} imports {name} from {e.target} (folder {e.into}): "
                "a private name crosses a folder"
            )
            out.append(FolderFinding(e.path, e.line, "private-crossing", message, PRIVATE_FIX))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def strongly_connected(succ: dict[str, list[FolderEdge]]) -> list[list[str]]:
    """Components of more than one node (Tarjan, iterative), each sorted, in order of their
    first node."""
    nodes = sorted(set(succ) | {e.into for edges in succ.values() for e in edges})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted({e.into for e in succ.get(start, [])})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            nxt = next(targets, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    found.append(_pop_component(node, stack, on_stack))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted({e.into for e in succ.get(nxt, [])}))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted((c for c in found if len(c) > 1), key=lambda c: c[0])


def _pop_component(root: str, stack: list[str], on_stack: set[str]) -> list[str]:
    component = []
    while True:
        node = stack.pop()
        on_stack.discard(node)
        component.append(node)
        if node == root:
            return sorted(component)


def shortest_cycle(
    start: str, component: set[str], succ: dict[str, list[FolderEdge]]
) -> list[FolderEdge]:
    """The imports of a shortest cycle from ``start`` back to it inside ``component``
    (breadth first; the first import in source order for each step)."""
    came: dict[str, FolderEdge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for e in succ.get(node, []):
            if e.into not in component or e.into in came:
                continue
            came[e.into] = e
            if e.into == start:
                return _route(start, came)
            queue.append(e.into)
    raise ValueError(f"{start} is on no cycle of {sorted(component)}")


def _route(start: str, came: dict[str, FolderEdge]) -> list[FolderEdge]:
    steps = [came[start]]
    while steps[-1].source != start:
        steps.append(came[steps[-1].source])
    return steps[::-1]


def package_roots(source_dirs: Iterable[Path]) -> list[tuple[Path, str]]:
    """``(source dir, package)`` for every top-level package (a folder with ``__init__.py``)."""
    return [
        (d, p.name)
        for d in source_dirs
        for p in sorted(Path(d).iterdir())
        if p.is_dir() and (p / "__init__.py").is_file()
    ]
