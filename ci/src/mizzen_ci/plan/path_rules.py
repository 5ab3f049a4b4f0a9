"""The one table that says what a changed path means for test selection.

Every changed path is matched against :data:`RULES` in order; the first rule whose glob matches
decides.  The effects:

- ``nothing``: selects no test (documentation, benchmark scripts).
- ``everything``: selects every test (dependencies, the CI and lanes themselves, workflows).
- ``python``: package source; the tests whose import closure reaches the module are selected
  (:mod:`mizzen_ci.plan.impact`).
- ``tests``: a path under ``tests/``: a test file selects itself; a ``conftest.py`` selects the
  tests of its directory and below; an imported helper module selects its importers; any other
  file there is data, read by the tests of the directories that hold it.
- ``package-data``: a non-Python file inside a workspace package selects that package's tests
  (those whose import closure reaches any of its modules).

Besides its rule's effect, every changed path (whatever rule decides it, ``nothing`` included)
also selects the tests that *name* it (:mod:`mizzen_ci.imports.path_literals`: a test, a helper
or conftest it uses, or a module it reaches holds a string literal naming the file) and the tests
whose registration ``watches`` a glob matching it (:func:`glob_matches`); see
:mod:`mizzen_ci.plan.impact`.  So a README that a test reads is documentation here and still
selects that test.

Invariants:
- This is the only place that maps paths to selection effects; the planner never globs paths
  except through :func:`glob_matches` (the same dialect, for ``watches``).
- ``tests/**`` is decided before the documentation rules: a Markdown file under ``tests/`` is
  test data (a Harbor task's ``instruction.md``), never "documentation".
- The last rule matches every path and selects everything: a path no rule knows fails open.
- Globs: ``*`` and ``?`` stay inside one path segment, ``**`` spans segments (``**/`` also
  matches no segment at all); matching is on repository-relative POSIX paths.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

NOTHING = "nothing"
EVERYTHING = "everything"
PYTHON = "python"
TESTS = "tests"
PACKAGE_DATA = "package-data"
EFFECTS = (NOTHING, EVERYTHING, PYTHON, TESTS, PACKAGE_DATA)


@dataclass(frozen=True)
class Rule:
    glob: str
    effect: str
    why: str

    def matches(self, path: str) -> bool:
        return glob_matches(self.glob, path)


RULES: tuple[Rule, ...] = (
    Rule("ci/**", EVERYTHING, "the CI itself: registry, planner, fleet, pytest plugin"),
    Rule(".github/**", EVERYTHING, "workflows"),
    Rule(".ci/**", EVERYTHING, "the CI entry point"),
    Rule("noxfile.py", EVERYTHING, "the lanes"),
    Rule("**/pyproject.toml", EVERYTHING, "dependencies and shared tool configuration"),
    Rule("**/uv.lock", EVERYTHING, "locked dependencies"),
    Rule(".python-version", EVERYTHING, "the interpreter version"),
    Rule("tests/**", TESTS, "test files, their helpers, conftest.py and data"),
    Rule("**/*.md", NOTHING, "documentation"),
    Rule("**/*.rst", NOTHING, "documentation"),
    Rule("docs/**", NOTHING, "documentation"),
    Rule("LICENSE*", NOTHING, "licence text"),
    Rule(".gitignore", NOTHING, "git metadata"),
    Rule(".gitattributes", NOTHING, "git metadata"),
    Rule("benchmarks/**", NOTHING, "benchmark scripts are never run as tests"),
    Rule("packages/*/src/**/*.py", PYTHON, "package source: impact through the import graph"),
    Rule("packages/*/**", PACKAGE_DATA, "a data file inside a package: that package's tests"),
    Rule("**", EVERYTHING, "no rule knows this path: fail open"),
)


@functools.cache
def _compile(glob: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def glob_matches(glob: str, path: str) -> bool:
    """Whether ``path`` matches ``glob`` in the dialect of the rules table."""
    return _compile(glob).fullmatch(path) is not None


def rule_for(path: str, rules: tuple[Rule, ...] = RULES) -> Rule:
    """The first rule matching ``path`` (the catch-all when nothing else does)."""
    for rule in rules:
        if rule.matches(path):
            return rule
    raise ValueError(f"{path}: no rule matches; the table must end with a `**` rule")


def package_of(path: str) -> str | None:
    """``packages/<name>`` for a path inside a workspace package directory, else ``None``."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] == "packages":
        return "/".join(parts[:2])
    return None
