"""The one walk of the repository that finds test files (for the registry) and the Python files
under ``tests/`` (for the import graph and impact analysis).

Invariants:
- One set of rules for both uses.  Not entered: hidden directories, :data:`SKIP_DIRS`,
  ``*.egg-info``, virtual environments (a directory holding ``pyvenv.cfg``), symlinked
  directories, and the ``exclude`` globs of ``[tool.mizzen.registry]`` in the root
  ``pyproject.toml``.  An excluded path is never reported.
- The walk never follows a symbolic link (it reads directory entries' own types; a link is only
  ``stat`` ed to say where it points), so it cannot leave the repository, loop, or block on a
  FIFO; it opens no file but ``pyproject.toml`` (through :func:`mizzen_ci.sources.read_bytes`).
- :attr:`Discovery.test_files`: every regular ``test_*.py`` of the tree, sorted (one outside
  ``tests/`` is a violation: :func:`outside_tests`; outside ``tests/`` any ``test_*.py`` entry
  counts, link or not, and is reported without being read).  :attr:`Discovery.tree`: every
  regular ``.py`` file under ``tests/`` in walk order (a directory's files sorted by name, then
  its subdirectories sorted, depth first), split into test files, ``conftest.py`` files and
  helpers.
- :attr:`Discovery.violations`, in walk order: what under ``tests/`` (``tests`` itself included)
  could not become a test that runs, each with its path and the fix — a symbolic link (into the
  repository, out of it, dangling or a loop: it is never followed), a FIFO, socket, device or
  directory named ``*.py``, a ``.py`` file whose path holds characters that do not print
  (newlines, control or format characters), a directory the walk cannot read, and a ``test_*.py``
  inside a folder the walk skips (it would never run), at most :data:`REPORTED_PER_FOLDER` per
  such folder, then one violation that counts the rest.  Outside ``tests/`` skipped folders stay
  silent (tool output, virtual environments).
- Walked with ``os.scandir`` on strings and an explicit stack (pathlib costs a second on a tree of
  15,000 files; recursion would end at Python's depth limit).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..sources import ConfigError, RefusedFile, folder_entries, kind_of, read_bytes
from .model import Violation

TESTS_DIR = "tests"
SKIP_DIRS = frozenset({"node_modules", "__pycache__", "build", "dist", "site-packages"})
REPORTED_PER_FOLDER = 10
PYPROJECT_LIMIT = 1024 * 1024
_EXCLUDE_FIX = "or list it in `exclude` of [tool.mizzen.registry] in pyproject.toml"


class RegistryConfigError(ConfigError):
    """``[tool.mizzen.registry]`` of ``pyproject.toml`` cannot be used; the message names the
    file, the key and the fix."""


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
    violations: list[Violation] = field(default_factory=list)


def registry_excludes(root: Path) -> tuple[str, ...]:
    """The ``exclude`` globs of ``[tool.mizzen.registry]`` in ``root/pyproject.toml`` (none when
    there is no such file); :class:`RegistryConfigError` when it cannot be read or is malformed."""
    pyproject = Path(root) / "pyproject.toml"
    try:
        source, _ = read_bytes(pyproject, PYPROJECT_LIMIT)
    except FileNotFoundError:
        return ()
    except RefusedFile as e:
        raise RegistryConfigError(str(e)) from None
    except OSError as e:
        raise RegistryConfigError(f"{pyproject}: cannot read: {e.strerror}") from None
    try:
        data = tomllib.loads(source.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RegistryConfigError(
            f"{pyproject}: not UTF-8 ({e.reason}); save it as UTF-8"
        ) from None
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise RegistryConfigError(f"{pyproject}: not valid TOML: {e}; fix the syntax") from None
    table: object = data
    for key in ("tool", "mizzen", "registry"):
        table = table.get(key, {}) if isinstance(table, dict) else None
    if not isinstance(table, dict):
        raise RegistryConfigError(
            f"{pyproject}: [tool.mizzen.registry] must be a table; write `[tool.mizzen.registry]`"
        )
    excludes = table.get("exclude", [])
    if not isinstance(excludes, list) or not all(
        isinstance(p, str) and p and p.isprintable() for p in excludes
    ):
        raise RegistryConfigError(
            f"{pyproject}: [tool.mizzen.registry] exclude must be a list of path globs "
            '(non-empty printable strings), e.g. `exclude = ["tests/ci/fixtures"]`'
        )
    return tuple(excludes)


def is_excluded(rel: str, excludes: Iterable[str]) -> bool:
    return any(
        rel == pat or fnmatch.fnmatch(rel, pat) or rel.startswith(pat.rstrip("/") + "/")
        for pat in excludes
    )


def _skipped_kind(entry: os.DirEntry) -> str | None:
    """Why the walk does not enter this (real) directory, or None when it does."""
    name = entry.name
    if name.startswith("."):
        return "a hidden folder"
    if name in SKIP_DIRS:
        return f"a `{name}` folder"
    if name.endswith(".egg-info"):
        return "an `*.egg-info` folder"
    if os.path.lexists(os.path.join(entry.path, "pyvenv.cfg")):
        return "a virtual environment: it holds pyvenv.cfg"
    return None


class _Walk:
    """One walk's state: the root, the excludes and what was found."""

    def __init__(self, root: str, excludes: tuple[str, ...]):
        self.root, self.excludes = root, excludes
        self.found = Discovery()

    def excluded(self, rel: str) -> bool:
        return bool(self.excludes) and is_excluded(rel, self.excludes)

    def bad(self, rel: str, rule: str, message: str, fix: str) -> None:
        self.found.violations.append(Violation(rel, 1, rule, message, fix))

    def run(self) -> Discovery:
        stack = [(self.root, "", False)]
        while stack:
            path, rel_dir, in_tests = stack.pop()
            try:
                entries = sorted(os.scandir(path), key=lambda e: e.name)
            except OSError as e:
                if in_tests:
                    self.bad(
                        rel_dir.rstrip("/"),
                        "unreadable-dir",
                        f"directory cannot be read ({e.strerror}); its tests would never run",
                        "make it readable (a shorter path, the right permissions) or remove it",
                    )
                continue
            subdirs = []
            for e in entries:
                rel = rel_dir + e.name
                if self.excluded(rel):
                    continue
                under_tests = in_tests or rel == TESTS_DIR
                if self.entry(e, rel, under_tests):
                    subdirs.append((e.path, rel + "/", under_tests))
            stack.extend(reversed(subdirs))
        self.found.test_files.sort()
        return self.found

    def entry(self, e: os.DirEntry, rel: str, under_tests: bool) -> bool:
        """Record one directory entry; True when it is a directory to walk into."""
        name = e.name
        is_test_name = name.startswith("test_") and name.endswith(".py")
        try:  # the entry's own type (d_type, else lstat): never through a link
            is_link = e.is_symlink()
            is_dir = not is_link and e.is_dir(follow_symlinks=False)
            is_file = not is_link and e.is_file(follow_symlinks=False)
        except OSError:
            is_link = is_dir = is_file = False
        if is_link:
            if under_tests:
                self.bad(
                    rel,
                    "symlink",
                    f"symbolic link under {TESTS_DIR}/ ({_link_target(e.path, self.root)}); the "
                    "registry never follows links, so nothing behind it is registered or run",
                    "replace the link with the file or directory itself, or remove it",
                )
            elif is_test_name:
                self.found.test_files.append(rel)  # outside tests/: an error, never read
            return False
        if is_dir:
            kind = _skipped_kind(e)
            if kind is not None:
                if under_tests:
                    self.report_skipped(e.path, rel, kind)
                return False
            if under_tests and name.endswith(".py"):
                self.bad(
                    rel,
                    "not-a-file",
                    "a directory named like a Python file",
                    f"rename the directory (no `.py` suffix) {_EXCLUDE_FIX}",
                )
            return True
        if not name.endswith(".py"):
            return False
        if not is_file:
            if under_tests:
                self.bad(
                    rel,
                    "not-a-file",
                    f"{_kind(e.path)} named like a Python file, not a regular file",
                    "remove it or replace it with a regular file",
                )
            elif is_test_name:
                self.found.test_files.append(rel)  # outside tests/: an error, never read
            return False
        if under_tests and not rel.isprintable():
            self.bad(
                rel,
                "path-unprintable",
                "the path holds characters that do not print (a newline, control or format "
                "character), so no log could show it faithfully",
                "rename the file with printable characters",
            )
            return False
        found, tree = self.found, self.found.tree
        if is_test_name:
            found.test_files.append(rel)
        if under_tests:
            if name == "conftest.py":
                tree.conftests.append(rel)
            elif is_test_name:
                tree.tests.append(rel)
            else:
                tree.helpers.append(rel)
        return False

    def report_skipped(self, path: str, rel: str, kind: str) -> None:
        """Report the ``test_*.py`` files below a folder the walk skips under ``tests/`` (links
        not followed, excluded paths not reported)."""
        hidden: list[str] = []
        stack = [(path, rel + "/")]
        while stack:
            d, rel_dir = stack.pop()
            for e in folder_entries(d):
                sub = rel_dir + e.name
                if self.excluded(sub):
                    continue
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if is_dir:
                    stack.append((e.path, sub + "/"))
                elif e.name.startswith("test_") and e.name.endswith(".py"):
                    hidden.append(sub)
        hidden.sort()
        for sub in hidden[:REPORTED_PER_FOLDER]:
            self.bad(
                sub,
                "skipped-folder",
                f"test file inside {rel}/ ({kind}, which the walk skips): it would never run",
                f"move it out of {rel}/, {_EXCLUDE_FIX}",
            )
        if len(hidden) > REPORTED_PER_FOLDER:
            self.bad(
                rel,
                "skipped-folder",
                f"{len(hidden) - REPORTED_PER_FOLDER} more test file(s) inside {rel}/ ({kind}, "
                "which the walk skips): they would never run",
                f"move them out of {rel}/, {_EXCLUDE_FIX}",
            )


def _kind(path: str) -> str:
    try:
        return kind_of(os.lstat(path).st_mode)
    except OSError:
        return "something"


def _link_target(path: str, root: str) -> str:
    """What a symbolic link points at, in words (found without reading through it)."""
    try:
        os.stat(path)
    except OSError as e:
        return "a loop of links" if e.errno == errno.ELOOP else "dangling: its target is missing"
    target = os.path.realpath(path)
    real_root = os.path.realpath(root)
    inside = target == real_root or target.startswith(real_root.rstrip(os.sep) + os.sep)
    return "pointing inside the repository" if inside else "pointing out of the repository"


def discover(root: Path | str, excludes: Iterable[str] = ()) -> Discovery:
    """Walk ``root`` once (see the module docstring)."""
    return _Walk(os.fspath(root), tuple(excludes)).run()


def outside_tests(rel: str) -> Violation:
    """The violation for a discovered test file that is not under ``tests/``."""
    return Violation(
        rel,
        1,
        "outside-tests",
        f"test file outside `{TESTS_DIR}/`",
        f"move it under {TESTS_DIR}/ (mirrored by concern), or rename it if it is not a test",
    )
