"""The mutation check of the oracle: apply seeded mutants (:mod:`.mutants`) in a scratch copy of
the tree, run the tests that executed each mutated file, and report every mutant that only
tests the planner would not select detect (a miss), with its diff.

Invariants:
- The user's tree is never written: mutants are applied in one scratch copy
  (:func:`mizzen_ci.bisect.scratch.scratch_copy`), each restored before the next is applied.
- The tests run for a mutant of F are those observed to execute F (their node ids; a test file
  whose module-level code executed F runs whole).  A test that never executed F cannot see an
  in-process change of F, so the planned tests outside that set are not run; the planned set
  itself (the planner's impact of a change to F) decides whether a detection is a miss.
- Outcome of a mutant: ``miss`` (detected only by unplanned tests), ``detected`` (a planned test
  failed), ``survived`` (no test failed: a gap of the tests, not of the selection), ``no tests``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..bisect.scratch import run_pytest, scratch_copy
from ..history import file_of_testcase
from ..history_execution import Executed
from ..junit import JunitError, read_testcases, testcase_outcome
from .mutants import Mutant

MAX_IDS = 1000  # node ids on one command line; more: their files run whole


@dataclass(frozen=True)
class MutantOutcome:
    mutant: Mutant
    outcome: str  # miss | detected | survived | no tests
    ran: tuple[str, ...]  # test files run
    failed: tuple[str, ...]  # test files with a failing test
    planned: tuple[str, ...]  # test files the plan of a change to the file selects
    diff: str


def tests_to_run(rows: list[Executed], path: str) -> list[str]:
    """The node ids (or whole files) observed to execute ``path``, sorted."""
    ids = sorted({r.test for r in rows if r.path == path and r.kind == "source"})
    whole = {i for i in ids if "::" not in i}
    if len(ids) > MAX_IDS:
        whole = {i.split("::", 1)[0] for i in ids}
    return sorted(whole | {i for i in ids if i.split("::", 1)[0] not in whole})


def check(
    root: Path,
    mutants: list[Mutant],
    rows: list[Executed],
    planned: Callable[[str], frozenset[str]],
    progress: Callable[[str], None] = lambda line: None,
) -> list[MutantOutcome]:
    """The outcome of every mutant (see the module docstring)."""
    out = []
    with scratch_copy(root) as tree, tempfile.TemporaryDirectory() as tmp:
        for i, mutant in enumerate(mutants):
            result = _one(tree, mutant, rows, planned, Path(tmp) / f"junit-{i}.xml")
            progress(f"mutant {i + 1}/{len(mutants)}: {mutant}: {result.outcome}")
            out.append(result)
    return out


def _one(tree: Path, mutant: Mutant, rows, planned, junit: Path) -> MutantOutcome:
    target = tree / mutant.path
    original = target.read_text()
    diff = mutant.diff(original)
    selected = tuple(sorted(planned(mutant.path)))
    ids = tests_to_run(rows, mutant.path)
    ran = tuple(sorted({i.split("::", 1)[0] for i in ids}))
    if not ids:
        return MutantOutcome(mutant, "no tests", (), (), selected, diff)
    target.write_text(mutant.apply(original))
    try:
        run_pytest(tree, [f"--junitxml={junit}", *ids])
    finally:
        target.write_text(original)
    # no report: pytest itself could not start with the mutant (a plugin, a conftest): every
    # test run detected it
    failed = tuple(sorted(_failed_files(junit) if junit.exists() else set(ran)))
    if not failed:
        outcome = "survived"
    elif set(failed) & set(selected):
        outcome = "detected"
    else:
        outcome = "miss"
    return MutantOutcome(mutant, outcome, ran, failed, selected, diff)


def _failed_files(junit: Path) -> set[str]:
    """The test files with a failed or errored testcase (a report that cannot be read: none)."""
    try:
        cases = read_testcases(junit)
    except (JunitError, OSError):
        return set()
    return {
        f for c in cases if testcase_outcome(c) in ("failed", "error")
        if (f := file_of_testcase(c.get("classname", ""), c.get("name", "")))
    }  # fmt: skip
