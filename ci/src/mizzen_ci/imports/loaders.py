"""Code a file loads without an import statement: programs it runs, ``sys.path`` edits and
entry-point groups it loads, read from its syntax tree (nothing is run).

``loaders_of_tree(tree, parse_code) -> Loaders``, searched only in a source that spells one of
:data:`LOADER_SPELLINGS` (a source that spells none loads nothing this way).

- **Programs run** by ``subprocess.run/Popen/call/check_call/check_output/getoutput/
  getstatusoutput``, ``os.system/popen/exec*/spawn*/posix_spawn*``, ``asyncio.create_subprocess_
  exec/_shell`` and ``pty.spawn``, through any alias (``import subprocess as sp``, ``from os import
  system``, ``run = subprocess.run``).  The command is evaluated over literals: strings (shell
  strings split as a shell does, at ``;``, ``&&``, ``||``, ``|``), list and tuple displays,
  ``+``, ``*`` splices, f-strings, names bound in the file (every binding counts), calls of
  functions of the same file (their ``return`` values), ``sys.executable`` and parameters of the
  enclosing function.  Then:

  - ``python … -m M`` (``sys.executable`` or a literal ``python…``, also behind ``env``, ``uv
    run``, ``bash -c``; ``torchrun`` too): ``M`` and ``M.__main__`` run (records of kind "run");
  - ``python … -c CODE``: the imports of CODE (parsed like a file; what it cannot resolve marks
    this file) run;
  - ``python … script.py``: the script is named by a path literal
    (:mod:`.path_literals`), which makes it a dependency;
  - any other literal program ``P``: the record ``script:P`` (kind "script"): a console script of
    the workspace (``[project.scripts]``) maps it to its module at query time.
  - A program, module, code or script that is a parameter of the enclosing function (or a splice
    of one) comes from the caller: the caller's literal is read where it is written (every list,
    tuple and argument list of a searched file is read for ``-m M``, ``-c CODE`` and a leading
    program, whether or not it reaches a runner here).  When the *code* of a ``-c`` is a parameter, the callers pass the
    code alone, with no ``-c`` beside it: then every string constant of the file that spells
    ``import`` and parses is read as ``-c`` code (its imports run).  A caller in another file is
    not seen (known limit).
  - Anything else (a computed program or module, a runner passed around as a value, python
    reading its program from stdin) cannot be resolved: ``opaque`` is set to ``"LINE: what"``.

- **sys.path edits** (``sys.path.insert/append/extend``, slice assignment, ``+=``,
  ``site.addsitedir``, ``monkeypatch.syspath_prepend``): each directory, evaluated from
  ``__file__`` (``Path(__file__).parent / "helpers"``, ``.parents[k]``, ``os.path.dirname``,
  ``os.path.join``, ``resolve()``, ``str()``) or a literal (relative to the working directory,
  the repository root in CI), is in ``syspath`` as ``"file:REL"`` (relative to the file's folder)
  or ``"root:REL"``; the planner resolves imports against every such directory.  A value it
  cannot evaluate sets ``opaque``.

- **Entry-point groups loaded**: ``importlib.metadata.entry_points(group=G)`` (also
  ``importlib_metadata``, ``.select(group=G)``, ``pkg_resources.iter_entry_points(G)``,
  ``EntryPoint(..., group=G)``) gives the record ``entry-points:G``; a group that is not a literal
  (or no group) gives ``entry-points:*`` (every group).  The workspace's ``pyproject.toml`` tables
  map a group to its targets at query time.

- ``pytest_plugins = [...]`` (a conftest's plugins, imported by pytest): literal names are
  imports; a computed value sets ``opaque``.

Invariants: stdlib only; never raises for any tree; a pure function of the tree (the caller passes
trees of the file's bytes, so of the bytes); bounded (names are followed at most
:data:`MAX_DEPTH` deep, alternatives at most :data:`MAX_ALTERNATIVES`: beyond, the value is
opaque, never dropped).
"""

from __future__ import annotations

import ast
import os.path
import posixpath
import re
import shlex
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A source that spells none of these has no loader this module reads.
LOADER_SPELLINGS = (
    b"subprocess",
    b"system",
    b"popen",
    b"spawn",
    b"execv",
    b"execl",
    b"executable",
    b"sys.path",
    b"addsitedir",
    b"syspath_prepend",
    b"from sys import",
    b"sys as",
    b"entry_points",
    b"EntryPoint",
    b"pytest_plugins",
    b'"-c"',
    b"'-c'",
)

MAX_DEPTH = 16
MAX_ALTERNATIVES = 16

# Runner functions: {module: {function: how its command is given}}.
_RUNNERS = {
    "subprocess": {
        "run": "argv", "Popen": "argv", "call": "argv", "check_call": "argv",
        "check_output": "argv", "getoutput": "shell", "getstatusoutput": "shell",
    },
    "os": {
        "system": "shell", "popen": "shell",
        "execv": "execv", "execve": "execv", "execvp": "execv", "execvpe": "execv",
        "execl": "execl", "execle": "execl", "execlp": "execl", "execlpe": "execl",
        "spawnv": "spawnv", "spawnve": "spawnv", "spawnvp": "spawnv", "spawnvpe": "spawnv",
        "spawnl": "spawnl", "spawnle": "spawnl", "spawnlp": "spawnl", "spawnlpe": "spawnl",
        "posix_spawn": "execv", "posix_spawnp": "execv",
    },
    "asyncio": {"create_subprocess_exec": "exec", "create_subprocess_shell": "shell"},
    "pty": {"spawn": "argv"},
}  # fmt: skip
_ENTRY_POINT_MODULES = {
    "importlib.metadata": {"entry_points": "group", "EntryPoint": "group"},
    "importlib_metadata": {"entry_points": "group", "EntryPoint": "group"},
    "pkg_resources": {"iter_entry_points": "group", "load_entry_point": "group2"},
}
_PY_OPTIONS_WITH_VALUE = frozenset({"-X", "-W", "-Q"})
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_PROGRAM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\Z")
_SHELL_OPS = frozenset({";", "&&", "||", "|", "&", "(", ")"})
_FIELD = "\x00F{}\x00"
_FIELD_NAME = "__mizzen_computed_field__"


@dataclass
class Loaders:
    """What one file loads without an import statement (see the module docstring)."""

    imports: list[tuple] = field(default_factory=list)  # RawImport fields as plain tuples
    syspath: list[str] = field(default_factory=list)
    opaque: str = ""  # "LINE: what" of the first thing it cannot resolve
    dynamic: int = 0  # line of a computed import inside ``-c`` code

    def fail(self, line: int, what: str) -> None:
        if not self.opaque or line < int(self.opaque.partition(":")[0]):
            self.opaque = f"{line}: {what}"


def spells_loader(source: bytes) -> bool:
    return any(s in source for s in LOADER_SPELLINGS)


# ---- values

# An item of a command: ("lit", str) | ("exe",) | ("param",) | ("opts",) (literal options only)
# | ("path",) (a path expression holding a path literal or __file__) | ("opaque",)
# A sequence item may also be ("splice", "param"|"opaque").
_OPAQUE = ("opaque",)
_INDENT_ONLY = frozenset({"textwrap.dedent", "dedent", "inspect.cleandoc", "cleandoc"})
_PARAM = ("param",)


class _Scope:
    """The names one function (or the module) binds: ``{name: [value, or None for a
    parameter]}`` and ``augmented``: ``{name: [values added by +=]}``; ``parent``: the enclosing
    scope (Python's lookup: the innermost scope that binds the name, then the module)."""

    __slots__ = ("augmented", "bindings", "parent")

    def __init__(self, parent: _Scope | None):
        self.parent = parent
        self.bindings: dict[str, list[ast.expr | None]] = {}
        self.augmented: dict[str, list[ast.expr]] = {}

    def lookup(self, name: str) -> _Scope | None:
        scope: _Scope | None = self
        while scope is not None and name not in scope.bindings:
            scope = scope.parent
        return scope


_UNKNOWN = ast.Constant(...)  # a binding whose value is not known (a loop target, …)
_TEMPORARY = frozenset({"tmp_path", "tmpdir", "tmp_path_factory", "tmpdir_factory"})


class _Eval:
    """Evaluation of expressions of one file over literals (see the module docstring), name by
    name in the scope each expression is in (:meth:`at` gives the scope of a node)."""

    def __init__(self, tree: ast.Module):
        self.module = _Scope(None)
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.scope_of: dict[int, _Scope] = {}
        self.nodes: list[tuple[ast.AST, _Scope]] = []  # every node with its scope
        self._visit(tree, self.module)
        self.scope = self.module

    def at(self, node: ast.AST) -> _Eval:
        """This evaluator in the scope of ``node``."""
        self.scope = self.scope_of.get(id(node), self.module)
        return self

    def _visit(self, root: ast.AST, scope: _Scope) -> None:
        stack = [(root, scope)]
        while stack:
            node, scope = stack.pop()
            for child in ast.iter_child_nodes(node):
                t = type(child)
                if t is ast.FunctionDef or t is ast.AsyncFunctionDef or t is ast.Lambda:
                    inner = _Scope(scope)
                    a = child.args
                    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                        if arg is not None:
                            inner.bindings.setdefault(arg.arg, []).append(None)
                    if t is not ast.Lambda:
                        self.functions.setdefault(child.name, []).append(child)
                        scope.bindings.setdefault(child.name, []).append(_UNKNOWN)
                        for d in (*child.decorator_list, *a.defaults, *a.kw_defaults):
                            if d is not None:
                                stack.append((d, scope))
                        for stmt in child.body:
                            self._bind_in(stmt, inner)
                            self.scope_of[id(stmt)] = inner
                            self.nodes.append((stmt, inner))
                            stack.append((stmt, inner))
                    else:
                        stack.append((child.body, inner))
                    continue
                self._bind_in(child, scope)
                self.scope_of[id(child)] = scope
                self.nodes.append((child, scope))
                stack.append((child, scope))

    def _bind_in(self, node: ast.AST, scope: _Scope) -> None:
        t = type(node)
        if t is ast.Assign:
            for target in node.targets:
                self._bind(scope, target, node.value)
        elif (t is ast.AnnAssign and node.value is not None) or t is ast.NamedExpr:
            self._bind(scope, node.target, node.value)
        elif t is ast.AugAssign:
            if type(node.target) is ast.Name and type(node.op) is ast.Add:
                scope.augmented.setdefault(node.target.id, []).append(node.value)
                scope.bindings.setdefault(node.target.id, [])
            else:
                self._bind(scope, node.target, _UNKNOWN)
        elif t in (ast.For, ast.AsyncFor, ast.comprehension):
            self._bind(scope, node.target, _UNKNOWN)
        elif t is ast.withitem and node.optional_vars is not None:
            self._bind(scope, node.optional_vars, _UNKNOWN)
        elif t is ast.ExceptHandler and node.name:
            scope.bindings.setdefault(node.name, []).append(_UNKNOWN)
        elif t is ast.Import or t is ast.ImportFrom:
            for a in node.names:
                scope.bindings.setdefault(a.asname or a.name.partition(".")[0], []).append(_UNKNOWN)
        elif t is ast.ClassDef:
            scope.bindings.setdefault(node.name, []).append(_UNKNOWN)

    @staticmethod
    def _bind(scope: _Scope, target: ast.expr, value: ast.expr) -> None:
        if type(target) is ast.Name:
            scope.bindings.setdefault(target.id, []).append(value)
        else:
            for n in ast.walk(target):
                if type(n) is ast.Name:
                    scope.bindings.setdefault(n.id, []).append(_UNKNOWN)

    def _values(self, name: str) -> tuple[list[ast.expr | None], list[ast.expr]] | None:
        scope = self.scope.lookup(name)
        if scope is None:
            return None
        return scope.bindings[name], scope.augmented.get(name, [])

    # -- strings and items

    def items(self, node: ast.expr | None, depth: int = 0) -> list[tuple]:
        """The alternatives of one command item (a string, sys.executable, a parameter, …)."""
        if node is None or depth > MAX_DEPTH:
            return [_OPAQUE]
        t = type(node)
        if t is ast.Constant:
            return [("lit", node.value)] if type(node.value) is str else [_OPAQUE]
        if t is ast.Attribute and node.attr in ("executable", "_base_executable"):
            return [("exe",)]
        if t is ast.Name:
            return self._name(node.id, depth, self.items, _PARAM)
        if t is ast.Call and node.args:
            name = _call_name(node.func)
            if name in ("shutil.which", "which") and type(node.args[0]) is ast.Constant:
                return [("lit", str(node.args[0].value))]  # the program of that name
            if (
                name == "getattr"
                and len(node.args) > 1
                and _string_of(node.args[1]).endswith("executable")
            ):
                return [("exe",)]
        if t is ast.IfExp:
            return _cap(self.items(node.body, depth + 1) + self.items(node.orelse, depth + 1))
        if t is ast.JoinedStr:
            return [self._fstring(node, depth)]
        if t is ast.Call and _call_name(node.func) in ("str", "fspath", "os.fspath") and node.args:
            inner = self.items(node.args[0], depth + 1)
            return inner if all(i[0] in ("lit", "exe", "param") for i in inner) else [("path",)]
        if t is ast.Call and _call_name(node.func) in _INDENT_ONLY and len(node.args) == 1:
            # re-indenting code changes no import it holds: the argument's own value
            inner = self.items(node.args[0], depth + 1)
            return [("lit", textwrap.dedent(i[1])) if i[0] == "lit" else i for i in inner]
        if self.path(node, depth) is not None:
            return [("path",)]
        if _holds_path_literal(node):
            return [("path",)]
        return [_OPAQUE]

    def _fstring(self, node: ast.JoinedStr, depth: int) -> tuple:
        parts = []
        for v in node.values:
            if type(v) is ast.Constant:
                parts.append(str(v.value))
            else:
                found = self.items(v.value, depth + 1)
                literal = self._literal(v.value, depth + 1)
                if literal is not None and v.format_spec is None:
                    parts.append(repr(literal) if v.conversion == ord("r") else str(literal))
                elif len(found) == 1 and found[0][0] == "lit":
                    parts.append(found[0][1])
                elif len(found) == 1 and found[0][0] == "exe":
                    parts.append("python")
                else:
                    parts.append(_FIELD.format(len(parts)))
        return ("lit", "".join(parts))

    def _literal(self, node: ast.expr, depth: int) -> object | None:
        """The value of a literal display (``ast.literal_eval``), through names bound once."""
        if depth > MAX_DEPTH:
            return None
        if type(node) is ast.Name:
            found = self._values(node.id)
            if found is None or len(found[0]) != 1 or found[1] or found[0][0] is None:
                return None
            return self._literal(found[0][0], depth + 1)
        if type(node) not in (ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Constant):
            return None
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None

    def _name(self, name: str, depth: int, how, param) -> list:
        """The alternatives of every binding of ``name`` in its scope (``param`` for a
        parameter); values added by ``+=`` are appended to sequences (a string's are args)."""
        found = self._values(name)
        if found is None or not found[0]:
            return how(None, depth)  # bound nowhere: opaque
        values, added = found
        out: list = []
        for v in values:
            out += [param] if v is None else how(v, depth + 1)
        if added and how == self.seqs:
            for rhs in added:
                out = _cap([a + b for a in out for b in self.seqs(rhs, depth + 1)])
        return _cap(out)

    # -- sequences

    def seqs(self, node: ast.expr | None, depth: int = 0) -> list[list[tuple]]:
        """The alternatives of a command sequence (each a list of items and splices)."""
        if node is None or depth > MAX_DEPTH:
            return [[("splice", "opaque")]]
        t = type(node)
        if t is ast.List or t is ast.Tuple:
            return self._display(node.elts, depth)
        if t is ast.Name:
            return self._name(node.id, depth, self.seqs, [("splice", "param")])
        if t is ast.BinOp and type(node.op) is ast.Add:
            left, right = self.seqs(node.left, depth + 1), self.seqs(node.right, depth + 1)
            return _cap([a + b for a in left for b in right])
        if t is ast.IfExp:
            return _cap(self.seqs(node.body, depth + 1) + self.seqs(node.orelse, depth + 1))
        if t is ast.Call:
            name = _call_name(node.func)
            if name in ("list", "tuple") and len(node.args) == 1:
                return self.seqs(node.args[0], depth + 1)
            returns = self._returns(node, depth)
            if returns is not None:
                return returns
            if name in ("shlex.split", "split") and node.args:
                return [self._shell(i) for i in self.items(node.args[0], depth + 1)]
        if t is ast.Constant and type(node.value) is str:
            return [[("lit", node.value)]]
        return [[("splice", "opaque")]]

    def _display(self, elts: list[ast.expr], depth: int) -> list[list[tuple]]:
        alts: list[list[tuple]] = [[]]
        for e in elts:
            if type(e) is ast.Starred:
                inner = self.seqs(e.value, depth + 1)
                if all(_only_options(s) for s in inner):
                    options = [("opts",)]
                    alts = [a + options for a in alts]
                    continue
                alts = _cap([a + s for a in alts for s in inner])
            else:
                alts = _cap([[*a, i] for a in alts for i in self.items(e, depth + 1)])
        return alts

    def _returns(self, call: ast.Call, depth: int) -> list[list[tuple]] | None:
        """The sequences a call of a function of this file returns (None: no such function)."""
        f = call.func
        name = f.id if type(f) is ast.Name else f.attr if type(f) is ast.Attribute else None
        defs = self.functions.get(name or "")
        if not defs:
            return None
        out: list[list[tuple]] = []
        caller = self.scope
        try:
            for d in defs:
                for n in ast.walk(d):
                    if type(n) is ast.Return and n.value is not None:
                        self.scope = self.scope_of.get(id(n), self.module)
                        out += self.seqs(n.value, depth + 1)
        finally:
            self.scope = caller
        return _cap(out) if out else [[("splice", "opaque")]]

    def _shell(self, item: tuple) -> list[tuple]:
        if item[0] != "lit":
            return [("splice", "param" if item == _PARAM else "opaque")]
        commands = _shell_commands(item[1])
        if commands is None or len(commands) != 1:
            return [("splice", "opaque")]
        return commands[0]

    # -- paths (for sys.path)

    def path(self, node: ast.expr, depth: int = 0) -> tuple[str, list[str]] | None:
        """``(anchor, segments)`` of a path expression: anchor "dir" (the file's own folder) or
        "root" (the working directory); None when it is not a path this evaluates."""
        if depth > MAX_DEPTH:
            return None
        t = type(node)
        if t is ast.Name:
            if node.id == "__file__":
                return "dir", ["\x00self"]
            found = self._values(node.id)
            if found is None or len(found[0]) != 1 or found[1]:
                return None
            if found[0][0] is None:  # a parameter: pytest's temporary folders are no repo's
                return ("tmp", []) if node.id in _TEMPORARY else None
            return self.path(found[0][0], depth + 1)
        if t is ast.Constant and type(node.value) is str:
            if node.value.startswith("/"):
                return None
            return "root", [s for s in node.value.split("/") if s not in ("", ".")]
        if t is ast.Attribute and node.attr == "parent":
            return _up(self.path(node.value, depth + 1), 1)
        if (
            t is ast.Subscript
            and type(node.value) is ast.Attribute
            and node.value.attr == "parents"
        ):
            k = node.slice
            if type(k) is ast.Constant and type(k.value) is int and k.value >= 0:
                return _up(self.path(node.value.value, depth + 1), k.value + 1)
            return None
        if t is ast.BinOp and type(node.op) is ast.Div:
            left = self.path(node.left, depth + 1)
            right = self.items(node.right, depth + 1)
            if left is None or len(right) != 1 or right[0][0] != "lit":
                return None
            return _join(left, right[0][1])
        if t is ast.Call:
            name = _call_name(node.func)
            method = node.func.attr if type(node.func) is ast.Attribute else ""
            if name in ("Path.cwd", "os.getcwd", "pathlib.Path.cwd", "getcwd"):
                return "root", []
            if name in ("tempfile.mkdtemp", "mkdtemp") or method == "mktemp":
                return "tmp", []
            if method in ("resolve", "absolute", "expanduser") and type(node.func) is ast.Attribute:
                return self.path(node.func.value, depth + 1)
            if method == "joinpath" and type(node.func) is ast.Attribute:
                base = self.path(node.func.value, depth + 1)
                for a in node.args:
                    part = self.items(a, depth + 1)
                    if base is None or len(part) != 1 or part[0][0] != "lit":
                        return None
                    base = _join(base, part[0][1])
                return base
            last = name.rpartition(".")[2] if name else ""
            if last in ("Path", "PurePath", "PosixPath", "str", "fspath", "abspath", "realpath",
                        "normpath") and len(node.args) == 1:  # fmt: skip
                return self.path(node.args[0], depth + 1)
            if last == "dirname" and len(node.args) == 1:
                return _up(self.path(node.args[0], depth + 1), 1)
            if last in ("join", "Path") and node.args:
                base = self.path(node.args[0], depth + 1)
                for a in node.args[1:]:
                    part = self.items(a, depth + 1)
                    if base is None or len(part) != 1 or part[0][0] != "lit":
                        return None
                    base = _join(base, part[0][1])
                return base
        return None


def _up(p: tuple[str, list[str]] | None, n: int) -> tuple[str, list[str]] | None:
    if p is None:
        return None
    anchor, segs = p[0], list(p[1])
    for _ in range(n):
        if segs and segs[-1] != "..":
            segs.pop()
        else:
            segs.append("..")
    return anchor, segs


def _join(p: tuple[str, list[str]], rel: str) -> tuple[str, list[str]] | None:
    if rel.startswith("/"):
        return None
    segs = list(p[1])
    for s in rel.split("/"):
        if s == "..":
            segs = segs[:-1] if segs and segs[-1] != ".." else [*segs, ".."]
        elif s not in ("", "."):
            segs.append(s)
    return p[0], segs


def _encode_dir(p: tuple[str, list[str]]) -> str | None:
    """``file:REL`` / ``root:REL``; ``tmp:`` for a temporary folder (no file of the repository);
    None for the file itself."""
    anchor, segs = p
    if anchor == "tmp":
        return "tmp:"
    if "\x00self" in segs:
        return None  # the file itself, not a folder
    rel = posixpath.normpath("/".join(segs)) if segs else "."
    return f"{'file' if anchor == 'dir' else 'root'}:{rel}"


def _cap(alts: list) -> list:
    if len(alts) > MAX_ALTERNATIVES:
        return [[("splice", "opaque")]] if alts and type(alts[0]) is list else [_OPAQUE]
    return alts


def _only_options(seq: list[tuple]) -> bool:
    return all(
        (i[0] == "lit" and i[1].startswith("-") and i[1] not in ("-m", "-c")) or i == ("opts",)
        for i in seq
    )


def _string_of(node: ast.expr) -> str:
    return node.value if type(node) is ast.Constant and type(node.value) is str else ""


def _call_name(func: ast.expr) -> str:
    parts = []
    while type(func) is ast.Attribute:
        parts.append(func.attr)
        func = func.value
    if type(func) is ast.Name:
        parts.append(func.id)
        return ".".join(reversed(parts))
    return ""


def _holds_path_literal(node: ast.expr) -> bool:
    """Whether an expression holds ``__file__`` or a string constant ending in a file name with
    an extension (the script it names is a path literal of the file)."""
    for n in ast.walk(node):
        if type(n) is ast.Name and n.id == "__file__":
            return True
        if type(n) is ast.Constant and type(n.value) is str and n.value.endswith(".py"):
            return True
    return False


def _shell_commands(text: str) -> list[list[tuple]] | None:
    """The commands of a shell string (split at ``;``, ``&&``, ``||``, ``|``, ``&``); an
    f-string's fields are opaque items; None when it does not split."""
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return None
    out: list[list[tuple]] = [[]]
    for tok in tokens:
        if tok in _SHELL_OPS or set(tok) <= set(";&|()"):
            out.append([])
        elif "\x00F" in tok:
            out[-1].append(_OPAQUE)
        else:
            out[-1].append(("lit", tok))
    return [c for c in out if c]


# ---- commands


def _program_name(value: str) -> str:
    return value.rpartition("/")[2]


def _is_python(item: tuple) -> bool:
    if item == ("exe",):
        return True
    if item[0] != "lit":
        return False
    name = _program_name(item[1])
    return name.startswith("python") or name in ("torchrun", "pypy", "pypy3")


class _Commands:
    """Classifies the commands of one file into records (see the module docstring)."""

    def __init__(self, ev: _Eval, out: Loaders, parse_code: Callable[[bytes], Any]):
        self.ev = ev
        self.out = out
        self.parse_code = parse_code
        self.code_from_caller = 0  # the line of a `-c` whose code is a parameter (0: none)

    def run(self, seq: list[tuple], line: int, strict: bool, depth: int = 0) -> None:
        """Record what the command ``seq`` runs; ``strict``: it is run here (a runner's
        argument), so what it cannot resolve marks the file."""
        i, n = 0, len(seq)
        while i < n:  # wrappers: env VAR=1 …, uv run …, nice …
            it = seq[i]
            if it[0] == "lit" and _program_name(it[1]) in ("env", "nice", "exec", "nohup", "time"):
                i += 1
                while i < n and seq[i][0] == "lit" and ("=" in seq[i][1] or seq[i][1][:1] == "-"):
                    i += 1
                continue
            if it == ("lit", "uv") and i + 1 < n and seq[i + 1] == ("lit", "run"):
                i += 2
                while i < n and seq[i][0] == "lit" and seq[i][1].startswith("-"):
                    i += 1
                continue
            break
        if i >= n:
            if strict:
                self.out.fail(line, "runs a command the planner cannot read")
            return
        program = seq[i]
        if _is_python(program):
            self._python(seq[i + 1 :], line, strict, depth)
        elif program[0] == "lit":
            name = _program_name(program[1])
            if name in ("bash", "sh", "zsh", "dash") and i + 2 < n and seq[i + 1] == ("lit", "-c"):
                self.shell(seq[i + 2], line, strict, depth)
            elif _PROGRAM.match(name):
                self.record(f"script:{name}", line, "script")
            elif strict and " " in program[1]:  # a command line passed as one string
                self.shell(program, line, strict, depth)
        elif program == _PARAM or program == ("splice", "param"):
            pass  # the caller's literal is read where it is written
        elif strict:
            self.out.fail(line, "runs a program the planner cannot resolve")

    def _python(self, rest: list[tuple], line: int, strict: bool, depth: int) -> None:
        i, n = 0, len(rest)
        while i < n:
            it = rest[i]
            if it == ("opts",):
                i += 1
                continue
            if it[0] != "lit":
                if it == ("splice", "param") and i + 1 < n:
                    i += 1  # options from the caller; what follows is still read here
                    continue
                if it in (_PARAM, ("splice", "param")):
                    return  # from the caller
                if it == ("path",):
                    return  # a script named by a path literal
                if strict:
                    self.out.fail(line, "runs Python code the planner cannot resolve")
                return
            s = it[1]
            if s == "-m" or (s.startswith("-m") and len(s) > 2):
                target = rest[i + 1] if s == "-m" and i + 1 < n else ("lit", s[2:])
                self.module(target, line, strict)
                return
            if s == "-c" or (s.startswith("-c") and len(s) > 2):
                code = rest[i + 1] if s == "-c" and i + 1 < n else ("lit", s[2:])
                self.code(code, line, strict, depth)
                return
            if s in _PY_OPTIONS_WITH_VALUE:
                i += 2
                continue
            if s == "-" and strict:
                self.out.fail(line, "runs Python code read from stdin")
                return
            if s.startswith("-"):
                i += 1
                continue
            return  # a script: its path is a path literal of this file
        if strict:
            self.out.fail(line, "runs Python with its program from stdin")

    def module(self, target: tuple, line: int, strict: bool) -> None:
        if target[0] == "lit" and _MODULE_NAME.match(target[1]):
            self.record(target[1], line, "run")
            self.record(target[1] + ".__main__", line, "run")
        elif target in (_PARAM, ("splice", "param")):
            pass
        elif strict:
            self.out.fail(line, "runs `python -m` of a module the planner cannot resolve")

    def code(self, code: tuple, line: int, strict: bool, depth: int) -> None:
        if code in (_PARAM, ("splice", "param")):
            self.code_from_caller = self.code_from_caller or line
            return
        if code[0] != "lit":
            if strict:
                self.out.fail(line, "runs `python -c` code the planner cannot resolve")
            return
        text = re.sub("\x00F[0-9]+\x00", _FIELD_NAME, code[1])  # a computed field: a name
        if depth > 2:
            if strict:
                self.out.fail(line, "runs `python -c` code nested too deep")
            return
        facts = self.parse_code(text.encode("utf-8", "surrogatepass"))
        if facts.error is not None:
            if strict and text != code[1]:
                self.out.fail(line, "runs `python -c` code the planner cannot resolve")
            return  # (without computed fields: Python refuses it, nothing runs)
        if any(_FIELD_NAME in imp[0] or _FIELD_NAME in "".join(imp[2]) for imp in facts.imports):
            self.out.fail(line, "runs `python -c` code importing a computed name")
        for imp in facts.imports:
            self.out.imports.append((*imp[:4], "subprocess", imp[5], imp[6]))
        if facts.dynamic:
            self.out.dynamic = self.out.dynamic or line
        if facts.opaque:
            self.out.fail(line, f"runs `python -c` code that {facts.opaque.partition(': ')[2]}")
        self.out.syspath += [d for d in facts.syspath if d.startswith("root:")]

    def shell(self, item: tuple, line: int, strict: bool, depth: int) -> None:
        if item in (_PARAM, ("splice", "param")):
            return
        if item[0] != "lit":
            if strict:
                self.out.fail(line, "runs a shell command the planner cannot resolve")
            return
        commands = _shell_commands(item[1])
        if commands is None:
            if strict:
                self.out.fail(line, "runs a shell command the planner cannot split")
            return
        for c in commands:
            self.run(c, line, strict, depth + 1)

    def record(self, name: str, line: int, kind: str) -> None:
        self.out.imports.append((name, 0, (), line, "subprocess", False, kind))


# ---- the walk


class _Aliases:
    """Local names bound to modules and functions of ``tables`` (``{module: {function: kind}}``),
    anywhere in the file; a module's own name is bound to it even when the file does not import
    it (it may be imported elsewhere): names are over-approximated, never missed."""

    def __init__(self, tree: ast.Module, tables: dict[str, dict[str, str]]):
        self.tables = tables
        tops = {m.partition(".")[0] for m in tables}
        self.modules: dict[str, str] = {t: t for t in tops}  # local name -> module
        self.functions: dict[str, str] = {}  # local name -> kind
        bindings = []
        for node in ast.walk(tree):
            t = type(node)
            if t is ast.Import:
                for a in node.names:
                    if a.asname is not None and (a.name in tables or a.name in tops):
                        self.modules[a.asname] = a.name
            elif t is ast.ImportFrom and node.level == 0 and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in tables or full in tops:
                        self.modules[a.asname or a.name] = full
                    elif a.name in tables.get(node.module, {}):
                        self.functions[a.asname or a.name] = tables[node.module][a.name]
            elif t is ast.Assign and len(node.targets) == 1 and type(node.targets[0]) is ast.Name:
                bindings.append((node.targets[0].id, node.value))
        for _ in range(len(bindings) + 1):  # alias chains of any length, to a fixpoint
            grown = False
            for name, value in bindings:
                kind = self.kind(value)
                if kind is not None and self.functions.get(name) != kind:
                    self.functions[name] = kind
                    grown = True
                module = self.module_of(value)
                if module is not None and self.modules.get(name) != module:
                    self.modules[name] = module
                    grown = True
            if not grown:
                break

    def module_of(self, node: ast.expr) -> str | None:
        """The module of ``tables`` that ``node`` (a name or attribute chain) is, or None."""
        name = _call_name(node) if type(node) in (ast.Name, ast.Attribute) else ""
        head, _, rest = name.partition(".")
        if not head or head not in self.modules:
            return None
        full = self.modules[head] + ("." + rest if rest else "")
        return full if full in self.tables else None

    def kind(self, func: ast.expr) -> str | None:
        """The kind of function of ``tables`` that ``func`` is, or None."""
        if type(func) is ast.Name:
            return self.functions.get(func.id)
        if type(func) is ast.Attribute:
            module = self.module_of(func.value)
            if module is not None:
                return self.tables[module].get(func.attr)
        return None


def loaders_of_tree(tree: ast.Module, parse_code: Callable[[bytes], Any]) -> Loaders:
    """What ``tree`` loads without an import statement (see the module docstring);
    ``parse_code`` reads the facts of ``python -c`` code (the caller's file-facts reader, so that
    this module does not import it back)."""
    out = Loaders()
    try:
        _walk(tree, out, parse_code)
    except RecursionError:
        out.fail(1, "is nested too deep for the planner to read")
    return out


def _walk(tree: ast.Module, out: Loaders, parse_code: Callable[[bytes], Any]) -> None:
    ev = _Eval(tree)
    commands = _Commands(ev, out, parse_code)
    runners = _Aliases(tree, _RUNNERS)
    eps = _Aliases(tree, _ENTRY_POINT_MODULES)
    sys_alias = _Aliases(tree, {"sys": {"path": "path"}, "site": {"addsitedir": "add"}})
    stored = _stored_values(tree)
    for node, _ in ev.nodes:
        ev.at(node)
        t = type(node)
        if t is ast.Call:
            kind = runners.kind(node.func)
            if kind is not None:
                _runner_call(node, kind, ev, commands, out)
            else:
                group_kind = eps.kind(node.func)
                if group_kind is not None:
                    _group_call(node, group_kind, ev, out)
                _syspath_call(node, ev, sys_alias, out)
            # every argument list: `-m M`, `-c CODE` given to a helper
            args = [_item_or_splice(ev, a) for a in node.args]
            _scan_sequence([i for a in args for i in a], node.lineno, commands)
            checks_type = _call_name(node.func) in ("isinstance", "issubclass")
            for a in node.args:  # a runner passed as a value: what it runs is unknown
                if (
                    not checks_type
                    and type(a) in (ast.Name, ast.Attribute)
                    and runners.kind(a) is not None
                ):
                    out.fail(node.lineno, "passes a program runner on as a value")
        elif t is ast.List or t is ast.Tuple:
            for seq in ev._display(node.elts, 0):
                _scan_sequence(seq, node.lineno, commands)
        elif t in (ast.Assign, ast.AugAssign, ast.AnnAssign):
            _syspath_assign(node, ev, sys_alias, out, stored)
            _pytest_plugins(node, ev, out)
    if commands.code_from_caller:
        _code_literals(tree, commands)


def _code_literals(tree: ast.Module, commands: _Commands) -> None:
    """A helper runs ``python -c CODE`` with CODE a parameter, and its callers hand it the code
    itself (``run_python(PROBE + "...")``: no ``-c`` at the call site to read it by): every string
    constant of the file that spells ``import`` and parses as Python counts as code the file runs
    (more than the calls pass, never less)."""
    for node in ast.walk(tree):
        if type(node) is ast.Constant and type(node.value) is str and "import" in node.value:
            commands.code(("lit", node.value), node.lineno, strict=False, depth=1)


def _scan_sequence(seq: list[tuple], line: int, commands: _Commands) -> None:
    """A literal list or argument list: ``-m M`` and ``-c CODE`` anywhere in it, and a leading
    program (a command given to a helper that runs it)."""
    if not seq:
        return
    first = seq[0]
    if _is_python(first) or (  # a console script is spelled with a hyphen (mizzen-rollout)
        first[0] == "lit" and "-" in first[1] and _PROGRAM.match(_program_name(first[1]))
    ):
        commands.run(seq, line, strict=False)
    for i, item in enumerate(seq[:-1]):
        if item == ("lit", "-m"):
            commands.module(seq[i + 1], line, strict=False)
        elif item == ("lit", "-c"):
            commands.code(seq[i + 1], line, strict=False, depth=0)


def _runner_call(call: ast.Call, kind: str, ev: _Eval, commands: _Commands, out: Loaders) -> None:
    line = call.lineno
    args = call.args
    keywords = {k.arg: k.value for k in call.keywords}
    if None in keywords and not args:
        out.fail(line, "runs a command given through **kwargs")
        return
    if kind == "shell":
        for item in ev.items(args[0] if args else keywords.get("cmd")):
            commands.shell(item, line, strict=True, depth=0)
        return
    if kind == "argv":
        command = args[0] if args else keywords.get("args")
        shell = keywords.get("shell")
        if command is None or any(type(a) is ast.Starred for a in args[:1]):
            out.fail(line, "runs a command the planner cannot see")
            return
        if shell is not None and not (type(shell) is ast.Constant and shell.value is False):
            for item in ev.items(command):
                if item[0] == "lit" or item in (_PARAM, _OPAQUE):
                    commands.shell(item, line, strict=True, depth=0)
                    continue
                commands.shell(_OPAQUE, line, strict=True, depth=0)
            if type(command) in (ast.List, ast.Tuple) and command.elts:
                for item in ev.items(command.elts[0]):
                    commands.shell(item, line, strict=True, depth=0)
            return
        for seq in ev.seqs(command):
            if seq and seq[0][0] == "lit" and " " in seq[0][1] and len(seq) == 1:
                seq = [("lit", seq[0][1])]  # no shell: the whole string is the program
            _run_seq(seq, line, commands, out)
        return
    # exec families: the program is an argument of its own
    if any(type(a) is ast.Starred for a in args) and kind in ("execl", "spawnl"):
        out.fail(line, "runs a command given through *args")
        return
    if kind == "exec":
        for seq in ev._display(args, 0):
            _run_seq(seq, line, commands, out)
    elif kind in ("execl", "spawnl"):
        k = 0 if kind == "execl" else 1
        seq = [ev.items(args[k])[0] if len(args) > k else _OPAQUE] + [
            ev.items(a)[0] for a in args[k + 2 :]
        ]
        _run_seq(seq, line, commands, out)
    else:  # execv / spawnv / posix_spawn: (path, argv)
        k = 0 if kind == "execv" else 1
        program = ev.items(args[k]) if len(args) > k else [_OPAQUE]
        argv = ev.seqs(args[k + 1]) if len(args) > k + 1 else [[("splice", "opaque")]]
        for p in program:
            for a in argv:
                _run_seq([p, *a[1:]], line, commands, out)


def _item_or_splice(ev: _Eval, a: ast.expr) -> list[tuple]:
    if type(a) is ast.Starred:
        seqs = ev.seqs(a.value)
        if len(seqs) == 1:
            return seqs[0]
        return [("splice", "opaque")]
    found = ev.items(a)
    return [found[0]] if len(found) == 1 else [_OPAQUE]


def _run_seq(seq: list[tuple], line: int, commands: _Commands, out: Loaders) -> None:
    if not seq:
        out.fail(line, "runs an empty or unknown command")
        return
    if seq[0] == ("splice", "opaque") or seq[0] == _OPAQUE:
        out.fail(line, "runs a program the planner cannot resolve")
        return
    commands.run(seq, line, strict=True)


def _group_call(call: ast.Call, kind: str, ev: _Eval, out: Loaders) -> None:
    keywords = {k.arg: k.value for k in call.keywords}
    args = call.args
    node: ast.expr | None
    if "group" in keywords:
        node = keywords["group"]
    elif kind == "group2":  # load_entry_point(dist, group, name)
        node = args[1] if len(args) > 1 else None
    elif _call_name(call.func).endswith("EntryPoint"):  # EntryPoint(name, value, group)
        node = args[2] if len(args) > 2 else None
    else:
        node = args[0] if args else None
    groups = ev.items(node) if node is not None else [_OPAQUE]  # no group: every group
    for g in groups:
        name = g[1] if g[0] == "lit" and "\x00F" not in g[1] else "*"
        out.imports.append(
            (f"entry-points:{name}", 0, (), call.lineno, "function", False, "entry-points")
        )


def _sys_path_target(node: ast.expr, aliases: _Aliases) -> bool:
    """Whether ``node`` is ``sys.path`` (through any alias)."""
    if type(node) is ast.Attribute and node.attr == "path":
        return aliases.module_of(node.value) == "sys"
    return type(node) is ast.Name and aliases.functions.get(node.id) == "path"


def _add_dirs(values: list[ast.expr], line: int, ev: _Eval, out: Loaders) -> None:
    for v in values:
        p = ev.path(v)
        encoded = _encode_dir(p) if p is not None else None
        if encoded is None:
            out.fail(line, "adds to sys.path a folder the planner cannot resolve")
        elif encoded != "tmp:":  # a temporary folder holds no file of the repository
            out.syspath.append(encoded)


def _dir_values(node: ast.expr, ev: _Eval) -> list[ast.expr] | None:
    if type(node) in (ast.List, ast.Tuple):
        if any(type(e) is ast.Starred for e in node.elts):
            return None
        return list(node.elts)
    if type(node) is ast.Name:
        found = ev._values(node.id)
        if found is not None and len(found[0]) == 1 and not found[1] and found[0][0] is not None:
            return _dir_values(found[0][0], ev)
    return None


def _syspath_call(call: ast.Call, ev: _Eval, aliases: _Aliases, out: Loaders) -> None:
    f = call.func
    line = call.lineno
    if type(f) is not ast.Attribute:
        if type(f) is ast.Name and aliases.functions.get(f.id) == "add":
            _add_dirs(call.args[:1], line, ev, out)
        return
    if f.attr == "syspath_prepend" or (
        f.attr == "addsitedir" and aliases.module_of(f.value) == "site"
    ):
        _add_dirs(call.args[:1], line, ev, out)
    elif _sys_path_target(f.value, aliases):
        if f.attr == "insert":
            _add_dirs(call.args[1:2], line, ev, out)
        elif f.attr == "append":
            _add_dirs(call.args[:1], line, ev, out)
        elif f.attr == "extend":
            values = _dir_values(call.args[0], ev) if call.args else None
            if values is None:
                out.fail(line, "extends sys.path with folders the planner cannot resolve")
            else:
                _add_dirs(values, line, ev, out)
        elif f.attr in ("__setitem__", "__iadd__"):
            out.fail(line, "edits sys.path in a way the planner cannot resolve")


def _is_path_copy(node: ast.expr, aliases: _Aliases) -> bool:
    """``list(sys.path)``, ``tuple(sys.path)``, ``sys.path[:]``, ``sys.path.copy()``,
    ``[*sys.path]``: a copy of the process's own ``sys.path`` (no folder of its own)."""
    t = type(node)
    if t is ast.Call:
        if _call_name(node.func) in ("list", "tuple") and len(node.args) == 1:
            return _sys_path_target(node.args[0], aliases)
        f = node.func
        return type(f) is ast.Attribute and f.attr == "copy" and _sys_path_target(f.value, aliases)
    if t is ast.Subscript:
        return type(node.slice) is ast.Slice and _sys_path_target(node.value, aliases)
    if t is ast.List and len(node.elts) == 1 and type(node.elts[0]) is ast.Starred:
        return _sys_path_target(node.elts[0].value, aliases)
    return False


def _saved_path(node: ast.expr, ev: _Eval, aliases: _Aliases, tree_keys: dict) -> bool:
    """Whether ``node`` is a saved copy of ``sys.path`` (restoring it adds no folder): a copy, a
    name bound only to copies, or ``X["key"]`` where the file stores a copy under ``"key"`` (a
    dict display or a keyword argument) and nothing else."""
    if _is_path_copy(node, aliases):
        return True
    if type(node) is ast.Name:
        found = ev._values(node.id)
        return (
            found is not None
            and bool(found[0])
            and all(v is not None and _is_path_copy(v, aliases) for v in found[0])
        )
    if type(node) is ast.Subscript and type(node.slice) is ast.Constant:
        stored = tree_keys.get(node.slice.value)
        return bool(stored) and all(_is_path_copy(v, aliases) for v in stored)
    return False


def _stored_values(tree: ast.Module) -> dict[object, list[ast.expr]]:
    """``{key: values}`` stored under a constant key anywhere in the file (dict displays and
    keyword arguments)."""
    out: dict[object, list[ast.expr]] = {}
    for n in ast.walk(tree):
        if type(n) is ast.Dict:
            for k, v in zip(n.keys, n.values, strict=True):
                if k is not None and type(k) is ast.Constant:
                    out.setdefault(k.value, []).append(v)
        elif type(n) is ast.keyword and n.arg is not None:
            out.setdefault(n.arg, []).append(n.value)
    return out


def _syspath_assign(
    node: ast.stmt, ev: _Eval, aliases: _Aliases, out: Loaders, stored: dict
) -> None:
    targets = node.targets if type(node) is ast.Assign else [node.target]
    for target in targets:
        base = target.value if type(target) is ast.Subscript else target
        if not _sys_path_target(base, aliases) or node.value is None:
            continue
        value = node.value
        if _saved_path(value, ev, aliases, stored):
            continue  # restores a saved sys.path: no folder of its own
        values: list[ast.expr] | None = None
        if type(value) is ast.BinOp and type(value.op) is ast.Add:
            parts = [value.left, value.right]
            values = []
            for p in parts:
                if _sys_path_target(p, aliases):
                    continue
                found = _dir_values(p, ev)
                if found is None:
                    values = None
                    break
                values += found
        else:
            values = _dir_values(value, ev)
        if values is None:
            out.fail(node.lineno, "assigns sys.path a value the planner cannot resolve")
        else:
            _add_dirs(values, node.lineno, ev, out)


def _pytest_plugins(node: ast.stmt, ev: _Eval, out: Loaders) -> None:
    if type(node) is ast.AugAssign or node.value is None:
        return
    targets = node.targets if type(node) is ast.Assign else [node.target]
    if not any(type(t) is ast.Name and t.id == "pytest_plugins" for t in targets):
        return
    value = node.value
    elts = [value] if type(value) is ast.Constant else getattr(value, "elts", None)
    names = [e.value for e in elts or () if type(e) is ast.Constant and type(e.value) is str]
    if elts is None or len(names) != len(elts):
        out.fail(node.lineno, "sets pytest_plugins to a value the planner cannot resolve")
        return
    for n in names:
        out.imports.append((n, 0, (), node.lineno, "module", False, "pytest_plugins"))


def resolve_dir(encoded: str, file: str) -> str | None:
    """The root-relative folder of a ``syspath`` entry of the file ``file`` (root-relative);
    None when it leaves the repository."""
    anchor, _, rel = encoded.partition(":")
    base = file.rpartition("/")[0] if anchor == "file" else ""
    joined = posixpath.normpath(posixpath.join(base, rel)) if base else posixpath.normpath(rel)
    if joined == ".":
        return ""
    if joined.startswith("../") or joined == ".." or os.path.isabs(joined):
        return None
    return joined
