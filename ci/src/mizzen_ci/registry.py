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
- Discovery walks the tree for ``test_*.py`` (skipping hidden, virtualenv and build directories and
  the ``exclude`` globs of ``[tool.mizzen.registry]`` in the root ``pyproject.toml``); such a file
  outside ``tests/`` is an error.
"""

from __future__ import annotations

import ast
import fnmatch
import inspect
import math
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

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
# Reading one file.


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
    if isinstance(node, ast.JoinedStr):
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


def _read_call(
    call: ast.Call, fname: str, rel: str, fleet: Fleet
) -> tuple[Registration | None, list[RegistryError]]:
    errors: list[RegistryError] = []

    def bad(rule: str, message: str, fix: str, line: int | None = None):
        errors.append(RegistryError(rel, line or call.lineno, rule, message, fix))

    positional, params = SIGNATURES[fname]
    given: dict[str, object] = {}
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
    return (
        Registration(
            path=rel,
            line=call.lineno,
            backend=backend,
            est_time=values["est_time"],
            labels=tuple(values["labels"]),
            nightly=values["nightly"],
            disabled=values["disabled"],
            hardware=tuple(values.get("hardware", ())),
            num_gpus=values.get("num_gpus", 0),
            needs=tuple(values.get("needs", ())),
        ),
        [],
    )


def read_source(
    source: bytes | str, rel: str, fleet: Fleet
) -> tuple[Registration | None, list[RegistryError]]:
    """Read the registration of one test file's source; never raises for bad input."""
    if not any(
        name in (source if isinstance(source, str) else source.decode("latin-1"))
        for name in REGISTER_FUNCTIONS
    ):
        return None, [
            RegistryError(
                rel,
                1,
                "no-registration",
                "test file has no registration",
                "add `from mizzen_ci import register_cpu_ci` and a module-level "
                "`register_cpu_ci(est_time=...)` (or register_cuda_ci for a GPU test)",
            )
        ]
    try:
        tree = ast.parse(source, filename=rel)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        return None, [
            RegistryError(
                rel,
                getattr(e, "lineno", None) or 1,
                "syntax",
                f"the file does not parse: {e.__class__.__name__}: {getattr(e, 'msg', e)}",
                "fix the syntax; the registry reads the file's syntax tree",
            )
        ]

    errors: list[RegistryError] = []
    module_calls: list[tuple[ast.Call, str]] = []
    allowed: set[int] = set()  # ids of Name/Attribute nodes that are fine (module-level call funcs)
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            name = _call_name(stmt.value.func)
            if name:
                module_calls.append((stmt.value, name))
                allowed.add(id(stmt.value.func))
                if isinstance(stmt.value.func, ast.Attribute):
                    allowed.add(id(stmt.value.func.value))

    try:
        nodes = list(ast.walk(tree))
    except RecursionError:
        nodes = []
    for node in nodes:
        if id(node) in allowed:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "mizzen_ci":
            for alias in node.names:
                if alias.name in REGISTER_FUNCTIONS and alias.asname not in (None, alias.name):
                    errors.append(
                        RegistryError(
                            rel,
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
            errors.append(
                RegistryError(
                    rel,
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
            errors.append(
                RegistryError(
                    rel,
                    call.lineno,
                    "multiple-registrations",
                    f"second registration (the first is on line {module_calls[0][0].lineno})",
                    "a file is either a CPU or a GPU test: keep one call, split the file",
                )
            )
    registration = None
    if module_calls:
        registration, call_errors = _read_call(*module_calls[0], rel, fleet)
        errors.extend(call_errors)
    elif not errors:
        errors.append(
            RegistryError(
                rel,
                1,
                "no-registration",
                "test file has no module-level registration",
                "add a module-level `register_cpu_ci(est_time=...)` or `register_cuda_ci(...)`",
            )
        )
    return (registration if not errors else None), errors


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


def discover(root: Path, excludes: Iterable[str] = ()) -> Iterator[str]:
    """Repository-relative paths of every ``test_*.py`` under ``root``, sorted."""
    excludes = tuple(excludes)
    found: list[str] = []
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        for p in entries:
            rel = p.relative_to(root).as_posix()
            if p.is_dir():
                if p.name.startswith(".") or p.name in SKIP_DIRS or p.name.endswith(".egg-info"):
                    continue
                if is_excluded(rel, excludes) or (p / "pyvenv.cfg").exists():
                    continue
                stack.append(p)
            elif (
                p.name.startswith("test_")
                and p.name.endswith(".py")
                and not is_excluded(rel, excludes)
            ):
                found.append(rel)
    yield from sorted(found)


def read_registry(root: Path, fleet: Fleet, paths: Iterable[str] | None = None) -> Registry:
    """Read every test file under ``root`` (or only ``paths``, repository-relative)."""
    root = root.resolve()
    registry = Registry(root)
    rels = list(paths) if paths is not None else list(discover(root, registry_excludes(root)))
    for rel in rels:
        parts = Path(rel).parts
        if not parts or parts[0] != TESTS_DIR:
            registry.errors.append(
                RegistryError(
                    rel,
                    1,
                    "outside-tests",
                    f"test file outside `{TESTS_DIR}/`",
                    f"move it under {TESTS_DIR}/ (mirrored by concern), or rename it if it is not a test",
                )
            )
            continue
        try:
            source = (root / rel).read_bytes()
        except OSError as e:
            registry.errors.append(
                RegistryError(rel, 1, "unreadable", str(e), "make the file readable")
            )
            continue
        registration, errors = read_source(source, rel, fleet)
        registry.errors.extend(errors)
        if registration is not None:
            registry.registrations.append(registration)
    return registry
