"""What ``register_ci_gate(...)`` calls a test file declares, read from its syntax tree.

Invariants:
- The argument rules are derived from the signature of :func:`mizzen_ci.register_ci_gate`
  (names, defaults, keyword-only) through the registry's own signature table and literal reader
  (:mod:`mizzen_ci.registry.syntax`): nothing restates them.  The file is never imported.
- A file declares zero or more gates, each a direct module-level call with literal keyword
  arguments, one per metric.  A call anywhere else (inside a function, a condition, through an
  alias) is an error: the gate would silently not exist.
- Reading never raises for bad input: every problem is a
  :class:`~mizzen_ci.registry.model.Violation` naming ``file:line``, the rule and the fix; all of
  a file's problems are reported, and a file with any problem contributes no gate.
- Bounds: ``tolerance`` is a fraction from 0 to :data:`MAX_TOLERANCE`, ``floor`` an absolute
  width from 0 to :data:`MAX_FLOOR`, not both 0 (a band of width 0 fails on any noise); ``steps``
  is ``"last"``, ``"all"`` or 1-:data:`MAX_STEPS` distinct integers from 0 to :data:`MAX_STEP`;
  ``metric`` is a name of ``ci/metrics.toml``; ``enforce=False`` needs a ``reason``.
- A change cannot weaken its own gates: :func:`held_to_base` judges a pull request (or a merge
  group) by the gates its base revision declares for every file the base has (a gate the change
  loosens, un-enforces or deletes still applies as the base wrote it, and the result says so); a
  gate the change adds for a metric the base's file does not gate applies as written.
- Only files whose bytes spell ``register_ci_gate`` are parsed; the tree is walked for nested
  uses only when the name is spelled more often than the top-level calls and imports explain.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .. import register_ci_gate
from ..registry.discover import TESTS_DIR, discover, registry_excludes
from ..registry.model import RuleBroken, Violation
from ..registry.rules import MAX_REASON_CHARS, bound_arguments, shown
from ..registry.syntax import literal_value, signature_table
from ..sources import PARSE_ERRORS, read_bytes
from .vocabulary import Vocabulary

GATE_FUNCTION = "register_ci_gate"
_NAME_BYTES = GATE_FUNCTION.encode()
_POSITIONAL, PARAMS = signature_table(register_ci_gate)
DIRECTIONS = ("lower", "higher", "both")
STEP_WORDS = ("last", "all")
MAX_TOLERANCE = 10.0  # a band of 1000 % of the reference gates nothing
MAX_FLOOR = 1e15
MAX_STEP = 10**9
MAX_STEPS = 100


@dataclass(frozen=True)
class Gate:
    """One declared gate of one test file (defaults filled in)."""

    test: str
    line: int
    metric: str
    direction: str
    tolerance: float
    steps: str | tuple[int, ...] = "last"
    floor: float = 0.0
    enforce: bool = True
    reason: str | None = None

    def steps_text(self) -> str:
        return self.steps if isinstance(self.steps, str) else ",".join(map(str, self.steps))


@dataclass
class Declarations:
    """The gates of a tree, by test file, and every declaration error."""

    gates: dict[str, list[Gate]] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Field rules


def _number(value, name: str, lo: float, hi: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RuleBroken(f"gate-{name}", f"`{name}` must be a number, got {shown(value)}", fix)
    # compared before any conversion: a huge integer never becomes a float, nan never passes
    if (isinstance(value, float) and not math.isfinite(value)) or not lo <= value <= hi:
        raise RuleBroken(
            f"gate-{name}", f"`{name}` must be from {lo:g} to {hi:g}, got {shown(value)}", fix
        )
    return float(value)


def _check_metric(value, vocabulary: Vocabulary) -> str:
    if not isinstance(value, str):
        raise RuleBroken(
            "gate-metric", f"`metric` must be a string, got {shown(value)}", 'write metric="..."'
        )
    if value not in vocabulary:
        raise RuleBroken(
            "gate-metric-unknown", f"unknown metric {shown(value)}", vocabulary.unknown_fix()
        )
    return value


def _check_direction(value, vocabulary: Vocabulary) -> str:
    if value not in DIRECTIONS:
        raise RuleBroken(
            "gate-direction",
            f"`direction` must be one of {', '.join(map(repr, DIRECTIONS))}, got {shown(value)}",
            'say which way is better: "lower" for a loss, "higher" for a score, "both" for a '
            "value that must not drift",
        )
    return value


def _check_tolerance(value, vocabulary: Vocabulary) -> float:
    return _number(
        value,
        "tolerance",
        0.0,
        MAX_TOLERANCE,
        "give the band as a fraction of the reference, e.g. `tolerance=0.1` for 10 %",
    )


def _check_floor(value, vocabulary: Vocabulary) -> float:
    return _number(
        value, "floor", 0.0, MAX_FLOOR, "give the smallest band in the metric's unit, e.g. 0.01"
    )


def _check_steps(value, vocabulary: Vocabulary) -> str | tuple[int, ...]:
    fix = 'write steps="last", steps="all" or a list of steps, e.g. steps=[20, 40, 60]'
    if isinstance(value, str):
        if value in STEP_WORDS:
            return value
        raise RuleBroken(
            "gate-steps", f"`steps` must be 'last', 'all' or a list, got {shown(value)}", fix
        )
    if not isinstance(value, list | tuple) or not value:
        raise RuleBroken("gate-steps", f"`steps` must be a non-empty list, got {shown(value)}", fix)
    if len(value) > MAX_STEPS:
        raise RuleBroken(
            "gate-steps", f"`steps` lists {len(value)} steps, over {MAX_STEPS}", 'use steps="all"'
        )
    if not all(type(s) is int and 0 <= s <= MAX_STEP for s in value):
        bad = next(s for s in value if not (type(s) is int and 0 <= s <= MAX_STEP))
        raise RuleBroken(
            "gate-steps", f"a step must be an integer from 0 to {MAX_STEP}, got {shown(bad)}", fix
        )
    if len(set(value)) != len(value):
        raise RuleBroken("gate-steps", "`steps` lists a step twice", "list each step once")
    return tuple(value)


def _check_enforce(value, vocabulary: Vocabulary) -> bool:
    if not isinstance(value, bool):
        raise RuleBroken(
            "gate-enforce",
            f"`enforce` must be True or False, got {shown(value)}",
            "write enforce=True",
        )
    return value


def _check_reason(value, vocabulary: Vocabulary) -> str | None:
    if value is None:
        return None
    fix = 'say why, e.g. reason="noisy on shared hosts, issue #12"'
    if not isinstance(value, str):
        raise RuleBroken(
            "gate-reason", f"`reason` must be a string or None, got {shown(value)}", fix
        )
    reason = value.strip()
    if not reason or not reason.isprintable() or len(reason) > MAX_REASON_CHARS:
        raise RuleBroken(
            "gate-reason",
            f"`reason` must be one printable line of 1-{MAX_REASON_CHARS} characters, got "
            f"{shown(value)}",
            fix,
        )
    return reason


VALIDATORS = {
    "metric": _check_metric,
    "direction": _check_direction,
    "tolerance": _check_tolerance,
    "steps": _check_steps,
    "floor": _check_floor,
    "enforce": _check_enforce,
    "reason": _check_reason,
}
assert set(VALIDATORS) == set(PARAMS), "one rule per argument of register_ci_gate"


# --------------------------------------------------------------------------------------------
# One file


def _gate_call_name(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id == GATE_FUNCTION
    return (
        isinstance(func, ast.Attribute)
        and func.attr == GATE_FUNCTION
        and isinstance(func.value, ast.Name)
        and func.value.id == "mizzen_ci"
    )


def _read_call(
    call: ast.Call, rel: str, vocabulary: Vocabulary
) -> tuple[Gate | None, list[Violation]]:
    errors: list[Violation] = []

    def bad(rule: str, message: str, fix: str, line: int | None = None) -> None:
        errors.append(Violation(rel, line or call.lineno, rule, message, fix))

    if call.args:
        bad(
            "gate-positional",
            f"{GATE_FUNCTION} takes keyword arguments only, got {len(call.args)} positional",
            'write each argument as name=value, e.g. metric="eval/score"',
        )
    given: dict[str, tuple[object, int] | None] = {}  # None: unreadable (reported)
    unpacked = False
    for kw in call.keywords:
        line = kw.value.lineno
        if kw.arg is None:
            unpacked = True
            bad("not-literal", "`**` argument", "write each keyword argument out", line)
            continue
        if kw.arg in given:
            bad("duplicate-argument", f"`{kw.arg}` is given twice", "give it once", line)
            continue
        if kw.arg not in PARAMS:
            bad(
                "unknown-argument",
                f"{GATE_FUNCTION} has no argument `{kw.arg}`",
                f"use only {', '.join(PARAMS)}",
                line,
            )
            given[kw.arg] = None
            continue
        try:
            given[kw.arg] = (literal_value(kw.value, kw.arg), line)
        except RuleBroken as b:
            bad(b.rule, b.message, b.fix, line)
            given[kw.arg] = None

    def missing(name: str) -> None:
        if not unpacked:
            bad("missing-argument", f"{GATE_FUNCTION} needs `{name}`", f"add `{name}=...`")

    values = bound_arguments(
        PARAMS, given, lambda name, value: VALIDATORS[name](value, vocabulary), bad, missing
    )
    if not errors:
        if values["tolerance"] == 0 and values["floor"] == 0:
            bad(
                "gate-band-zero",
                "`tolerance` and `floor` are both 0: a band of width 0 fails on any noise",
                "give a tolerance (a fraction of the reference) or a floor (an absolute width)",
            )
        if not values["enforce"] and values["reason"] is None:
            bad(
                "gate-reason",
                "`enforce=False` without a `reason`",
                'say why the gate only warns, e.g. reason="noisy on shared hosts, issue #12"',
            )
    if errors:
        return None, errors
    return Gate(rel, call.lineno, **values), []


def file_gates(
    source: bytes | str, rel: str, vocabulary: Vocabulary
) -> tuple[list[Gate], list[Violation]]:
    """The gates ``source`` (the test file ``rel``) declares, and its declaration errors; never
    raises for bad input.  A source that does not parse has no gate (the registry reports it)."""
    spelled = source.count(_NAME_BYTES if isinstance(source, bytes) else GATE_FUNCTION)
    if not spelled:
        return [], []
    try:
        tree = ast.parse(source)
    except PARSE_ERRORS:
        return [], []
    errors: list[Violation] = []
    calls: list[ast.Call] = []
    allowed: set[int] = set()
    accounted = 0
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            if _gate_call_name(stmt.value.func):
                calls.append(stmt.value)
                allowed.add(id(stmt.value.func))
                accounted += 1
        elif isinstance(stmt, ast.ImportFrom) and stmt.module == "mizzen_ci":
            for alias in stmt.names:
                if GATE_FUNCTION in (alias.name, alias.asname) and alias.asname in (
                    None,
                    alias.name,
                ):
                    accounted += 1  # an aliased import is not accounted for: the walk reports it
    if spelled != accounted or not source.isascii():
        try:
            nodes = list(ast.walk(tree))
        except RecursionError:
            nodes = []
        for node in nodes:
            if id(node) in allowed:
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "mizzen_ci":
                for alias in node.names:
                    if alias.name == GATE_FUNCTION and alias.asname not in (None, GATE_FUNCTION):
                        errors.append(
                            Violation(
                                rel,
                                node.lineno,
                                "gate-aliased",
                                f"{GATE_FUNCTION} is imported as `{alias.asname}`",
                                f"import it under its own name and call `{GATE_FUNCTION}(...)` "
                                "at module level",
                            )
                        )
                continue
            if (isinstance(node, ast.Name) and node.id == GATE_FUNCTION) or (
                isinstance(node, ast.Attribute) and node.attr == GATE_FUNCTION
            ):
                errors.append(
                    Violation(
                        rel,
                        node.lineno,
                        "gate-nested",
                        f"`{GATE_FUNCTION}` is used other than as a direct module-level call "
                        "(inside a function, class or condition, or aliased)",
                        "call it at the top level of the file with literal arguments; the gate "
                        "reads module-level calls only",
                    )
                )
    gates: list[Gate] = []
    first_line: dict[str, int] = {}
    for call in calls:
        gate, call_errors = _read_call(call, rel, vocabulary)
        errors.extend(call_errors)
        if gate is None:
            continue
        if gate.metric in first_line:
            errors.append(
                Violation(
                    rel,
                    gate.line,
                    "gate-duplicate",
                    f"a second gate on {shown(gate.metric)} (the first is on line "
                    f"{first_line[gate.metric]})",
                    "keep one gate per metric; list several steps with steps=[...]",
                )
            )
            continue
        first_line[gate.metric] = gate.line
        gates.append(gate)
    return ([] if errors else gates), errors


# --------------------------------------------------------------------------------------------
# A tree


def read_declarations(
    root: Path, vocabulary: Vocabulary, paths: Iterable[str] | None = None
) -> Declarations:
    """The gates of every test file of the tree at ``root`` (or of ``paths``), found by the
    registry's walk; never raises for bad input (an unreadable file is the registry's error)."""
    root = Path(root)
    if paths is None:
        paths = discover(root, registry_excludes(root)).test_files
    found = Declarations()
    for rel in paths:
        if not rel.startswith(TESTS_DIR + "/"):
            continue
        try:
            source, _ = read_bytes(root / rel)
        except OSError:
            continue  # the registry reports it (unreadable, a link, too large)
        gates, violations = file_gates(source, rel, vocabulary)
        found.violations.extend(violations)
        if gates:
            found.gates[rel] = gates
    return found


MAX_BASE_FILES = 10_000  # test files with gates read from a base revision


def held_to_base(
    root: Path, rev: str, vocabulary: Vocabulary, tree: Declarations
) -> tuple[Declarations, list[str]]:
    """The gates to judge a change by: ``tree``'s (the change's), with every gate of a file the
    base revision ``rev`` declares taken from the base instead; ``(declarations, notes)``, a note
    for each gate the change altered or dropped.  The base's own declaration errors are not the
    change's (the base was checked when it landed): such a file keeps the change's gates.
    :class:`~mizzen_ci.plan.change.GitError` when the revision cannot be read."""
    from ..plan.change import GitError, file_at, files_containing

    held = Declarations(dict(tree.gates), list(tree.violations))
    notes: list[str] = []
    paths = files_containing(root, rev, GATE_FUNCTION, TESTS_DIR)
    for rel in sorted(paths)[:MAX_BASE_FILES]:
        if not rel.endswith(".py"):
            continue
        try:
            source = file_at(root, rev, rel)
        except GitError:
            continue  # not UTF-8 at the base: it declared nothing readable
        base_gates, violations = file_gates(source, rel, vocabulary)
        if violations or not base_gates:
            continue
        base_by_metric = {g.metric: g for g in base_gates}
        mine = {g.metric: g for g in tree.gates.get(rel, [])}
        for metric, gate in base_by_metric.items():
            if metric not in mine:
                notes.append(f"{rel}: the change drops the gate on {metric}; the base's applies")
            elif _terms(mine[metric]) != _terms(gate):
                notes.append(
                    f"{rel}:{mine[metric].line}: the change alters the gate on {metric}; the "
                    "base's applies until it lands"
                )
        added = [g for m, g in mine.items() if m not in base_by_metric]
        held.gates[rel] = [*base_gates, *added]
    return held, notes


def _terms(gate: Gate) -> tuple:
    """What a gate decides with (its line number aside)."""
    return (gate.metric, gate.direction, gate.tolerance, gate.steps, gate.floor, gate.enforce)
