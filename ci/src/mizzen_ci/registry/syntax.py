"""What a test file's syntax tree says about its registration (the registry never imports a test).

Invariants:
- The argument rules are derived from the signatures of :func:`mizzen_ci.register_cpu_ci`,
  :func:`mizzen_ci.register_cuda_ci` and :func:`mizzen_ci.register_gpu_ci` (names, defaults,
  keyword-only): the signatures are the contract, nothing restates them.  Which vendors each GPU
  function accepts is :data:`VENDORS_OF` (checked by :mod:`.rules`).  The value rules that need the fleet are
  :mod:`mizzen_ci.registry.rules`.
- :func:`registration_syntax` is a pure function of the source (no path, no fleet); it takes a
  tree parsed by the caller, so a file is parsed once for everything the CI reads from it, and a
  content-hash cache may keep its plain-data result (:meth:`RegistrationSyntax.plain`).
- Reading never raises for bad input: every problem becomes a ``(line, rule, message, fix)``
  tuple, all of them in the order the reader finds them.
- A file has exactly one registration, a direct module-level call with literal arguments.
- The nested/aliased-use scan walks the whole tree only when the source spells a register name
  more often than its top-level call and imports account for (or is not ASCII); otherwise no
  other node can name one, and the result is the same.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import NamedTuple

from .. import register_cpu_ci, register_cuda_ci, register_gpu_ci
from ..fleet import NVIDIA
from ..sources import PARSE_ERRORS, RefusedFile
from .model import Backend, RuleBroken

REGISTER_FUNCTIONS: dict[str, Callable[..., None]] = {
    "register_cpu_ci": register_cpu_ci,
    "register_cuda_ci": register_cuda_ci,
    "register_gpu_ci": register_gpu_ci,
}
BACKEND_OF = {
    "register_cpu_ci": Backend.CPU,
    "register_cuda_ci": Backend.CUDA,
    "register_gpu_ci": Backend.GPU,
}
# The vendors whose generations a GPU register function may declare (None: any vendor).
VENDORS_OF: dict[str, tuple[str, ...] | None] = {
    "register_cuda_ci": (NVIDIA.name,),
    "register_gpu_ci": None,
}


def signature_table(func: Callable) -> tuple[list[str], dict[str, object]]:
    """(positional-or-keyword names, {name: default or REQUIRED}) of a register function."""
    positional, params = [], {}
    for p in inspect.signature(func).parameters.values():
        if p.kind is p.POSITIONAL_OR_KEYWORD:
            positional.append(p.name)
        params[p.name] = REQUIRED if p.default is p.empty else p.default
    return positional, params


REQUIRED = object()
SIGNATURES = {name: signature_table(f) for name, f in REGISTER_FUNCTIONS.items()}


# --------------------------------------------------------------------------------------------
# Reading one file's syntax tree (a pure function of the source: what a content-hash cache keeps).

Problem = tuple[int, str, str, str]  # (line, rule, message, fix): a Violation before its path
_NAMES_STR = tuple(REGISTER_FUNCTIONS)
_NAMES_BYTES = tuple(n.encode() for n in REGISTER_FUNCTIONS)
# Distinct 10-byte prefixes of the names (b"register_c", b"register_g"): see _walk_needed
_PREFIXES = tuple(sorted({n[:10] for n in _NAMES_BYTES}))
assert all(n.startswith(_PREFIXES) for n in _NAMES_BYTES)


class CallSyntax(NamedTuple):
    """The first module-level register call, as written (values are literals, not yet checked).

    ``given`` holds ``(name, value, line, ok)`` per argument in source order; ``ok`` is False when
    the argument was already reported (not a literal, unknown, duplicated).  ``problems`` are those
    reports, in the order the reader makes them."""

    function: str
    line: int
    given: tuple[tuple[str, object, int, bool], ...]
    unpacked: bool  # a ``*`` or ``**`` argument: the reader cannot know what is missing
    problems: tuple[Problem, ...]


class RegistrationSyntax(NamedTuple):
    """What a file's syntax tree says about its registration: the structural problems (no
    registration, syntax, aliased or nested use, a second call) and the first module-level call.
    Plain data (tuples of literals) so that a cache can keep it by content hash."""

    problems: tuple[Problem, ...]
    call: CallSyntax | None

    def plain(self) -> tuple:
        """The same data as plain tuples (for ``marshal``); :func:`validate` accepts either."""
        return (self.problems, None if self.call is None else tuple(self.call))


NO_REGISTRATION = RegistrationSyntax(
    (
        (
            1,
            "no-registration",
            "test file has no registration",
            "add `from mizzen_ci import register_cpu_ci` and a module-level "
            "`register_cpu_ci(est_time=...)` (or register_gpu_ci for a GPU test)",
        ),
    ),
    None,
)


def _call_name(func: ast.expr) -> str | None:
    """``register_x_ci`` for ``register_x_ci(...)`` and ``mizzen_ci.register_x_ci(...)``."""
    if isinstance(func, ast.Name) and func.id in REGISTER_FUNCTIONS:
        return func.id
    if (
        isinstance(func, ast.Attribute)
        and func.attr in REGISTER_FUNCTIONS
        and isinstance(func.value, ast.Name)
        and func.value.id == "mizzen_ci"
    ):
        return func.attr
    return None


def literal_value(node: ast.expr, name: str) -> object:
    t = type(node)  # fast paths giving what ast.literal_eval gives for these nodes
    if t is ast.Constant:
        return node.value
    if t is ast.List and all(type(e) is ast.Constant for e in node.elts):
        return [e.value for e in node.elts]
    if t is ast.JoinedStr:
        raise RuleBroken("not-literal", f"`{name}` is an f-string", "write a plain literal")
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise RuleBroken(
            "not-literal",
            f"`{name}` is not a literal (a {type(node).__name__} expression)",
            "write the value itself (numbers, strings, lists, True/False/None); the registry "
            "reads it without running the file",
        ) from None


def _call_syntax(call: ast.Call, fname: str) -> CallSyntax:
    """The arguments of one register call as written, with the problems visible in syntax."""
    problems: list[Problem] = []

    def bad(rule: str, message: str, fix: str, line: int | None = None):
        problems.append((line or call.lineno, rule, message, fix))

    positional, params = SIGNATURES[fname]
    given: dict[str, tuple[object, int] | None] = {}
    unpacked = any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    )
    if len(call.args) > len(positional):
        bad(
            "too-many-positional",
            f"{fname} takes {len(positional)} positional argument(s), got {len(call.args)}",
            f"pass everything after {', '.join(positional)} by keyword",
        )
    for i, arg in enumerate(call.args[: len(positional)]):
        if isinstance(arg, ast.Starred):
            bad("not-literal", "starred argument (*args)", "write each argument out", arg.lineno)
            continue
        try:
            given[positional[i]] = (literal_value(arg, positional[i]), arg.lineno)
        except RuleBroken as b:
            bad(b.rule, b.message, b.fix, arg.lineno)
            given[positional[i]] = None
    for kw in call.keywords:
        if kw.arg is None:
            bad("not-literal", "`**` argument", "write each keyword argument out", kw.value.lineno)
            continue
        if kw.arg in given:
            bad("duplicate-argument", f"`{kw.arg}` is given twice", "give it once", kw.value.lineno)
            continue
        if kw.arg not in params:
            if fname == "register_cpu_ci" and kw.arg == "hardware":
                bad(
                    "hardware-on-cpu",
                    "`hardware` on a CPU registration",
                    "use register_gpu_ci(hardware=[...], ...) for a GPU test, or drop `hardware`",
                    kw.value.lineno,
                )
            else:
                bad(
                    "unknown-argument",
                    f"{fname} has no argument `{kw.arg}`",
                    f"use only {', '.join(params)}",
                    kw.value.lineno,
                )
            given[kw.arg] = None
            continue
        try:
            given[kw.arg] = (literal_value(kw.value, kw.arg), kw.value.lineno)
        except RuleBroken as b:
            bad(b.rule, b.message, b.fix, kw.value.lineno)
            given[kw.arg] = None
    return CallSyntax(
        fname,
        call.lineno,
        tuple(
            (name, v[0], v[1], True) if v is not None else (name, None, 0, False)
            for name, v in given.items()
        ),
        unpacked,
        tuple(problems),
    )


def _mentions_register(source: bytes | str) -> bool:
    names = _NAMES_STR if isinstance(source, str) else _NAMES_BYTES
    return any(name in source for name in names)


def registration_syntax(
    source: bytes | str,
    tree: ast.Module | None = None,
    parse_error: BaseException | None = None,
) -> RegistrationSyntax:
    """What ``source`` declares, from its syntax tree; never raises for bad input.

    A caller that parsed the source already passes ``tree`` (or the ``parse_error`` that parsing
    raised, one of :data:`PARSE_ERRORS`) so that each file is parsed once; otherwise it is parsed
    here.  A source that never spells a register function is reported without being parsed."""
    if not _mentions_register(source):
        return NO_REGISTRATION
    if tree is None and parse_error is None:
        try:
            tree = ast.parse(source)
        except PARSE_ERRORS as e:
            parse_error = e
    if parse_error is not None:
        e = parse_error
        return RegistrationSyntax(
            (
                (
                    getattr(e, "lineno", None) or 1,
                    "syntax",
                    f"the file does not parse: {e.__class__.__name__}: {getattr(e, 'msg', e)}",
                    "fix the syntax; the registry reads the file's syntax tree",
                ),
            ),
            None,
        )
    return _tree_syntax(tree, source)


def _tree_syntax(
    tree: ast.Module, source: bytes | str, walk: bool | None = None
) -> RegistrationSyntax:
    problems: list[Problem] = []
    module_calls: list[tuple[ast.Call, str]] = []
    allowed: set[int] = set()  # ids of Name/Attribute nodes that are fine (module-level call funcs)
    accounted = 0  # spellings of a register name that these top-level statements explain
    top_imports: list[ast.ImportFrom] = []
    for stmt in tree.body:  # (parser-made nodes: exact type checks are isinstance checks)
        t = type(stmt)
        if t is ast.Expr:
            call = stmt.value
            if type(call) is ast.Call:
                name = _call_name(call.func)
                if name:
                    module_calls.append((call, name))
                    allowed.add(id(call.func))
                    if type(call.func) is ast.Attribute:
                        allowed.add(id(call.func.value))
                    accounted += 1
        elif t is ast.ImportFrom:
            top_imports.append(stmt)
            if stmt.module == "mizzen_ci":
                for alias in stmt.names:
                    accounted += (alias.name in REGISTER_FUNCTIONS) + (
                        alias.asname in REGISTER_FUNCTIONS
                    )

    if walk is None:
        walk = _walk_needed(source, accounted)
    if walk:
        try:
            nodes = list(ast.walk(tree))
        except RecursionError:
            nodes = []
    else:
        # Every spelling of a register name is one of the statements above, so no other node
        # can mention one: only the top-level imports can break a rule (same order as a walk).
        nodes = top_imports
    for node in nodes:
        if id(node) in allowed:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "mizzen_ci":
            for alias in node.names:
                if alias.name in REGISTER_FUNCTIONS and alias.asname not in (None, alias.name):
                    problems.append(
                        (
                            node.lineno,
                            "aliased-call",
                            f"{alias.name} is imported as `{alias.asname}`",
                            f"import it under its own name and call `{alias.name}(...)` at module level",
                        )
                    )
            continue
        mention = (isinstance(node, ast.Name) and node.id in REGISTER_FUNCTIONS) or (
            isinstance(node, ast.Attribute) and node.attr in REGISTER_FUNCTIONS
        )
        if mention:
            problems.append(
                (
                    node.lineno,
                    "nested-call",
                    f"`{getattr(node, 'id', None) or node.attr}` is used other than as a direct "
                    "module-level call (inside a function, class, condition, or aliased)",
                    "call it once at the top level of the file with literal arguments; the "
                    "registry only reads module-level calls",
                )
            )

    if len(module_calls) > 1:
        for call, _ in module_calls[1:]:
            problems.append(
                (
                    call.lineno,
                    "multiple-registrations",
                    f"second registration (the first is on line {module_calls[0][0].lineno})",
                    "a file is either a CPU or a GPU test: keep one call, split the file",
                )
            )
    call_syntax = None
    if module_calls:
        call_syntax = _call_syntax(*module_calls[0])
    elif not problems:
        problems.append(
            (
                1,
                "no-registration",
                "test file has no module-level registration",
                "add a module-level `register_cpu_ci(est_time=...)` or `register_gpu_ci(...)`",
            )
        )
    return RegistrationSyntax(tuple(problems), call_syntax)


def _walk_needed(source: bytes | str, accounted: int) -> bool:
    """Whether a full walk of the tree could find more than the top-level statements did: only
    when the source spells a register name more often than those statements explain (each AST
    name is spelled in the source; a non-ASCII source may spell one through NFKC folding, so it
    is always walked)."""
    if not source.isascii():
        return True
    if isinstance(source, str):
        return sum(source.count(n) for n in _NAMES_STR) != accounted
    # Every name starts with one of _PREFIXES: when those are spelled no more often than the
    # statements account for, no name is (two counts instead of three, the common case).
    if sum(source.count(p) for p in _PREFIXES) == accounted:
        return False
    return sum(source.count(n) for n in _NAMES_BYTES) != accounted


def unreadable(e: OSError) -> RegistrationSyntax:
    """What the registry says of a test file it cannot read (or refuses to:
    :class:`~mizzen_ci.sources.RefusedFile` says what the file is and the fix)."""
    if isinstance(e, RefusedFile):
        return RegistrationSyntax(((1, "unreadable", f"{e.strerror}", e.fix),), None)
    return RegistrationSyntax(((1, "unreadable", str(e), "make the file readable"),), None)
