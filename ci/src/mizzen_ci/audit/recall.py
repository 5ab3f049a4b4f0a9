"""The selection audit: for every workspace file F and every test T that executed F, does the
plan of a change touching F select T?

Recall is ``|selected ∩ executed| / |executed|`` over (F, T) pairs; precision is
``|selected ∩ executed| / |selected|``, where *selected* counts only the tests that were observed
(a test the audit did not run says nothing about over-planning).  A miss is a pair (F, T) with T
executed and not selected; :mod:`.explain` says why.

Invariants:
- The plan of a change touching F is the planner's own impact analysis
  (:meth:`mizzen_ci.plan.impact.Analyser.analyse` over the tree's :class:`PlanIndex`, one index
  for every F): the audit never has its own idea of selection.
- Audited files are the executed paths that exist in the tree, are no test file themselves (a
  changed test file selects itself), and lie under a workspace source folder or ``tests/``.
- Deterministic: files, tests and misses are sorted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..history_execution import Executed, by_path
from ..plan.change import Change, Entry
from ..plan.impact import Analyser

NO_REVISION = "0" * 40


@dataclass(frozen=True)
class Miss:
    source: str
    test: str
    why: str

    def __str__(self) -> str:
        return f"{self.source} -> {self.test}: {self.why}"


@dataclass(frozen=True)
class FileAudit:
    """One audited file: the tests that executed it and those its change selects (observed)."""

    source: str
    package: str
    executed: frozenset[str]
    selected: frozenset[str]

    @property
    def hits(self) -> frozenset[str]:
        return self.executed & self.selected

    @property
    def missed(self) -> frozenset[str]:
        return self.executed - self.selected

    @property
    def recall(self) -> float:
        return len(self.hits) / len(self.executed) if self.executed else 1.0


@dataclass
class Audit:
    files: list[FileAudit] = field(default_factory=list)
    misses: list[Miss] = field(default_factory=list)
    tests: frozenset[str] = frozenset()  # the observed test files

    @property
    def executed_pairs(self) -> int:
        return sum(len(f.executed) for f in self.files)

    @property
    def hit_pairs(self) -> int:
        return sum(len(f.hits) for f in self.files)

    @property
    def selected_pairs(self) -> int:
        return sum(len(f.selected) for f in self.files)

    @property
    def recall(self) -> float:
        return self.hit_pairs / self.executed_pairs if self.executed_pairs else 1.0

    @property
    def precision(self) -> float:
        return self.hit_pairs / self.selected_pairs if self.selected_pairs else 1.0

    def by_package(self) -> dict[str, tuple[int, int, int]]:
        """``{package: (executed pairs, hits, selected pairs)}``."""
        out: dict[str, tuple[int, int, int]] = {}
        for f in self.files:
            e, h, s = out.get(f.package, (0, 0, 0))
            out[f.package] = (e + len(f.executed), h + len(f.hits), s + len(f.selected))
        return dict(sorted(out.items()))


def audited_paths(root: Path, rows: Iterable[Executed], index) -> dict[str, set[str]]:
    """``{file: {test file, …}}`` of the rows whose file the audit covers (module docstring)."""
    prefixes = (*tuple(d.rstrip("/") + "/" for d in index.source_dirs), "tests/")
    tests = set(index.tree.all)
    out = {}
    for path, testers in by_path(rows).items():
        inside = path.startswith(prefixes) and path not in tests and not _is_test_file(path)
        if inside and (root / path).is_file():
            out[path] = testers
    return dict(sorted(out.items()))


def _is_test_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.startswith("tests/") and name.startswith("test_") and name.endswith(".py")


def audit(root: Path, rows: list[Executed], index, explain=None) -> Audit:
    """The audit of ``rows`` against the planner's impact on the tree ``index`` describes;
    ``explain(source, test) -> why`` names each miss's cause (default: "not selected")."""
    analyser = Analyser.of_index(index)
    observed = frozenset(r.file for r in rows)
    result = Audit(tests=observed)
    for source, testers in audited_paths(root, rows, index).items():
        selected = selected_by_change(analyser, source, observed)
        entry = FileAudit(source, package_of(source, index.source_dirs), frozenset(testers),
                          selected)  # fmt: skip
        result.files.append(entry)
        for test in sorted(entry.missed):
            why = explain(source, test) if explain else "not selected"
            result.misses.append(Miss(source, test, why))
    return result


def selected_by_change(analyser: Analyser, path: str, observed: frozenset[str]) -> frozenset[str]:
    """The observed test files the plan of a change touching ``path`` selects."""
    change = Change.from_entries(NO_REVISION, NO_REVISION, [Entry("M", path)])
    impact = analyser.analyse(change)
    if impact.everything:
        return observed
    return frozenset(impact.tests) & observed


def package_of(path: str, source_dirs: Iterable[str]) -> str:
    """The package folder a file belongs to: its workspace member (``packages/train``,
    ``ci``), or ``tests/<area>`` for a file under ``tests/``."""
    parts = path.split("/")
    if parts[0] == "tests":
        return "/".join(parts[:2]) if len(parts) > 2 else "tests"
    for sd in source_dirs:
        if path.startswith(sd.rstrip("/") + "/"):
            member = sd.rstrip("/").split("/")
            return "/".join(member[:-1]) if member[-1] == "src" else "/".join(member)
    return parts[0]
