"""Fixtures of the audit tests.

``hidden_path_repo``: a synthetic workspace (package ``alpha``) committed to a real git
repository, whose one test reaches ``alpha/hidden.py`` only through a pickle it reads
(``pickle.loads`` imports the module the bytes name: no import statement, string or path in any
Python file names it), and reaches ``alpha/core.py`` through a plain import.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SMALL_FLEET = Path(__file__).parents[1] / "fixtures" / "plan" / "small_fleet.toml"
FILES = {
    "pyproject.toml": '[project]\nname = "ws"\nversion = "0"\n\n'
    '[tool.uv.workspace]\nmembers = ["packages/alpha"]\n',
    "packages/alpha/pyproject.toml": '[project]\nname = "alpha"\nversion = "0"\n',
    "packages/alpha/src/alpha/__init__.py": "",
    "packages/alpha/src/alpha/core.py": "def double(x):\n    return 2 * x\n",
    "packages/alpha/src/alpha/hidden.py": "def answer():\n    return 42\n",
    # protocol-0 pickle of alpha.hidden.answer: unpickling imports alpha.hidden
    "tests/alpha/answer.pickle": "calpha.hidden\nanswer\np0\n.",
    "tests/alpha/test_core.py": """\
import pickle
from pathlib import Path

from alpha.core import double
from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=5, labels=["ci"])


def test_double():
    assert double(2) == 4


def test_answer_from_a_pickle():
    loaded = pickle.loads((Path(__file__).parent / "answer.pickle").read_bytes())
    assert loaded() == 42
""",
}


def git(root: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    done = subprocess.run(["git", "-C", str(root), "-c", "commit.gpgsign=false", *args],
                          capture_output=True, text=True, env=env, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def hidden_path_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("audit") / "repo"
    for rel, text in {"ci/fleet.toml": SMALL_FLEET.read_text(), **FILES}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root
