"""The import graph of Python source trees, read from the syntax tree (nothing is ever imported).

This is the one import-graph builder of the repository: the lazy-import check
(:mod:`mizzen_ci.lazy_imports_static`) and the PR planner both build on it.

API (a contract; keep it stable)
--------------------------------

Per file, **facts** parsed from the source alone (independent of where the file lives)::

    facts = parse_facts(source_bytes, filename)   # -> ModuleFacts
    facts.imports   # tuple[RawImport, ...] in source order
    facts.error     # None, or "line N: message" when the file does not parse (then no imports)

    RawImport(module, level, names, line, scope, guarded, kind)
      module   dotted name as written after ``import`` / ``from`` ("" for ``from . import x``)
      level    leading dots of a relative import (0: absolute)
      names    for ``from`` imports the imported names (``"*"`` included); () otherwise
      line     1-based line of the statement (of the call for importlib)
      scope    "module"        top-level statement, also inside if/try/with/for/while/match blocks
                               and class bodies (they run when the module is imported)
               "function"      inside a function body (runs only when called): lazy
               "type-checking" under ``if TYPE_CHECKING:`` (never at run time): lazy
               "getattr"       inside a module-level ``def __getattr__`` (PEP 562): lazy
               (a statement nested in several takes the outermost lazy reason)
      guarded  inside ``try:`` with a handler that catches ImportError (ImportError,
               ModuleNotFoundError, Exception, BaseException, a bare except, or a tuple with one),
               or inside ``with contextlib.suppress(ImportError)``.  Still an eager import.
      kind     "import" | "from" | "importlib" (``importlib.import_module("lit")``, also
               ``import_module("lit")`` and relative literals with ``package=__package__``) |
               "__import__" (``__import__("lit")``).  Only string-literal names are seen;
               computed names are invisible here (the runtime check sees them).

``facts_of_tree(tree, source_bytes)`` is the same from a tree the caller parsed already (one parse
per file for everything the CI reads: :mod:`mizzen_ci.source_facts`).

**FactsCache**\\ (path or None): the content-hash cache of :mod:`mizzen_ci.facts_cache` (also
importable from here): facts keyed by the sha256 of the file's bytes, optionally kept in a file; a
stat fast path (size + mtime_ns, with a 2 s racy-timestamp window re-hashed) means a warm build
costs one ``stat`` per file plus one cache load; a touched but unchanged file costs a hash, never
a parse.  ``cache.save()`` writes atomically and only when something changed.

Pure helpers the planner shares: ``source_files(dir)`` / ``source_modules(root, dirs)`` (the module
walk), ``root_relative(path, root)``, ``package_of``, ``relative_base`` and
``direct_names(imports, package)`` (the names a file's imports name directly, all scopes).

**ImportGraph.build(root, source_dirs, extra_files=(), cache=None, workers=None)**

- ``source_dirs``: directories that are ``sys.path`` entries (``packages/train/src``).  Every
  package (a directory with ``__init__.py``; namespace packages are not walked, as ``pkgutil``
  does not walk them) and module below them is a node named by its dotted module name.  A module
  name defined in two source dirs keeps the first and records a problem.
- ``extra_files``: files that are not importable modules (test files); each is a node named by its
  root-relative POSIX path (it contains ``/``, so it never collides with a module name).
- Paths are root-relative POSIX strings (absolute when outside ``root``).
- Files whose content the cache does not know are parsed once each, in ``workers`` processes
  (default: CPU count) when there are enough of them to pay for the processes, else in-process.

Attributes and queries (``scope``: "module" follows only module-scope edges, i.e. what importing
runs; "all" follows lazy edges too, i.e. what calling anything might run):

- ``graph.modules``: ``{module name: file}``; ``graph.files``: ``{node: file}`` (modules + extras)
- ``graph.facts[node]``: its ModuleFacts; ``graph.problems``: ``[GraphProblem(file, line, msg)]``
  (syntax errors, relative imports beyond the top-level package, duplicate modules)
- ``graph.edges(node)``: resolved ``ImportEdge(target, line, lazy, guarded, kind, scope, names)``
  in source order.  Resolution: relative imports become absolute; ``from pkg import name`` gives
  an edge to ``pkg`` (kind "from") and, when ``pkg.name`` is a module of the graph, one to it
  (kind "submodule").  Targets outside the graph are kept as written (external modules).
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

import ast
import os
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .facts_cache import FactsCache

SCOPES = ("module", "function", "type-checking", "getattr")
GETATTR_SUFFIX = ":__getattr__"  # virtual node: a module's PEP 562 __getattr__ run by an importer
KINDS = ("import", "from", "importlib", "__import__")
_GUARD_EXCEPTIONS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})


# --------------------------------------------------------------------------------------------
# Facts of one file.


class RawImport(NamedTuple):
    """One import as written in a file, before resolution (what the cache stores)."""

    module: str
    level: int
    names: tuple[str, ...]
    line: int
    scope: str
    guarded: bool
    kind: str

    @property
    def lazy(self) -> bool:
        return self.scope != "module"


@dataclass(frozen=True, slots=True)
class ModuleFacts:
    """What one file's syntax tree says about its imports."""

    imports: tuple[RawImport, ...]
    error: str | None = None  # "line N: message" when the source does not parse
    error_line: int = 0
    # Only for a module whose PEP 562 ``__getattr__`` imports something: the names its module
    # scope binds (``from it import other_name`` runs that ``__getattr__``); None otherwise.
    bound: frozenset[str] | None = None


PARSE_ERRORS = (SyntaxError, ValueError, MemoryError, RecursionError)  # ValueError: null bytes


def parse_facts(source: bytes, filename: str = "<unknown>") -> ModuleFacts:
    """The imports of one file's source (never raises: a syntax error becomes ``error``)."""
    try:
        tree = ast.parse(source, filename)
    except PARSE_ERRORS as e:
        return facts_of_parse_error(e)
    return facts_of_tree(tree, source)


def facts_of_parse_error(e: BaseException) -> ModuleFacts:
    """The facts of a source that does not parse (``e``: what ``ast.parse`` raised)."""
    line = getattr(e, "lineno", None) or 1
    msg = getattr(e, "msg", None) or str(e)
    return ModuleFacts((), f"line {line}: {msg}", line)


def facts_of_tree(tree: ast.Module, source: bytes) -> ModuleFacts:
    """The imports of a source already parsed into ``tree`` (the same as :func:`parse_facts`)."""
    imports, bound = imports_of_tree(tree, source)
    return ModuleFacts(tuple(map(RawImport._make, imports)), bound=bound)


def imports_of_tree(
    tree: ast.Module, source: bytes
) -> tuple[tuple[tuple, ...], frozenset[str] | None]:
    """``(imports as plain tuples of the RawImport fields, bound)``: what :func:`facts_of_tree`
    wraps, for a caller that stores plain data."""
    out: list[tuple] = []
    dynamic = b"import_module" in source or b"__import__" in source
    _Walker(out, dynamic, None if dynamic else _keyword_lines(source)).block(
        tree.body, "module", False, True
    )
    bound = None
    for imp in out:
        if imp[4] == "getattr":
            bound = frozenset(_bound_names(tree.body))
            break
    return tuple(out), bound


def _bound_names(body: list[ast.stmt]) -> Iterator[str]:
    """Names bound at module scope (also inside module-level if/try/with/for/while/match).
    A star import binds unknown names: none are claimed for it (so ``__getattr__`` counts)."""
    for node in body:
        t = type(node)
        if t is ast.FunctionDef or t is ast.AsyncFunctionDef or t is ast.ClassDef:
            yield node.name
        elif t is ast.Import:
            for a in node.names:
                yield a.asname or a.name.partition(".")[0]
        elif t is ast.ImportFrom:
            for a in node.names:
                if a.name != "*":
                    yield a.asname or a.name
        elif t is ast.Assign:
            for target in node.targets:
                yield from _target_names(target)
        elif t is ast.AnnAssign or t is ast.AugAssign:
            if t is ast.AugAssign or node.value is not None:
                yield from _target_names(node.target)
        elif t is ast.For or t is ast.AsyncFor:
            yield from _target_names(node.target)
            yield from _bound_names(node.body)
            yield from _bound_names(node.orelse)
        elif t is ast.While or t is ast.If:
            yield from _bound_names(node.body)
            yield from _bound_names(node.orelse)
        elif t is ast.Try or t is ast.TryStar:
            yield from _bound_names(node.body)
            for h in node.handlers:
                if h.name:
                    yield h.name
                yield from _bound_names(h.body)
            yield from _bound_names(node.orelse)
            yield from _bound_names(node.finalbody)
        elif t is ast.With or t is ast.AsyncWith:
            for item in node.items:
                if item.optional_vars is not None:
                    yield from _target_names(item.optional_vars)
            yield from _bound_names(node.body)
        elif t is ast.Match:
            for case in node.cases:
                yield from _bound_names(case.body)


def _target_names(target: ast.expr) -> Iterator[str]:
    if type(target) is ast.Name:
        yield target.id
    elif type(target) is ast.Tuple or type(target) is ast.List:
        for e in target.elts:
            yield from _target_names(e)
    elif type(target) is ast.Starred:
        yield from _target_names(target.value)


_Import, _ImportFrom = ast.Import, ast.ImportFrom
_WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def _keyword_lines(source: bytes) -> list[int]:
    """Sorted line numbers holding the word ``import`` (every import statement spells it, on a
    line inside the statement's span); the walk skips compound statements without one.  (A
    ``bytes.find`` loop: the regex ``\\bimport\\b`` costs a fifth of a parse here.)"""
    lines: list[int] = []
    line, pos, n = 1, 0, len(source)
    find, count, word = source.find, source.count, _WORD_BYTES
    i = find(b"import")
    while i != -1:
        end = i + 6
        if (i == 0 or source[i - 1] not in word) and (end == n or source[end] not in word):
            line += count(b"\n", pos, i)
            pos = i
            if not lines or lines[-1] != line:
                lines.append(line)
        i = find(b"import", end)
    return lines


class _Walker:
    """Statement walk (expressions are only searched for importlib calls, and only when the file
    mentions ``import_module`` or ``__import__``; otherwise compound statements whose lines never
    spell ``import`` are skipped, which keeps the walk cheap)."""

    __slots__ = ("dynamic", "marks", "out")

    def __init__(self, out: list[tuple], dynamic: bool, marks: list[int] | None):
        self.out = out
        self.dynamic = dynamic
        self.marks = marks  # lines with the word "import"; None: walk everything

    def block(self, body: list[ast.stmt], scope: str, guarded: bool, top: bool) -> None:
        out = self.out
        marks = self.marks
        for node in body:
            t = type(node)
            if t is _Import:
                line = node.lineno
                for a in node.names:
                    out.append((a.name, 0, (), line, scope, guarded, "import"))
                continue
            if t is _ImportFrom:
                names = tuple([a.name for a in node.names])
                out.append(
                    (node.module or "", node.level, names, node.lineno, scope, guarded, "from")
                )
                continue
            if marks is not None:
                i = bisect_left(marks, node.lineno)
                if i == len(marks) or marks[i] > node.end_lineno:
                    continue  # no import statement inside this statement
            if t is ast.FunctionDef or t is ast.AsyncFunctionDef:
                if self.dynamic:
                    self.calls(node.decorator_list, scope, guarded)
                if scope == "module":
                    inner = "getattr" if top and node.name == "__getattr__" else "function"
                else:
                    inner = scope
                self.block(node.body, inner, False, False)
            elif t is ast.ClassDef:
                self.block(node.body, scope, guarded, False)
            elif t is ast.If:
                if _is_type_checking(node.test):
                    self.block(
                        node.body, "type-checking" if scope == "module" else scope, guarded, top
                    )
                else:
                    if self.dynamic:
                        self.calls((node.test,), scope, guarded)
                    self.block(node.body, scope, guarded, top)
                self.block(node.orelse, scope, guarded, top)
            elif t is ast.Try or t is ast.TryStar:
                catches = guarded or _catches_import_error(node.handlers)
                self.block(node.body, scope, catches, top)
                for h in node.handlers:
                    self.block(h.body, scope, guarded, top)
                self.block(node.orelse, scope, guarded, top)
                self.block(node.finalbody, scope, guarded, top)
            elif t is ast.With or t is ast.AsyncWith:
                suppresses = guarded or any(_suppresses_import_error(i) for i in node.items)
                if self.dynamic:
                    self.calls([i.context_expr for i in node.items], scope, guarded)
                self.block(node.body, scope, suppresses, top)
            elif t is ast.For or t is ast.AsyncFor or t is ast.While:
                self.block(node.body, scope, guarded, top)
                self.block(node.orelse, scope, guarded, top)
            elif t is ast.Match:
                for case in node.cases:
                    self.block(case.body, scope, guarded, top)
            elif self.dynamic:
                self.calls((node,), scope, guarded)

    def calls(self, nodes: Iterable[ast.AST], scope: str, guarded: bool) -> None:
        """Record ``importlib.import_module("lit")`` / ``__import__("lit")`` inside ``nodes``."""
        for root in nodes:
            for n in ast.walk(root):
                if type(n) is not ast.Call or not n.args:
                    continue
                kind = _dynamic_import_kind(n.func)
                if kind is None:
                    continue
                arg = n.args[0]
                if not (type(arg) is ast.Constant and type(arg.value) is str and arg.value):
                    continue  # a computed name: invisible statically (the runtime check sees it)
                name = arg.value
                level = len(name) - len(name.lstrip("."))
                if level:
                    if kind != "importlib" or not _anchor_is_own_package(n):
                        continue
                    name = name[level:]
                self.out.append((name, level, (), n.lineno, scope, guarded, kind))


def _dynamic_import_kind(func: ast.expr) -> str | None:
    if type(func) is ast.Attribute and func.attr == "import_module":
        return (
            "importlib" if type(func.value) is ast.Name and func.value.id == "importlib" else None
        )
    if type(func) is ast.Name:
        if func.id == "import_module":
            return "importlib"
        if func.id == "__import__":
            return "__import__"
    return None


def _anchor_is_own_package(call: ast.Call) -> bool:
    """``import_module(".x", __package__)`` (or ``package=__package__`` / ``__spec__.parent``)."""
    pkg = call.args[1] if len(call.args) > 1 else None
    for kw in call.keywords:
        if kw.arg == "package":
            pkg = kw.value
    if type(pkg) is ast.Name:
        return pkg.id == "__package__"
    return (
        type(pkg) is ast.Attribute
        and pkg.attr == "parent"
        and type(pkg.value) is ast.Name
        and pkg.value.id == "__spec__"
    )


def _is_type_checking(test: ast.expr) -> bool:
    if type(test) is ast.Name:
        return test.id == "TYPE_CHECKING"
    if type(test) is ast.Attribute:
        return test.attr == "TYPE_CHECKING"
    if type(test) is ast.BoolOp and type(test.op) is ast.And:
        return any(_is_type_checking(v) for v in test.values)
    return False


def _exception_name(node: ast.expr) -> str | None:
    if type(node) is ast.Name:
        return node.id
    if type(node) is ast.Attribute:
        return node.attr
    return None


def _catches_import_error(handlers: list[ast.ExceptHandler]) -> bool:
    for h in handlers:
        if h.type is None:
            return True
        types = h.type.elts if type(h.type) is ast.Tuple else [h.type]
        if any(_exception_name(x) in _GUARD_EXCEPTIONS for x in types):
            return True
    return False


def _suppresses_import_error(item: ast.withitem) -> bool:
    call = item.context_expr
    if type(call) is not ast.Call:
        return False
    f = call.func
    name = f.attr if type(f) is ast.Attribute else f.id if type(f) is ast.Name else None
    return name == "suppress" and any(_exception_name(a) in _GUARD_EXCEPTIONS for a in call.args)


# --------------------------------------------------------------------------------------------
# The graph.


class ImportEdge(NamedTuple):
    """One resolved import of a node: an absolute target module name."""

    target: str
    line: int
    lazy: bool
    guarded: bool
    kind: str  # "import" | "from" | "submodule" | "importlib" | "__import__"
    scope: str
    names: tuple[str, ...] = ()  # for kind "from": the imported names


_WHERE = {
    "module": "module scope",
    "function": "lazy: inside a function",
    "type-checking": "lazy: under TYPE_CHECKING",
    "getattr": "lazy: inside module __getattr__",
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
        if e.kind == "importlib":
            notes.append("importlib.import_module")
        elif e.kind == "__import__":
            notes.append("__import__")
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


@dataclass(frozen=True)
class GraphProblem:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


def iter_source_modules(source_dir: Path | str) -> Iterator[tuple[str, Path]]:
    """(module name, file) of every package and module below one ``sys.path`` entry, sorted.
    (:func:`source_files` is the same walk with string paths.)"""
    for name, path in source_files(source_dir):
        yield name, Path(path)


def source_files(source_dir: Path | str) -> Iterator[tuple[str, str]]:
    """(module name, file path as a string) of every package and module below one ``sys.path``
    entry, sorted by name at each level; no ``Path`` objects (cheap on thousands of files)."""
    try:
        entries = sorted(os.scandir(source_dir), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.name.startswith(".") or e.name in _SKIP_DIRS:
            continue
        if e.is_dir():
            init = os.path.join(e.path, "__init__.py")
            if e.name.isidentifier() and os.path.isfile(init):
                yield from _package_files(e.name, e.path)
        elif e.name.endswith(".py") and e.name[:-3].isidentifier():
            yield e.name[:-3], e.path


def _package_files(name: str, path: str) -> Iterator[tuple[str, str]]:
    yield name, os.path.join(path, "__init__.py")
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        n = e.name
        if n.startswith(".") or n in _SKIP_DIRS:
            continue
        if n.endswith(".py"):
            stem = n[:-3]
            if stem != "__init__" and stem.isidentifier() and e.is_file():
                yield f"{name}.{stem}", e.path
        elif (
            n.isidentifier() and e.is_dir() and os.path.isfile(os.path.join(e.path, "__init__.py"))
        ):
            yield from _package_files(f"{name}.{n}", e.path)


def source_modules(
    root: Path, source_dirs: Iterable[Path | str]
) -> tuple[list[tuple[str, str, str]], list[GraphProblem]]:
    """``([(module name, path, root-relative path)], problems)`` of every module below
    ``source_dirs`` (relative ones are taken from ``root``, which must be resolved), in source-dir
    order; a module name defined twice keeps the first and records a problem."""
    prefix = str(root) + os.sep
    seen: dict[str, str] = {}
    out: list[tuple[str, str, str]] = []
    problems: list[GraphProblem] = []
    for sd in source_dirs:
        sd = Path(sd)
        sd = (sd if sd.is_absolute() else root / sd).resolve()
        for name, path in source_files(sd):
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            if os.sep != "/":
                rel = rel.replace(os.sep, "/")
            if name in seen:
                problems.append(
                    GraphProblem(
                        rel, 1, f"module {name} is also defined by {seen[name]}; kept that one"
                    )
                )
                continue
            seen[name] = rel
            out.append((name, path, rel))
    return out, problems


def root_relative(path: Path | str, root: Path) -> tuple[str, str]:
    """``(path to open, root-relative POSIX path)`` of a file given relative to the resolved
    ``root`` or absolute; lexical (``os.path.normpath``, no ``resolve()`` per file, which costs
    seconds on 10,000 files); absolute when outside ``root``."""
    p = os.fspath(path)
    if not os.path.isabs(p):
        p = os.path.join(root, p)
    p = os.path.normpath(p)
    prefix = str(root) + os.sep
    rel = p[len(prefix) :] if p.startswith(prefix) else p
    return p, rel.replace(os.sep, "/") if os.sep != "/" else rel


def package_of(module: str, is_package: bool) -> str:
    """The package a module's relative imports start from: itself for a package's
    ``__init__``, else its parent ("" for a top-level module)."""
    return module if is_package else module.rpartition(".")[0]


def relative_base(package: str, level: int) -> str | None:
    """The absolute package that ``level`` leading dots name from ``package`` (None: beyond the
    top-level package, or outside any package)."""
    if not package:
        return None
    parts = package.split(".")
    if level > len(parts):
        return None
    return ".".join(parts[: len(parts) - level + 1])


def direct_names(imports: Iterable[tuple], package: str) -> tuple[str, ...]:
    """Every name a file's imports (all scopes) name directly, in source order without
    repeats: each import's absolute target and, for ``from X import n``, ``X.n`` (``n`` may be a
    submodule, or one that is gone).  Relative imports resolve from ``package`` (see
    :func:`package_of`; "" for a file outside any package, whose relative imports are skipped as
    :class:`ImportGraph` skips them).  ``imports``: :class:`RawImport` s or plain tuples of the
    same fields.  Importing one of these names also runs its parent packages first."""
    out: dict[str, None] = {}
    for module, level, names, _line, _scope, _guarded, kind in imports:
        if level:
            base = relative_base(package, level)
            if base is None:
                continue
            target = f"{base}.{module}" if module else base
        else:
            target = module
        out[target] = None
        if kind == "from":
            for n in names:
                if n != "*":
                    out[f"{target}.{n}"] = None
    return tuple(out)


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
        cache: FactsCache | None = None,
        workers: int | None = None,
    ) -> ImportGraph:
        root = Path(root).resolve()
        if cache is None:
            from .facts_cache import FactsCache  # the cache module builds on this one

            cache = FactsCache(None)
        found_modules, problems = source_modules(root, source_dirs)
        modules = {name: rel for name, _, rel in found_modules}
        files = dict(modules)
        wanted = list(found_modules)  # (node, path, root-relative path)
        for p in extra_files:
            path, rel = root_relative(p, root)
            files[rel] = rel
            wanted.append((rel, path, rel))
        found = cache.facts_for_many([(path, rel) for _, path, rel in wanted], workers)
        facts: dict[str, ModuleFacts] = {}
        for (node, _, _), f in zip(wanted, found, strict=True):
            facts[node] = f.module_facts()
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
        return tuple(out)

    # ---- queries

    def is_module(self, name: str) -> bool:
        return name in self.modules

    def path_of(self, node: str) -> Path:
        return self.root / self.files[node]

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
            if "." in t:
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


# --------------------------------------------------------------------------------------------
# Finding source dirs in a tree.

_TREE_SKIP = frozenset({"node_modules", "__pycache__", "build", "dist", "site-packages", "tests"})


def locate_packages(root: Path, names: Iterable[str], max_depth: int = 4) -> dict[str, list[Path]]:
    """For each top-level package name, the directories ``<name>/`` (with ``__init__.py``) found at
    ``root/<name>``, ``root/src/<name>`` or ``<dir>/src/<name>`` up to ``max_depth`` below ``root``
    (hidden, virtualenv, build and ``tests`` directories skipped).  Empty list: not found."""
    wanted = list(dict.fromkeys(names))
    found: dict[str, list[Path]] = {n: [] for n in wanted}
    for n in wanted:
        if (root / n / "__init__.py").is_file():
            found[n].append(root / n)
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if not e.is_dir() or e.name.startswith(".") or e.name in _TREE_SKIP:
                continue
            if os.path.exists(os.path.join(e.path, "pyvenv.cfg")):
                continue
            if e.name == "src":
                for n in wanted:
                    if os.path.isfile(os.path.join(e.path, n, "__init__.py")):
                        found[n].append(Path(e.path, n))
            elif depth + 1 < max_depth:
                stack.append((Path(e.path), depth + 1))
    return {n: sorted(set(v)) for n, v in found.items()}


def workspace_source_dirs(root: Path) -> list[Path]:
    """The ``sys.path`` entries of a uv workspace's members (``<member>/src`` when it exists, else
    the member directory), from ``[tool.uv.workspace] members`` of ``root/pyproject.toml``; plus
    ``root/src`` when present.  Empty when ``root`` is no uv workspace."""
    import tomllib  # only this helper reads TOML

    out: list[Path] = []
    pyproject = root / "pyproject.toml"
    members: list[str] = []
    if pyproject.is_file():
        with pyproject.open("rb") as f:
            data = tomllib.load(f)
        members = data.get("tool", {}).get("uv", {}).get("workspace", {}).get("members", [])
    for pattern in members:
        for member in sorted(root.glob(pattern)):
            if (member / "pyproject.toml").is_file():
                out.append(member / "src" if (member / "src").is_dir() else member)
    if (root / "src").is_dir() and root / "src" not in out:
        out.append(root / "src")
    return out


def __getattr__(name: str):
    """``FactsCache`` lives in :mod:`mizzen_ci.facts_cache` (it builds on this module); it stays
    importable from here, loaded on first use (PEP 562)."""
    if name == "FactsCache":
        from .facts_cache import FactsCache

        return FactsCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
