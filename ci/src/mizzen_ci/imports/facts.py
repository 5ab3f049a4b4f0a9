"""What one Python file's syntax tree says about its imports (nothing is ever imported).

Per file, **facts** parsed from the source alone (independent of where the file lives)::

    facts = parse_facts(source_bytes, filename)   # -> ModuleFacts
    facts.imports   # tuple[RawImport, ...] in source order
    facts.error     # None, or "line N: message" when the file does not parse (then no imports)
    facts.dynamic   # 0, or the line of the first import whose name is computed (see below)
    facts.paths     # its path literals (:mod:`.path_literals`): the files it may name

    RawImport(module, level, names, line, scope, guarded, kind)
      module   dotted name as written after ``import`` / ``from`` ("" for ``from . import x``)
      level    leading dots of a relative import (0: absolute)
      names    for ``from`` imports the imported names (``"*"`` included); () otherwise
      line     1-based line of the statement (of the call for a dynamic import)
      scope    "module"        top-level statement, also inside if/try/with/for/while/match blocks
                               and class bodies (they run when the module is imported)
               "function"      inside a function body (runs only when called): lazy
               "type-checking" under ``if TYPE_CHECKING:`` (never at run time): lazy
               "getattr"       inside a module-level ``def __getattr__`` (PEP 562): lazy
               "subprocess"    run in another process (``[sys.executable, "-m", "pkg"]``): lazy
               (a statement nested in several takes the outermost lazy reason)
      guarded  inside ``try:`` with a handler that catches ImportError (ImportError,
               ModuleNotFoundError, Exception, BaseException, a bare except, or a tuple with one),
               or inside ``with contextlib.suppress(ImportError)``, or ``pytest.importorskip``.
               Still an eager import.
      kind     "import" | "from" |
               "importlib"    ``importlib.import_module("lit")``; relative literals resolve with a
                              literal package (``import_module(".x", "pkg")`` is ``pkg.x``) or
                              with ``__package__`` / ``__spec__.parent`` (level > 0) |
               "__import__"   ``__import__("lit")`` (``level=`` as given; a literal ``fromlist``
                              adds a "from" record for its names) |
               "importorskip" ``pytest.importorskip("lit")`` |
               "run"          ``runpy.run_module("lit")`` and ``python -m lit`` in a command list
                              whose program is ``sys.executable`` (or a literal ``python…``): the
                              module and its ``__main__``.

Dynamic imports are recognised through aliases bound anywhere in the file (``import importlib
as il``, ``from importlib import import_module as load``, ``import pytest as pt``, ``from pytest
import importorskip``, ``load = importlib.import_module``, …).  One whose name is not a literal
(``import_module(name)``, a relative name with a computed package, ``[sys.executable, "-m",
mod]``), or a use of one of these functions other than a call (``map(import_module, names)``,
``getattr(importlib, "import_module")``) is invisible statically: ``dynamic`` is set to its line,
and the planner treats the file as importing anything of its package (fail open).  Expressions
are only searched when the source spells one of :data:`DYNAMIC_SPELLINGS`; a source that spells
none has no dynamic import (the planner's byte rule, :mod:`mizzen_ci.plan.index.spelled_names`,
parses every file that spells one).

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
from .loaders import LOADER_SPELLINGS, loaders_of_tree
from .path_literals import path_literals, unparsed_literals

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
    dynamic: int = 0  # line of the first import with a computed name (0: none)
    paths: tuple[str, ...] = ()  # path literals (mizzen_ci.imports.path_literals)
    # sys.path folders it adds ("file:REL" / "root:REL", mizzen_ci.imports.loaders)
    syspath: tuple[str, ...] = ()
    opaque: str = ""  # "LINE: what" it loads that the planner cannot resolve ("": nothing)


def parse_facts(source: bytes, filename: str = "<unknown>") -> ModuleFacts:
    """The imports of one file's source (never raises: a syntax error becomes ``error``)."""
    try:
        tree = ast.parse(source, filename)
    except PARSE_ERRORS as e:
        return facts_of_parse_error(e, source)
    return facts_of_tree(tree, source)


def facts_of_parse_error(e: BaseException, source: bytes = b"") -> ModuleFacts:
    """The facts of a source that does not parse (``e``: what ``ast.parse`` raised)."""
    line = getattr(e, "lineno", None) or 1
    msg = getattr(e, "msg", None) or str(e)
    # Python's own import refuses a source that does not parse, except one the ``ast`` module
    # alone gives up on (too deep for its objects): what that one runs is unknown.
    opaque = (
        f"{line}: too deep for the planner to parse"
        if isinstance(e, (RecursionError, MemoryError))
        else ""
    )
    return ModuleFacts(
        (), f"line {line}: {msg}", line, paths=unparsed_literals(source), opaque=opaque
    )


def facts_of_tree(tree: ast.Module, source: bytes) -> ModuleFacts:
    """The imports of a source already parsed into ``tree`` (the same as :func:`parse_facts`)."""
    imports, bound, dynamic, syspath, opaque = imports_of_tree(tree, source)
    return ModuleFacts(
        tuple(map(RawImport._make, imports)),
        bound=bound,
        dynamic=dynamic,
        paths=path_literals(source, tree) or (),
        syspath=syspath,
        opaque=opaque,
    )


def unreadable_facts(e: OSError) -> ModuleFacts:
    """The facts of a file that cannot be read (over a size cap, a link, gone): nothing is known
    of what it imports, so it is opaque (its dependents fail open), never a file without edges."""
    return ModuleFacts((), f"line 1: cannot read: {e.strerror}", 1, opaque=unreadable_why(e))


def unreadable_why(e: OSError) -> str:
    """The ``opaque`` mark of a file that cannot be read."""
    return f"1: cannot be read ({e.strerror})"


# Spellings that make the walk search expressions: every dynamic import, alias and ``-m`` run
# recognised here spells one of them (so does every use this module fails open on), and so does
# everything :mod:`.loaders` reads (programs run, sys.path edits, entry-point groups).
DYNAMIC_SPELLINGS = (
    b"import_module",
    b"__import__",
    b"importorskip",
    b"run_module",
    b'"-m"',
    b"'-m'",
    *LOADER_SPELLINGS,
)


def spells_dynamic(source: bytes) -> bool:
    """Whether ``source`` may hold a dynamic import or a loader (it spells one of
    :data:`DYNAMIC_SPELLINGS`)."""
    return (  # (the first ones spelled out: a generator costs more than the scans)
        b"import_module" in source
        or b"__import__" in source
        or b"importorskip" in source
        or b"run_module" in source
        or b'"-m"' in source
        or b"'-m'" in source
        or any(s in source for s in LOADER_SPELLINGS)
    )


def imports_of_tree(
    tree: ast.Module, source: bytes
) -> tuple[tuple[tuple, ...], frozenset[str] | None, int, tuple[str, ...], str]:
    """``(imports as plain tuples of the RawImport fields, bound, dynamic, syspath, opaque)``:
    what :func:`facts_of_tree` wraps, for a caller that stores plain data."""
    out: list[tuple] = []
    dynamic = _Dynamic(tree, out) if spells_dynamic(source) else None
    _Walker(out, dynamic, None if dynamic else _keyword_lines(source)).block(
        tree.body, "module", False, True
    )
    bound = None
    for imp in out:
        if imp[4] == "getattr":
            bound = frozenset(_bound_names(tree.body))
            break
    line = dynamic.line if dynamic is not None else 0
    if dynamic is None:
        return tuple(out), bound, line, (), ""
    loaders = loaders_of_tree(tree, parse_facts)
    seen = set(out)
    out += [imp for imp in dict.fromkeys(loaders.imports) if imp not in seen]
    if loaders.dynamic and (not line or loaders.dynamic < line):
        line = loaders.dynamic
    syspath = tuple(dict.fromkeys(loaders.syspath))
    return tuple(out), bound, line, syspath, loaders.opaque


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
    """Statement walk (expressions are only searched for dynamic imports, and only when the file
    spells one of :data:`DYNAMIC_SPELLINGS`; otherwise compound statements whose lines never
    spell ``import`` are skipped, which keeps the walk cheap)."""

    __slots__ = ("dynamic", "marks", "out")

    def __init__(self, out: list[tuple], dynamic: _Dynamic | None, marks: list[int] | None):
        self.out = out
        self.dynamic = dynamic
        self.marks = marks  # lines with the word "import"; None: walk everything

    def block(self, body: list[ast.stmt], scope: str, guarded: bool, top: bool) -> None:
        out = self.out
        marks = self.marks
        dynamic = self.dynamic
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
            if dynamic is not None:  # the statement's own expressions (not its bodies)
                dynamic.search(_own_expressions(node), scope, guarded)
            if t is ast.FunctionDef or t is ast.AsyncFunctionDef:
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
                self.block(node.body, scope, suppresses, top)
            elif t is ast.For or t is ast.AsyncFor or t is ast.While:
                self.block(node.body, scope, guarded, top)
                self.block(node.orelse, scope, guarded, top)
            elif t is ast.Match:
                for case in node.cases:
                    self.block(case.body, scope, guarded, top)


_BODIES = frozenset({"body", "orelse", "finalbody", "handlers", "cases"})


def _own_expressions(node: ast.stmt) -> list[ast.AST]:
    """The parts of a statement that are not statement bodies: a simple statement itself; a
    compound one's test, iterable, items, decorators, defaults, bases, handler types, case
    patterns and guards."""
    if not hasattr(node, "body"):
        return [node]
    out: list[ast.AST] = []
    for name, value in ast.iter_fields(node):
        if name not in _BODIES:
            if isinstance(value, list):
                out += [v for v in value if isinstance(v, ast.AST)]
            elif isinstance(value, ast.AST):
                out.append(value)
    for h in getattr(node, "handlers", ()):
        if h.type is not None:
            out.append(h.type)
    for c in getattr(node, "cases", ()):
        out.append(c.pattern)
        if c.guard is not None:
            out.append(c.guard)
    return out


# Modules whose functions import by name: {module: {function: kind}}.
_IMPORTERS = {
    "importlib": {"import_module": "importlib", "__import__": "__import__"},
    "builtins": {"__import__": "__import__"},
    "pytest": {"importorskip": "importorskip"},
    "runpy": {"run_module": "run"},
}
# The same functions spelled bare (a name bound by ``from importlib import import_module`` or
# the builtin ``__import__``), and the keyword each takes its name by.
_FUNCTIONS = {"import_module": "importlib", "__import__": "__import__",
              "importorskip": "importorskip", "run_module": "run"}  # fmt: skip
_NAME_KEYWORD = {"importlib": "name", "__import__": "name", "importorskip": "modname",
                 "run": "mod_name"}  # fmt: skip


class _Dynamic:
    """Dynamic imports of one file: the aliases it binds (anywhere: a module-level alias is seen
    inside functions, a function's own alias too), the literal imports found and the first
    computed one (``line``)."""

    __slots__ = ("functions", "handled", "line", "modules", "out")

    def __init__(self, tree: ast.Module, out: list[tuple]):
        self.out = out
        self.line = 0
        self.modules = {m: m for m in _IMPORTERS}  # local name -> module it is bound to
        self.functions = dict(_FUNCTIONS)  # local name -> kind
        self.handled: set[int] = set()  # ids of references that are calls or alias bindings
        bindings = []
        for node in ast.walk(tree):
            t = type(node)
            if t is ast.Import:
                for a in node.names:
                    if a.asname is None:
                        top = a.name.partition(".")[0]
                        if top in _IMPORTERS:
                            self.modules[top] = top
                    elif a.name in _IMPORTERS:
                        self.modules[a.asname] = a.name
            elif t is ast.ImportFrom and node.level == 0 and node.module in _IMPORTERS:
                for a in node.names:
                    kind = _IMPORTERS[node.module].get(a.name)
                    if kind is not None:
                        self.functions[a.asname or a.name] = kind
            elif (t is ast.Assign and len(node.targets) == 1) or (
                t is ast.AnnAssign and node.value is not None
            ):
                target = node.targets[0] if t is ast.Assign else node.target
                if type(target) is ast.Name:
                    bindings.append((target.id, node.value))
        for _ in range(len(bindings) + 1):  # alias chains of any length, to a fixpoint
            grown = False
            for name, value in bindings:
                kind = self._function_kind(value)
                if kind is not None:
                    grown |= self.functions.get(name) != kind
                    self.functions[name] = kind
                    self.handled.add(id(value))
                elif type(value) is ast.Name and value.id in self.modules:
                    grown |= self.modules.get(name) != self.modules[value.id]
                    self.modules[name] = self.modules[value.id]
            if not grown:
                break

    def _function_kind(self, func: ast.expr) -> str | None:
        """The kind of import a call of ``func`` makes, or None when it is no importing function."""
        t = type(func)
        if t is ast.Name:
            return self.functions.get(func.id)
        if t is ast.Attribute and type(func.value) is ast.Name:
            module = self.modules.get(func.value.id)
            if module is not None:
                return _IMPORTERS[module].get(func.attr)
        return None

    def fail_open(self, line: int) -> None:
        if not self.line or line < self.line:
            self.line = line

    def search(self, nodes: Iterable[ast.AST], scope: str, guarded: bool) -> None:
        """Record the dynamic imports inside expressions ``nodes`` (a breadth-first walk: a
        call is met before the reference it calls)."""
        handled = self.handled
        for root in nodes:
            for n in ast.walk(root):
                t = type(n)
                if t is ast.Call:
                    kind = self._function_kind(n.func)
                    if kind is not None:
                        handled.add(id(n.func))
                        self._call(n, kind, scope, guarded)
                    self._python_m(n.args, n.lineno, guarded)
                elif t is ast.List or t is ast.Tuple:
                    self._python_m(n.elts, n.lineno, guarded)
                elif t is ast.Name or t is ast.Attribute:
                    if (
                        type(n.ctx) is ast.Load
                        and id(n) not in handled
                        and self._function_kind(n) is not None
                    ):
                        self.fail_open(n.lineno)  # passed around: called with what, unknown
                elif t is ast.Constant and type(n.value) is str and n.value in _FUNCTIONS:
                    self.fail_open(n.lineno)  # ``getattr(importlib, "import_module")``

    def _call(self, call: ast.Call, kind: str, scope: str, guarded: bool) -> None:
        line = call.lineno
        args = call.args
        keywords = {k.arg: k.value for k in call.keywords}
        if None in keywords or any(type(a) is ast.Starred for a in args):
            self.fail_open(line)  # ``*args`` / ``**kwargs``: the name is not visible
            return
        name = _string(args[0] if args else keywords.get(_NAME_KEYWORD[kind]))
        if not name:
            self.fail_open(line)
            return
        out = self.out
        if kind == "importorskip":
            out.append((name, 0, (), line, scope, True, kind))
        elif kind == "run":
            out.append((name, 0, (), line, scope, guarded, kind))
            out.append((name + ".__main__", 0, (), line, scope, guarded, kind))
        elif kind == "importlib":
            level = len(name) - len(name.lstrip("."))
            if not level:
                out.append((name, 0, (), line, scope, guarded, kind))
                return
            anchor = args[1] if len(args) > 1 else keywords.get("package")
            package = _string(anchor)
            if package:
                absolute = _resolve_relative(name, level, package)
                if absolute is not None:  # else: an import that always fails
                    out.append((absolute, 0, (), line, scope, guarded, kind))
            elif _is_own_package(anchor):
                out.append((name[level:], level, (), line, scope, guarded, kind))
            else:
                self.fail_open(line)
        else:  # __import__(name, globals, locals, fromlist, level)
            level_node = args[4] if len(args) > 4 else keywords.get("level")
            level = 0
            if level_node is not None:
                if not (type(level_node) is ast.Constant and type(level_node.value) is int):
                    self.fail_open(line)
                    return
                level = max(level_node.value, 0)
            if "." in name[:1]:
                return  # a name with leading dots: __import__ refuses it
            out.append((name, level, (), line, scope, guarded, kind))
            fromlist = args[3] if len(args) > 3 else keywords.get("fromlist")
            if fromlist is None or (type(fromlist) is ast.Constant and fromlist.value is None):
                return
            names = _strings(fromlist)
            if names is None:
                self.fail_open(line)
            elif names:
                out.append((name, level, names, line, scope, guarded, "from"))

    def _python_m(self, items: list[ast.expr], line: int, guarded: bool) -> None:
        """``python -m mod`` in a command (a list, tuple or argument list whose program is
        ``sys.executable`` or a literal ``python…``): mod and its ``__main__`` run, in another
        process."""
        for i, item in enumerate(items):
            if (
                type(item) is ast.Constant
                and item.value == "-m"
                and any(_is_python(p) for p in items[:i])
            ):
                name = _string(items[i + 1]) if i + 1 < len(items) else None
                if name and all(p.isidentifier() for p in name.split(".")):
                    self.out.append((name, 0, (), line, "subprocess", guarded, "run"))
                    self.out.append((name + ".__main__", 0, (), line, "subprocess", guarded, "run"))
                else:
                    self.fail_open(line)


def _string(node: ast.expr | None) -> str | None:
    if node is not None and type(node) is ast.Constant and type(node.value) is str:
        return node.value
    return None


def _strings(node: ast.expr) -> tuple[str, ...] | None:
    if type(node) in (ast.List, ast.Tuple) and all(
        type(e) is ast.Constant and type(e.value) is str for e in node.elts
    ):
        return tuple(e.value for e in node.elts)
    return None


def _is_python(node: ast.expr) -> bool:
    if type(node) is ast.Attribute:
        return node.attr == "executable"
    value = _string(node)
    return value is not None and value.rpartition("/")[2].startswith("python")


def _resolve_relative(name: str, level: int, package: str) -> str | None:
    """``importlib.import_module(name, package)`` for a relative ``name`` (as importlib resolves
    it); None when it reaches above the top of ``package``."""
    bits = package.rsplit(".", level - 1)
    if len(bits) < level:
        return None
    rest = name[level:]
    return f"{bits[0]}.{rest}" if rest else bits[0]


def _is_own_package(pkg: ast.expr | None) -> bool:
    """``__package__`` or ``__spec__.parent``: the file's own package."""
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
