"""Fixtures of the bisect tests: ``history(n, break_at, registry_errors_at)`` commits a
synthetic repository of ``n`` commits on ``main`` (commit ``i`` has the subject ``c<i>``): one
package ``alpha`` whose ``answer()`` returns 42 until commit ``break_at`` makes it 41, one test
asserting 42, and at each commit of ``registry_errors_at`` an unregistered test file (a registry
error the next commit removes).  It returns ``(root, shas, git)``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SMALL_FLEET = Path(__file__).parents[1] / "fixtures" / "plan" / "small_fleet.toml"
TEST = """\
import os
import time
from pathlib import Path

from alpha.core import answer
from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=5, labels=["ci"])


def test_answer():
    marker = os.environ.get("BISECT_MARKER")
    if marker:  # the interrupt test: say "running", then take long enough to be interrupted
        Path(marker).write_text("running")
        time.sleep(60)
    assert answer() == 42
"""


def git(root: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    done = subprocess.run(["git", "-C", str(root), "-c", "commit.gpgsign=false", *args],
                          capture_output=True, text=True, env=env, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _history(root: Path, n: int, break_at: int, registry_errors_at=()) -> list[str]:
    files = {
        "pyproject.toml": '[project]\nname = "ws"\nversion = "0"\n\n'
        '[tool.uv.workspace]\nmembers = ["packages/alpha"]\n',
        "ci/fleet.toml": SMALL_FLEET.read_text(),
        "packages/alpha/pyproject.toml": '[project]\nname = "alpha"\nversion = "0"\n',
        "packages/alpha/src/alpha/__init__.py": "",
        "tests/alpha/test_core.py": TEST,
    }
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    shas = []
    for i in range(n):
        files["packages/alpha/src/alpha/core.py"] = (
            f"STEP = {i}\n\n\ndef answer():\n    return {41 if i >= break_at else 42}\n"
        )
        broken = root / "tests/alpha/test_unregistered.py"
        if i in registry_errors_at:
            files[str(broken.relative_to(root))] = "def test_x():\n    pass\n"
        else:
            files.pop("tests/alpha/test_unregistered.py", None)
            broken.unlink(missing_ok=True)
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", f"c{i}")
        shas.append(git(root, "rev-parse", "HEAD"))
    return shas


@pytest.fixture
def history(tmp_path):
    def make(n=32, break_at=19, registry_errors_at=()):
        root = tmp_path / "repo"
        return root, _history(root, n, break_at, registry_errors_at), git

    return make
