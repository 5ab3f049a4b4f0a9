"""The test registry: every ``tests/**/test_*.py`` declares itself with one module-level call.

The registry reads each test file's syntax tree; it never imports a test, so it runs on a bare
runner with nothing installed.

Invariants:
- The argument rules are derived from the signatures of :func:`mizzen_ci.register_cpu_ci` and
  :func:`mizzen_ci.register_cuda_ci` (names, defaults, keyword-only) plus one validator per field;
  the signatures are the contract, nothing restates them.
- Reading never raises for bad input: every problem becomes a :class:`RegistryError` naming
  ``file:line``, the rule broken and the fix, and all errors of a run are reported, not the first.
- A file has exactly one registration, a direct module-level call with literal arguments.
- Reading is two steps: :func:`registration_syntax` (what the syntax tree says: a pure function of
  the source, no path, no fleet; it takes a tree parsed by the caller, so a file is parsed once
  for everything the CI reads from it, and a content-hash cache may keep its plain-data result)
  and :func:`validate` (the rules that need the fleet, then the path attached).
  :func:`read_source` is both; the split changes no error and no order of errors.
- The nested/aliased-use scan walks the whole tree only when the source spells a register name
  more often than its top-level call and imports account for (or is not ASCII); otherwise no
  other node can name one, and the result is the same.
- Discovery walks the tree for ``test_*.py`` (skipping hidden, virtualenv and build directories and
  the ``exclude`` globs of ``[tool.mizzen.registry]`` in the root ``pyproject.toml``); such a file
  outside ``tests/`` is an error.
"""

from __future__ import annotations

import ast
import fnmatch
import inspect
import math
import os
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from . import register_cpu_ci, register_cuda_ci
from .fleet import Fleet

REGISTER_FUNCTIONS: dict[str, Callable[..., None]] = {
    "register_cpu_ci": register_cpu_ci,
    "register_cuda_ci": register_cuda_ci,
}
BACKEND_OF = {"register_cpu_ci": "cpu", "register_cuda_ci": "cuda"}
TESTS_DIR = "tests"
SKIP_DIRS = frozenset({"node_modules", "__pycache__", "build", "dist", "site-packages"})


@dataclass(frozen=True)
class RegistryError:
    """One broken rule: where, which rule, what is wrong and how to fix it."""

    path: str
    line: int
    rule: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}. Fix: {self.fix}"


@dataclass(frozen=True)
class Registration:
    """What one test file declared (defaults filled in from the register function's signature)."""

    path: str  # repository-relative, POSIX separators
    line: int
    backend: str  # "cpu" | "cuda"
    est_time: float
    labels: tuple[str, ...] = ()
    nightly: bool = False
    disabled: str | None = None
    hardware: tuple[str, ...] = ()
    num_gpus: int = 0
    needs: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.disabled is None

    @property
    def gpu_seconds(self) -> float:
        return self.est_time * max(self.num_gpus, 1)


@dataclass
class Registry:
    """The registrations and errors of one tree."""

    root: Path
    registrations: list[Registration] = field(default_factory=list)
    errors: list[RegistryError] = field(default_factory=list)

    def by_path(self) -> dict[str, Registration]:
        return {r.path: r for r in self.registrations}

    def errors_by_path(self) -> dict[str, list[RegistryError]]:
        out: dict[str, list[RegistryError]] = {}
        for e in self.errors:
            out.setdefault(e.path, []).append(e)
        return out


# --------------------------------------------------------------------------------------------
# Field validators: value -> (normalised value) or raise _Bad(rule, message, fix).


class _Bad(Exception):
    def __init__(self, rule: str, message: str, fix: str):
        super().__init__(message)
        self.rule, self.message, self.fix = rule, message, fix


def _strings(value, field_name: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _Bad(
            f"{field_name}-type",
            f"`{field_name}` must be a list of strings, got {value!r}",
            f'write `{field_name}=["..."]`',
        )
    dup = sorted({v for v in value if list(value).count(v) > 1})
    if dup:
        raise _Bad(
            f"{field_name}-duplicate",
            f"`{field_name}` lists {', '.join(dup)} more than once",
            "list each name once",
        )
    return tuple(value)


def _check_est_time(value, fleet: Fleet):
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Bad(
            "est-time",
            f"`est_time` must be a number of seconds, got {value!r}",
            "write the expected wall time in seconds, e.g. `est_time=30`",
        )
    if value <= 0:
        raise _Bad(
            "est-time",
            f"`est_time` must be positive, got {value!r}",
            "give the seconds the file takes",
        )
    return float(value)


def _check_labels(value, fleet: Fleet):
    labels = _strings(value, "labels")
    unknown = sorted(set(labels) - fleet.labels)
    if unknown:
        raise _Bad(
            "label-unknown",
            f"unknown label(s) {', '.join(unknown)}",
            f"use labels from `labels` in {fleet.path.name} ({', '.join(sorted(fleet.labels))}) "
            "or add the new label there",
        )
    return labels


def _check_nightly(value, fleet: Fleet):
    if not isinstance(value, bool):
        raise _Bad(
            "nightly-type",
            f"`nightly` must be True or False, got {value!r}",
            "write `nightly=True`",
        )
    return value


def _check_disabled(value, fleet: Fleet):
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _Bad(
            "disabled-reason",
            f"`disabled` must be a non-empty reason string, got {value!r}",
            'say why, e.g. `disabled="flaky on NCCL 2.27, issue #123"`, or remove it',
        )
    return value.strip()


def _check_hardware(value, fleet: Fleet):
    if isinstance(value, list | tuple) and not value:
        raise _Bad(
            "hardware-empty",
            "`hardware` is empty",
            f"list the GPU generations the test supports, from {', '.join(fleet.arch_names)}",
        )
    arches = _strings(value, "hardware")
    unknown = [a for a in arches if a not in fleet.arch_names]
    if unknown:
        raise _Bad(
            "hardware-unknown",
            f"unknown GPU generation(s) {', '.join(unknown)}",
            f"use generations from {fleet.path.name}: {', '.join(fleet.arch_names)} "
            "(a generation, not a SKU: hopper, not h100)",
        )
    return arches


def _check_num_gpus(value, fleet: Fleet):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Bad(
            "num-gpus",
            f"`num_gpus` must be a positive integer, got {value!r}",
            "write e.g. `num_gpus=2`",
        )
    return value


def _check_needs(value, fleet: Fleet):
    needs = _strings(value, "needs")
    unknown = sorted(set(needs) - fleet.capabilities)
    if unknown:
        raise _Bad(
            "needs-unknown",
            f"unknown capability(ies) {', '.join(unknown)}",
            f"use capabilities from {fleet.path.name}: {', '.join(sorted(fleet.capabilities))}",
        )
    return needs


VALIDATORS: dict[str, Callable] = {
    "est_time": _check_est_time,
    "labels": _check_labels,
    "nightly": _check_nightly,
    "disabled": _check_disabled,
    "hardware": _check_hardware,
    "num_gpus": _check_num_gpus,
    "needs": _check_needs,
}


def _signature_table(func: Callable) -> tuple[list[str], dict[str, object]]:
    """(positional-or-keyword names, {name: default or REQUIRED}) of a register function."""
    positional, params = [], {}
    for p in inspect.signature(func).parameters.values():
        if p.kind is p.POSITIONAL_OR_KEYWORD:
            positional.append(p.name)
        params[p.name] = _REQUIRED if p.default is p.empty else p.default
    return positional, params


_REQUIRED = object()
SIGNATURES = {name: _signature_table(f) for name, f in REGISTER_FUNCTIONS.items()}


# --------------------------------------------------------------------------------------------
# Reading one file: first what its syntax tree says (a pure function of the source, with no path
# and no fleet: what a content-hash cache keeps), then the rules that need the fleet.

Problem = tuple[int, str, str, str]  # (line, rule, message, fix): a RegistryError before its path
PARSE_ERRORS = (SyntaxError, ValueError, MemoryError, RecursionError)
_NAMES_STR = tuple(REGISTER_FUNCTIONS)
_NAMES_BYTES = tuple(n.encode() for n in REGISTER_FUNCTIONS)
assert all(n.startswith(b"register_c") for n in _NAMES_BYTES)  # see _walk_needed


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
            "`register_cpu_ci(est_time=...)` (or register_cuda_ci for a GPU test)",
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


def _literal(node: ast.expr, name: str) -> object:
    t = type(node)  # fast paths giving what ast.literal_eval gives for these nodes
    if t is ast.Constant:
        return node.value
    if t is ast.List and all(type(e) is ast.Constant for e in node.elts):
        return [e.value for e in node.elts]
    if t is ast.JoinedStr:
        raise _Bad("not-literal", f"`{name}` is an f-string", "write a plain literal")
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Bad(
            "not-literal",
            f"`{name}` is not a literal ({ast.dump(node)[:60]})",
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
            given[positional[i]] = (_literal(arg, positional[i]), arg.lineno)
        except _Bad as b:
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
                    "use register_cuda_ci(hardware=[...], ...) for a GPU test, or drop `hardware`",
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
            given[kw.arg] = (_literal(kw.value, kw.arg), kw.value.lineno)
        except _Bad as b:
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


def _validate_call(call, rel: str, fleet: Fleet) -> tuple[tuple | None, list[RegistryError]]:
    """The rules that need the fleet (and the path) over a :class:`CallSyntax`: the
    registration's field values in order (None on error) and the errors."""
    fname, call_line, given_items, unpacked, call_problems = call
    errors = [RegistryError(rel, *p) for p in call_problems]

    def bad(rule: str, message: str, fix: str, line: int | None = None):
        errors.append(RegistryError(rel, line or call_line, rule, message, fix))

    params = SIGNATURES[fname][1]
    given = {name: ((value, line) if ok else None) for name, value, line, ok in given_items}
    values: dict[str, object] = {}
    for name, default in params.items():
        if name not in given:
            if default is _REQUIRED and not unpacked:  # after * or ** the reader cannot know
                rule = "hardware-required" if name == "hardware" else "missing-argument"
                fix = (
                    f"add `hardware=[...]` with the GPU generations it supports ({', '.join(fleet.arch_names)})"
                    if name == "hardware"
                    else f"add `{name}=...`"
                )
                bad(rule, f"{fname} needs `{name}`", fix)
            elif default is not _REQUIRED:
                values[name] = default
            continue
        if given[name] is None:  # already reported
            continue
        value, line = given[name]
        try:
            values[name] = VALIDATORS[name](value, fleet)
        except _Bad as b:
            bad(b.rule, b.message, b.fix, line)

    backend = BACKEND_OF[fname]
    if backend == "cuda" and "labels" in values and not values["labels"]:
        bad(
            "labels-empty",
            "a GPU test needs at least one domain label",
            f"add a label from {fleet.path.name} so a PR can ask for it with run-ci-<label>",
        )
    if errors:
        return None, errors

    if backend == "cuda":
        arches, n, needs = values["hardware"], values["num_gpus"], set(values["needs"])
        largest = max(fleet.max_gpus(a) for a in arches)
        if largest == 0:
            bad(
                "no-pool",
                f"the fleet has no pool of {', '.join(arches)}",
                f"declare a generation the fleet has ({', '.join(fleet.arches_in_fleet())}) "
                f"or add a pool to {fleet.path.name}",
            )
        elif n > largest:
            bad(
                "num-gpus",
                f"`num_gpus={n}` but the largest runner of {', '.join(arches)} has {largest} GPU(s)",
                f"use at most {largest} GPUs, or add a larger pool to {fleet.path.name}",
            )
        elif not any(fleet.pool_for(a, n, needs) for a in arches):
            bad(
                "no-pool",
                f"no pool of {', '.join(arches)} has {n} GPU(s) with {', '.join(sorted(needs))}",
                f"drop a `needs` entry or add such a pool to {fleet.path.name}",
            )
        if errors:
            return None, errors
    return (  # Registration's fields, in order
        (
            rel,
            call_line,
            backend,
            values["est_time"],
            tuple(values["labels"]),
            values["nightly"],
            values["disabled"],
            tuple(values.get("hardware", ())),
            values.get("num_gpus", 0),
            tuple(values.get("needs", ())),
        ),
        [],
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
                "add a module-level `register_cpu_ci(est_time=...)` or `register_cuda_ci(...)`",
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
    # Both names start with "register_c": when that prefix is spelled no more often than the
    # statements account for, neither name is (one count instead of two, the common case).
    if source.count(b"register_c") == accounted:
        return False
    return sum(source.count(n) for n in _NAMES_BYTES) != accounted


def validate(syntax, rel: str, fleet: Fleet) -> tuple[Registration | None, list[RegistryError]]:
    """The registration of the file at ``rel`` from its :class:`RegistrationSyntax` (or its
    :meth:`~RegistrationSyntax.plain` form): the rules that need the fleet, then every error
    with ``rel`` attached.  A file with any error has no registration."""
    row, errors = validate_row(syntax, rel, fleet)
    return (Registration(*row) if row is not None else None), errors


def validate_row(syntax, rel: str, fleet: Fleet) -> tuple[tuple | None, list[RegistryError]]:
    """:func:`validate` with the registration as its field values in order (plain data, for a
    cache: ``Registration(*row)`` is the registration)."""
    problems, call = syntax
    errors = [RegistryError(rel, *p) for p in problems]
    row = None
    if call is not None:
        row, call_errors = _validate_call(call, rel, fleet)
        errors.extend(call_errors)
    return (row if not errors else None), errors


def unreadable(e: OSError) -> RegistrationSyntax:
    """What the registry says of a test file it cannot read."""
    return RegistrationSyntax(((1, "unreadable", str(e), "make the file readable"),), None)


def read_source(
    source: bytes | str, rel: str, fleet: Fleet
) -> tuple[Registration | None, list[RegistryError]]:
    """Read the registration of one test file's source; never raises for bad input."""
    return validate(registration_syntax(source), rel, fleet)


# --------------------------------------------------------------------------------------------
# Discovery over a tree.


def registry_excludes(root: Path) -> tuple[str, ...]:
    """The ``exclude`` globs of ``[tool.mizzen.registry]`` in ``root/pyproject.toml``."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return ()
    with pyproject.open("rb") as f:
        data = tomllib.load(f)
    return tuple(data.get("tool", {}).get("mizzen", {}).get("registry", {}).get("exclude", ()))


def is_excluded(rel: str, excludes: Iterable[str]) -> bool:
    return any(
        rel == pat or fnmatch.fnmatch(rel, pat) or rel.startswith(pat.rstrip("/") + "/")
        for pat in excludes
    )


def discover(root: Path, excludes: Iterable[str] = ()) -> list[str]:
    """Repository-relative paths of every ``test_*.py`` under ``root``, sorted.

    Skipped: hidden directories, :data:`SKIP_DIRS`, ``*.egg-info``, virtual environments (a
    directory holding ``pyvenv.cfg``) and the ``excludes`` globs.  Walked with ``os.scandir`` on
    strings (pathlib costs a second on a tree of 15,000 files)."""
    excludes = tuple(excludes)
    found: list[str] = []
    stack = [(os.fspath(root), "")]
    while stack:
        path, rel_dir = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for e in entries:
            name = e.name
            rel = rel_dir + name
            if e.is_dir():
                if name.startswith(".") or name in SKIP_DIRS or name.endswith(".egg-info"):
                    continue
                if (excludes and is_excluded(rel, excludes)) or os.path.exists(
                    os.path.join(e.path, "pyvenv.cfg")
                ):
                    continue
                stack.append((e.path, rel + "/"))
            elif (
                name.startswith("test_")
                and name.endswith(".py")
                and not (excludes and is_excluded(rel, excludes))
            ):
                found.append(rel)
    found.sort()
    return found


def outside_tests(rel: str) -> RegistryError:
    """The error for a discovered test file that is not under ``tests/``."""
    return RegistryError(
        rel,
        1,
        "outside-tests",
        f"test file outside `{TESTS_DIR}/`",
        f"move it under {TESTS_DIR}/ (mirrored by concern), or rename it if it is not a test",
    )


def read_registry(root: Path, fleet: Fleet, paths: Iterable[str] | None = None) -> Registry:
    """Read every test file under ``root`` (or only ``paths``, repository-relative)."""
    root = root.resolve()
    registry = Registry(root)
    rels = list(paths) if paths is not None else list(discover(root, registry_excludes(root)))
    for rel in rels:
        parts = Path(rel).parts
        if not parts or parts[0] != TESTS_DIR:
            registry.errors.append(outside_tests(rel))
            continue
        try:
            source = (root / rel).read_bytes()
        except OSError as e:
            registry.errors.extend(validate(unreadable(e), rel, fleet)[1])
            continue
        registration, errors = read_source(source, rel, fleet)
        registry.errors.extend(errors)
        if registration is not None:
            registry.registrations.append(registration)
    return registry
