"""The selection audit (issue 34): observed execution under coverage, recall and misses against
the planner, the execution store, and seeded mutants.

- A synthetic repository whose one test reaches ``alpha/hidden.py`` only through a pickle: the
  audit runs the test under coverage, stores what it executed, and reports that miss with the
  file pair and why; ``alpha/core.py`` (imported) is no miss.
- The real repository's audit on a small slice (one fast test file): recall 1.0.
- Mutants of that repository: the one of ``hidden.py`` is detected only by the unplanned test (a
  miss, with its diff).
- Mutants are deterministic for a seed and different for another; each applies to its text only.
- A hostile execution store: bad rows dropped with ``path:rowid``, a store that is a link or not
  SQLite refused with one line.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.audit.mutants import MutantError, sample, tree_candidates
from mizzen_ci.history import read_kinded
from mizzen_ci.history_execution import Executed, ExecutionStoreError, read, replace_revision
from mizzen_ci.report.records import PARSERS, RecordError

register_cpu_ci(est_time=40, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
HIDDEN_MISS = "packages/alpha/src/alpha/hidden.py -> tests/alpha/test_core.py: unseen loader"


def _audit(root: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    return subprocess.run([sys.executable, "-m", "mizzen_ci", "audit", "--root", str(root), *args],
                          capture_output=True, text=True, env=env, cwd=cwd or root,
                          timeout=300, check=False)  # fmt: skip


def test_a_path_the_import_graph_cannot_see_is_a_miss_with_its_file_pair(
    hidden_path_repo, tmp_path
):
    store = tmp_path / "execution.sqlite"
    done = _audit(hidden_path_repo, "--store", str(store), "--markdown", str(tmp_path / "s.md"),
                  "--mutants", "3", "--seed", "0",
                  "--record", str(tmp_path / "records" / "health.jsonl"))  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert HIDDEN_MISS in done.stdout, done.stdout
    assert "alpha/core.py -> " not in done.stdout  # imported: selected
    assert "recall 0.750 (3/4)" in done.stdout, done.stdout  # __init__, core, hidden, pickle
    assert r"hidden\.py \-\> tests" in (tmp_path / "s.md").read_text()  # Markdown-escaped
    # the mutants: both functions drawn (3 mutants, 2 functions); one of hidden.py is detected
    # only by the unplanned test (a miss, with its diff), core.py's by the planned one
    assert "mutants: 3 (seed 0): " in done.stdout and " 0 no tests" in done.stdout
    assert re.search(
        r"^miss: packages/alpha/src/alpha/hidden\.py:\d+ answer \([a-z-]+\) "
        r"detected only by unplanned tests/alpha/test_core\.py$",
        done.stdout,
        re.M,
    )
    assert "+++ b/packages/alpha/src/alpha/hidden.py" in done.stdout
    assert not re.search(r"^miss: packages/alpha/src/alpha/core", done.stdout, re.M)
    rows, problems = read(store)
    assert not problems
    pairs = {(r.test, r.path, r.kind) for r in rows}
    test = "tests/alpha/test_core.py::test_answer_from_a_pickle"
    assert (test, "packages/alpha/src/alpha/hidden.py", "source") in pairs
    assert (test, "tests/alpha/answer.pickle", "data") in pairs  # a data file it opened
    # the health page's audit record, as the page reads it
    kinded, problems = read_kinded([tmp_path / "records"], PARSERS, RecordError)
    assert not problems
    (audit_run,) = kinded["audit"]
    assert (audit_run.recall, audit_run.caught, audit_run.failing) == (0.75, 3, 4)
    assert audit_run.window.startswith("revision ")
    # the stored rows audit the same without running anything
    again = _audit(hidden_path_repo, "--store", str(store), "--no-observe")
    assert again.returncode == 1 and HIDDEN_MISS in again.stdout, again.stdout + again.stderr


def test_the_real_repository_audit_on_a_small_slice(tmp_path):
    done = _audit(REPO, "--store", str(tmp_path / "e.sqlite"), "tests/ci/test_history_dates.py",
                  cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "recall 1.000" in done.stdout and "misses: none" in done.stdout, done.stdout
    assert "ci/src/mizzen_ci/history.py" in {
        r.path for r in read(tmp_path / "e.sqlite")[0]
    }  # what the test executed was observed


def test_mutants_are_deterministic_for_a_seed():
    paths = [p.relative_to(REPO).as_posix() for p in (REPO / "ci/src/mizzen_ci/plan").glob("*.py")]
    candidates = tree_candidates(REPO, paths)
    first, again = sample(candidates, 40, seed=7), sample(candidates, 40, seed=7)
    assert first == again and len(first) == 40
    assert sample(candidates, 40, seed=8) != first
    assert {m.operator for m in first} == {"flip-comparison", "change-constant", "raise-at-start"}
    for m in first:
        text = (REPO / m.path).read_text()
        mutated = m.apply(text)
        assert mutated != text
        compile(mutated, m.path, "exec")  # still parses
        with pytest.raises(MutantError):
            m.apply("x = 1\n" * 3)  # never applies to another text


def test_a_hostile_store_is_dropped_row_by_row_or_refused_in_one_line(tmp_path):
    store = tmp_path / "e.sqlite"
    good = Executed("a" * 40, "tests/x/test_a.py::test_b", "pkg/m.py")
    replace_revision(store, "a" * 40, [good])
    with sqlite3.connect(store) as db:
        db.execute("INSERT INTO executed VALUES (?,?,?,?,?)",
                   ("a" * 40, "tests/x/test_a.py::t", "x", "../../etc/passwd", "source"))  # fmt: skip
        db.execute("INSERT INTO executed VALUES (?,?,?,?,?)",
                   ("HEAD", "tests/x/test_a.py::t", "x", "pkg/m.py", "source"))  # fmt: skip
    rows, problems = read(store)
    assert rows == [good]
    assert len(problems) == 2 and all(p.startswith(f"{store}:") for p in problems), problems
    link = tmp_path / "link.sqlite"
    link.symlink_to(store)
    with pytest.raises(ExecutionStoreError, match="must be a regular file"):
        read(link)
    (tmp_path / "junk.sqlite").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(ExecutionStoreError, match="remove it"):
        read(tmp_path / "junk.sqlite")
    with pytest.raises(ExecutionStoreError, match="refusing"):
        replace_revision(store, "a" * 40, [Executed("a" * 40, "tests/x/test_a.py", "/abs")])
    assert read(store)[0] == [good]  # nothing half-written
