"""Seeded mutants of source functions: the mutation check of the audit's oracle.

A mutant changes one function's behaviour by one edit, chosen with :mod:`ast`:

| operator          | edit                                                                    |
|-------------------|-------------------------------------------------------------------------|
| flip-comparison   | one comparison on one line to its negation (``<`` → ``>=``, ``==`` →   |
|                   | ``!=``, ``in`` → ``not in``, ``is`` → ``is not`` and back)               |
| change-constant   | one int or float literal on one line to itself + 1, a bool to its       |
|                   | negation                                                                |
| raise-at-start    | ``raise RuntimeError(…)`` before the function's first statement (after  |
|                   | its docstring)                                                          |

Invariants:
- Deterministic: the candidates of a tree are enumerated in (file, line, column, operator)
  order and :func:`sample` draws from them with ``random.Random(seed)`` only: the same tree and
  seed give the same mutants, in the same order.
- A mutant is an edit of one line of one file (byte offsets from the AST, which counts UTF-8
  bytes), and :meth:`Mutant.apply` checks that the original text is where it was found, so a
  mutant never applies to another text; the mutated file still parses.
- A function is sampled at most once while unsampled functions remain.
"""

from __future__ import annotations

import ast
import difflib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..sources import read_bytes

OPERATORS = ("flip-comparison", "change-constant", "raise-at-start")
RAISED = 'raise RuntimeError("mizzen-ci audit mutant")'
_FLIP = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip


class MutantError(ValueError):
    """A mutant does not fit the text it is applied to."""


@dataclass(frozen=True)
class Mutant:
    path: str  # repository-relative
    function: str  # qualified name
    operator: str
    line: int  # 1-based
    start: int  # byte offsets in the line; start == end: an inserted line before ``line``
    end: int
    original: str
    replacement: str

    def apply(self, text: str) -> str:
        """``text`` (the file's) with this mutant's edit."""
        lines = text.splitlines(keepends=True)
        if not 0 < self.line <= len(lines):
            raise MutantError(f"{self.path}:{self.line}: the file has {len(lines)} lines")
        raw = lines[self.line - 1].encode()
        if raw[self.start : self.end].decode(errors="replace") != self.original:
            raise MutantError(f"{self.path}:{self.line}: the text changed since it was sampled")
        edited = raw[: self.start] + self.replacement.encode() + raw[self.end :]
        lines[self.line - 1] = edited.decode()
        return "".join(lines)

    def diff(self, text: str) -> str:
        return "".join(difflib.unified_diff(
            text.splitlines(keepends=True), self.apply(text).splitlines(keepends=True),
            f"a/{self.path}", f"b/{self.path}", n=1,
        ))  # fmt: skip

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.function} ({self.operator})"


def candidates(path: str, text: str) -> list[Mutant]:
    """Every mutant of every function of one file, in (line, column, operator) order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out: list[Mutant] = []
    for qualname, fn in _functions(tree):
        out += _raise_at_start(path, qualname, fn, lines)
        for node in _own_nodes(fn):
            out += _flip(path, qualname, node, lines) + _constant(path, qualname, node, lines)
    return sorted(out, key=lambda m: (m.line, m.start, OPERATORS.index(m.operator)))


def tree_candidates(root: Path, paths: Iterable[str]) -> dict[str, list[Mutant]]:
    """``{function key: its mutants}`` of ``paths`` of ``root``, keys sorted."""
    by_function: dict[str, list[Mutant]] = {}
    for path in sorted(set(paths)):
        if not path.endswith(".py"):
            continue
        try:
            text = read_bytes(root / path)[0].decode()
        except (OSError, UnicodeDecodeError):
            continue
        for m in candidates(path, text):
            by_function.setdefault(f"{path}::{m.function}", []).append(m)
    return dict(sorted(by_function.items()))


def sample(by_function: dict[str, list[Mutant]], n: int, seed: int) -> list[Mutant]:
    """``n`` mutants drawn with ``random.Random(seed)``: functions without replacement (until
    every function was drawn once), one of each drawn function's mutants."""
    rng = random.Random(seed)
    keys = list(by_function)
    out: list[Mutant] = []
    while keys and len(out) < n:
        order = rng.sample(keys, len(keys))
        for key in order[: n - len(out)]:
            out.append(rng.choice(by_function[key]))
    return out


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not those of functions or classes nested in it."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _segment(node: ast.AST, lines: list[str]) -> tuple[int, int, str] | None:
    if getattr(node, "end_lineno", None) != node.lineno:
        return None
    raw = lines[node.lineno - 1].encode()
    return node.col_offset, node.end_col_offset, raw[node.col_offset : node.end_col_offset].decode()


def _flip(path: str, qualname: str, node: ast.AST, lines: list[str]) -> list[Mutant]:
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP):
        return []
    seg = _segment(node, lines)
    if seg is None:
        return []
    flipped = ast.Compare(node.left, [_FLIP[type(node.ops[0])]()], node.comparators)
    replacement = f"({ast.unparse(flipped)})"
    return [Mutant(path, qualname, "flip-comparison", node.lineno, *seg, replacement)]


def _constant(path: str, qualname: str, node: ast.AST, lines: list[str]) -> list[Mutant]:
    if not isinstance(node, ast.Constant) or type(node.value) not in (int, float, bool):
        return []
    seg = _segment(node, lines)
    if seg is None:
        return []
    value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    return [Mutant(path, qualname, "change-constant", node.lineno, *seg, repr(value))]


def _raise_at_start(path: str, qualname: str, fn, lines: list[str]) -> list[Mutant]:
    body = fn.body
    first = body[1] if len(body) > 1 and _is_docstring(body[0]) else body[0]
    if (first is body[0] and _is_docstring(first)) or first.lineno == fn.lineno:
        return []
    line = lines[first.lineno - 1]
    raw = line.encode()
    indent = raw[: first.col_offset].decode()
    if indent.strip():  # the statement shares its line with something else
        return []
    inserted = f"{indent}{RAISED}\n{indent}"
    return [Mutant(path, qualname, "raise-at-start", first.lineno, first.col_offset,
                   first.col_offset, "", inserted.removeprefix(indent))]  # fmt: skip


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(getattr(stmt, "value", None), ast.Constant) \
        and isinstance(stmt.value.value, str)  # fmt: skip
