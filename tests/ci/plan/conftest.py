"""Fixtures of the plan tests: small workspaces committed to real temporary git repositories.

``workspace(files)`` commits ``files`` ({path: text}) on ``main`` with the small fleet of
``tests/ci/fixtures/plan/small_fleet.toml`` (unless ``files`` holds its own ``ci/fleet.toml``) and
checks out a branch ``change``; the :class:`Workspace` it returns writes, deletes, renames and
commits on that branch and plans the change in process (``Workspace.plan(**inputs)``: the plan
JSON of ``main..HEAD``, pools and runner labels from the base's fleet as ``mizzen-ci plan`` takes
them for a pull request).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mizzen_ci.fleet import load_fleet, parse_fleet
from mizzen_ci.plan.change import Change, Entry, file_at, git_change
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs

SMALL_FLEET = Path(__file__).parents[1] / "fixtures" / "plan" / "small_fleet.toml"


class Workspace:
    """One temporary repository on its branch ``change`` (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root

    def git(self, *args: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env |= {"GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
        env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
        done = subprocess.run(
            ["git", "-C", str(self.root), "-c", "commit.gpgsign=false", *args],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def write(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def commit(self, message: str = "change") -> None:
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)

    def plan(self, base: str = "main", head: str | None = "HEAD", **inputs) -> dict:
        """The plan JSON of ``base..head`` under ``Inputs(**inputs)`` (default: a pull request
        from this repository), with the base's fleet as its pools."""
        options = inputs.pop("options", PlanOptions())
        inputs.setdefault("fork", False)
        change = git_change(self.root, base, head)
        fleet = load_fleet(self.root / "ci" / "fleet.toml")
        pools = parse_fleet(file_at(self.root, change.base, "ci/fleet.toml"), "base fleet")
        return build_plan(self.root, fleet, change, Inputs(**inputs), options, pools).to_json()


def _make_workspace(root: Path, files: dict[str, str]) -> Workspace:
    ws = Workspace(root)
    ws.write({"ci/fleet.toml": SMALL_FLEET.read_text(), **files})
    ws.git("init", "-q", "-b", "main")
    ws.commit("base")
    ws.git("checkout", "-q", "-b", "change")
    return ws


@pytest.fixture
def workspace(tmp_path: Path):
    return lambda files: _make_workspace(tmp_path / "repo", files)


@pytest.fixture(scope="module")
def module_workspace(tmp_path_factory):
    """``module_workspace(files)``: like ``workspace``, one per call, for a whole module (a
    property test resets its branch ``change`` for each example)."""
    return lambda files: _make_workspace(tmp_path_factory.mktemp("ws") / "repo", files)


def _planned_cpu_tests(root: Path, *paths: str) -> dict[str, str]:
    """``{test file: why}`` of the CPU jobs planned, without git, for a pull request changing
    ``paths`` of the workspace ``root`` (its own ``ci/fleet.toml``); never "everything"."""
    change = Change.from_entries("a" * 40, "b" * 40, [Entry("M", p) for p in paths])
    plan = build_plan(root, load_fleet(root / "ci" / "fleet.toml"), change, Inputs(), PlanOptions())
    data = plan.to_json()
    assert not data["selection"]["everything"], data["selection"]
    return {t["file"]: t["why"] for j in data["jobs"] for t in j["tests"]}


@pytest.fixture(scope="session")
def selected():
    """:func:`_planned_cpu_tests`: ``selected(root, *changed_paths) -> {test file: why}``."""
    return _planned_cpu_tests
