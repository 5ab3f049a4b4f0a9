"""What one Python file's syntax tree says about its imports (nothing is ever imported).

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
per file for everything the CI reads: :mod:`mizzen_ci.plan.index.source_facts`).

Invariants: stdlib only; never raises for bad source (a parse error is a fact); a pure function
of the bytes.
"""

from __future__ import annotations

import ast
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ..sources import PARSE_ERRORS

_GUARD_EXCEPTIONS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


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
