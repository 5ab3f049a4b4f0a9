"""``mizzen-ci bisect``'s usage and outputs: a ``--markdown`` path that cannot be written is
exit 2 with one line before the bisect runs (never a traceback after it), and a good one gets
the result appended, masked; ``--failed-jobs`` names a missing history (exit 2) unless
``--allow-missing`` says no history is an answer; ``--test`` follows the gate's one test-path
rule (no ``..``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=8, labels=["ci"])


def _bisect(root: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mizzen_ci", "bisect", "--root", str(root), *args]
    return subprocess.run(command, env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, timeout=180, check=False)  # fmt: skip


@pytest.mark.parametrize("where", ["folder", "under-a-file"])
def test_a_markdown_path_that_cannot_be_written_is_exit_2_before_the_bisect(history, where):
    root, shas, _git = history(n=4, break_at=2)
    (root / "notes.txt").write_text("a file\n")
    markdown = root if where == "folder" else root / "notes.txt" / "bisect.md"
    done = _bisect(root, "--good", shas[0], "--bad", shas[-1],
                   "--test", "tests/alpha/test_core.py", "--markdown", str(markdown))  # fmt: skip
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and "first bad commit" not in done.stdout, done
    assert done.stdout == "", done  # nothing ran, nothing printed
    (line,) = done.stderr.splitlines()
    assert line.startswith("mizzen-ci bisect: --markdown ") and str(markdown) in line, line


def test_the_result_is_appended_to_the_markdown_file_masked(history, tmp_path):
    root, shas, git = history(n=3, break_at=99)
    token = "ghs_" + "T0KEN" * 4
    (root / "packages/alpha/src/alpha/core.py").write_text("def answer():\n    return 41\n")
    git(root, "commit", "-q", "-am", f"break it {token}")  # the first bad commit's subject
    bad = git(root, "rev-parse", "HEAD")
    markdown = tmp_path / "summary" / "step.md"
    markdown.parent.mkdir()
    markdown.write_text("earlier steps\n")
    done = _bisect(root, "--good", shas[0], "--bad", bad, "--test", "tests/alpha/test_core.py",
                   "--markdown", str(markdown), env={"GITHUB_TOKEN": token})  # fmt: skip
    assert done.returncode == 0 and f"first bad commit: {bad} break it ***" in done.stdout, done
    text = markdown.read_text()
    assert text.startswith("earlier steps\n## Bisect\n\n"), text
    assert f"first bad commit\\: {bad} break it \\*\\*\\*" in text, text
    assert token not in text + done.stdout + done.stderr


def _record(outcome: str, job: str) -> str:
    when = datetime.now(UTC).replace(microsecond=0).isoformat()
    return json.dumps({"file": "tests/alpha/test_core.py", "arch": None, "seconds": 1.0,
                       "outcome": outcome, "when": when, "lane": "cpu", "job": job})  # fmt: skip


def test_failed_jobs_names_a_missing_history_unless_allowed(tmp_path):
    missing = tmp_path / "histroy"  # a typo
    done = _bisect(tmp_path, "--failed-jobs", str(missing))
    assert done.returncode == 2 and done.stdout == "", done
    (line,) = done.stderr.splitlines()
    assert f"--failed-jobs {missing}: no such file or folder" in line and "Traceback" not in line
    # the nightly's case: a failed run may have uploaded no history-* artefact at all
    done = _bisect(tmp_path, "--failed-jobs", str(missing), "--allow-missing")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done
    store = tmp_path / "history" / "history-cpu"
    store.mkdir(parents=True)
    lines = [_record("failed", "cpu-2"), _record("passed", "cpu-1"), _record("error", "cpu-0")]
    (store / "durations.jsonl").write_text("\n".join(lines) + "\n")
    for extra in ([], ["--allow-missing"]):
        done = _bisect(tmp_path, "--failed-jobs", str(tmp_path / "history"), *extra)
        assert (done.returncode, done.stdout) == (0, "cpu-0\ncpu-2\n"), done
    done = _bisect(tmp_path, "--good", "HEAD~1", "--bad", "HEAD", "--allow-missing")
    assert done.returncode == 2 and "--allow-missing goes with --failed-jobs" in done.stderr


@pytest.mark.parametrize(
    "test",
    ["tests/../../../etc/test_x.py", "tests/alpha/../../test_x.py", "/tests/alpha/test_core.py",
     "tests/alpha/test_core.py::", "tests/alpha/test_core.py::a\x1bb", "tests/alpha/core.py"],
)  # fmt: skip
def test_a_test_outside_tests_is_refused_by_the_gates_rule(tmp_path, test):
    done = _bisect(tmp_path, "--good", "HEAD~1", "--bad", "HEAD", "--test", test)
    assert done.returncode == 2 and done.stdout == "", done
    (line,) = done.stderr.splitlines()
    assert "--test must be tests/…/test_*.py or FILE::NAME" in line and "Traceback" not in line


@pytest.mark.parametrize("what", ["link", "not-utf8", "link-in-place-of-the-folder"])
def test_failed_jobs_names_a_history_it_cannot_read_even_with_allow_missing(tmp_path, what):
    # a link (refused by the history reader with a warning) printed nothing, exit 0: "no failed
    # jobs"; --allow-missing allows a missing history only
    real = tmp_path / "real" / "durations.jsonl"
    real.parent.mkdir()
    real.write_text(_record("failed", "cpu-2") + "\n")
    store = tmp_path / "history"
    if what == "link":
        store.mkdir()
        (store / "good.jsonl").write_text(_record("failed", "cpu-1") + "\n")
        unread = store / "durations.jsonl"
        unread.symlink_to(real)
        given = unread
    elif what == "not-utf8":
        store.mkdir()
        unread = store / "durations.jsonl"
        unread.write_bytes(b"\xff\xfe" + _record("failed", "cpu-1").encode() + b"\n")
        given = store
    else:
        store.symlink_to(real.parent)
        unread = given = store
    for extra in ([], ["--allow-missing"]):
        done = _bisect(tmp_path, "--failed-jobs", str(given), *extra)
        assert done.returncode == 2 and done.stdout == "", done
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"mizzen-ci bisect: --failed-jobs {given}: 1 history store(s) "
                               f"cannot be read, so the failed jobs are unknown"), line  # fmt: skip
        assert f"{unread}: " in line and "Traceback" not in line
