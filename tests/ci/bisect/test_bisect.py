"""``mizzen-ci bisect`` on a 32-commit synthetic history with a planted break (commit c19) and
planted registry errors: it finds c19 in at most 6 runs, skips the commits with registry errors,
and leaves the user's work tree, index and branch as they were, also when interrupted by SIGINT
mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=40, labels=["ci"])


def _state(root: Path, git) -> dict:
    return {
        "head": git(root, "rev-parse", "HEAD"),
        "branch": git(root, "symbolic-ref", "HEAD"),
        "status": git(root, "status", "--porcelain", "--untracked-files=all"),
        "refs": git(root, "for-each-ref", "--format=%(refname) %(objectname)"),
        "worktrees": git(root, "worktree", "list", "--porcelain"),
        "bisect_log": (root / ".git" / "BISECT_LOG").exists(),
    }


def _bisect(root: Path, *args: str, env=None, **kw):
    command = [sys.executable, "-m", "mizzen_ci", "bisect", "--root", str(root), *args]
    return subprocess.Popen(command, env={**os.environ, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)  # fmt: skip


def test_finds_the_planted_break_in_at_most_six_runs_skipping_registry_errors(history):
    root, shas, git = history(registry_errors_at=(15, 16))
    (root / "notes.txt").write_text("the user's uncommitted work\n")  # an untracked file
    (root / "packages/alpha/src/alpha/core.py").write_text("# edited, not committed\n")
    before = _state(root, git)
    proc = _bisect(root, "--good", shas[0], "--bad", shas[-1],
                   "--test", "tests/alpha/test_core.py::test_answer")  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert f"first bad commit: {shas[19]} c19" in out, out
    runs = int(out.rsplit("found in ", 1)[1].split()[0])
    skipped = int(out.rsplit("runs of the tests; ", 1)[1].split()[0])
    assert runs <= 6, out
    assert skipped >= 1, out  # the bisect met a planted registry error and skipped it
    assert _state(root, git) == before


def test_a_job_of_a_plan_and_a_bad_revision_that_passes(history, tmp_path):
    root, shas, _git = history(n=4, break_at=99)
    proc = _bisect(root, "--good", shas[0], "--bad", shas[-1], "--test", "tests/alpha/test_core.py")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "no first bad commit" in out, out
    proc = _bisect(root, "--good", shas[-1], "--bad", shas[0], "--test", "tests/alpha/test_core.py")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "is not an ancestor" in out, out
    proc = _bisect(root, "--good", "nope", "--bad", shas[0], "--test", "tests/alpha/test_core.py")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "names no commit" in out and "Traceback" not in out, out


def test_interrupted_by_sigint_leaves_the_tree_and_branch_as_they_were(history, tmp_path):
    root, shas, git = history(n=8, break_at=5)
    (root / "notes.txt").write_text("the user's uncommitted work\n")
    before = _state(root, git)
    marker = tmp_path / "running"
    proc = _bisect(root, "--good", shas[0], "--bad", shas[-1], "--test",
                   "tests/alpha/test_core.py", env={"BISECT_MARKER": str(marker)})  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert _state(root, git) == before
    assert (root / "notes.txt").read_text() == "the user's uncommitted work\n"
    # the step's pytest (sleeping 60 s) was killed with its process group
    found = subprocess.run(["pgrep", "-f", f"BISECT_MARKER|{marker}"], capture_output=True)
    assert found.returncode == 1, found.stdout
