"""The one walk of the repository that finds test files (for the registry) and the Python files
under ``tests/`` (for the import graph and impact analysis).

Invariants:
- One set of rules for both uses.  Not entered: hidden directories, :data:`SKIP_DIRS`,
  ``*.egg-info``, virtual environments (a directory holding ``pyvenv.cfg``), symlinked
  directories (a tree reached twice, or reached from outside the repository, is not the
  repository's), and the ``exclude`` globs of ``[tool.mizzen.registry]`` in the root
  ``pyproject.toml``.  An excluded file is never reported.
- :attr:`Discovery.test_files`: every ``test_*.py`` of the tree, sorted (one outside ``tests/``
  is a violation: :func:`outside_tests`).  :attr:`Discovery.tree`: every ``.py`` file under
  ``tests/`` in walk order (a directory's files sorted by name, then its subdirectories sorted,
  depth first), split into test files, ``conftest.py`` files and helpers.
- Walked with ``os.scandir`` on strings and an explicit stack (pathlib costs a second on a tree of
  15,000 files; recursion would end at Python's depth limit).
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .model import Violation

TESTS_DIR = "tests"
SKIP_DIRS = frozenset({"node_modules", "__pycache__", "build", "dist", "site-packages"})


@dataclass
class TestTree:
    """The Python files under ``tests/`` that the graph needs: test files, conftests, helpers."""

    tests: list[str] = field(default_factory=list)
    conftests: list[str] = field(default_factory=list)
    helpers: list[str] = field(default_factory=list)

    @property
    def all(self) -> list[str]:
        return self.tests + self.conftests + self.helpers


@dataclass
class Discovery:
    """What the walk found (see the module docstring)."""

    test_files: list[str] = field(default_factory=list)
    tree: TestTree = field(default_factory=TestTree)


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


def discover(root: Path | str, excludes: Iterable[str] = ()) -> Discovery:
    """Walk ``root`` once (see the module docstring)."""
    excludes = tuple(excludes)
    found = Discovery()
    tree = found.tree
    stack = [(os.fspath(root), "", False)]
    while stack:
        path, rel_dir, in_tests = stack.pop()
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for e in entries:
            name = e.name
            rel = rel_dir + name
            if e.is_dir():
                if (
                    e.is_symlink()
                    or name.startswith(".")
                    or name in SKIP_DIRS
                    or name.endswith(".egg-info")
                    or (excludes and is_excluded(rel, excludes))
                    or os.path.exists(os.path.join(e.path, "pyvenv.cfg"))
                ):
                    continue
                subdirs.append((e.path, rel + "/", in_tests or rel == TESTS_DIR))
                continue
            if not name.endswith(".py") or (excludes and is_excluded(rel, excludes)):
                continue
            is_test = name.startswith("test_")
            if is_test:
                found.test_files.append(rel)
            if in_tests:
                if name == "conftest.py":
                    tree.conftests.append(rel)
                elif is_test:
                    tree.tests.append(rel)
                else:
                    tree.helpers.append(rel)
        stack.extend(reversed(subdirs))
    found.test_files.sort()
    return found


def outside_tests(rel: str) -> Violation:
    """The violation for a discovered test file that is not under ``tests/``."""
    return Violation(
        rel,
        1,
        "outside-tests",
        f"test file outside `{TESTS_DIR}/`",
        f"move it under {TESTS_DIR}/ (mirrored by concern), or rename it if it is not a test",
    )
