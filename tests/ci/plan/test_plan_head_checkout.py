"""``mizzen-ci plan --head X`` reads the registry and the imports from the checkout, so it plans
only when the checkout holds exactly X's files: another commit checked out, a tracked file
changed or an untracked (not ignored) file present is refused (exit 2, one line naming the rule
and the fix), never a plan named after X holding another tree's tests.  Without ``--head`` the
working tree is planned as it is.  Real git, the real CLI as a subprocess."""

from __future__ import annotations

import json

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=10, labels=["ci"])

CPU_TEST = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=30)\n"


@pytest.fixture
def repo(workspace):
    """main: one test; branch ``change`` (checked out): a second test; branch ``other``: the
    first test deleted and no second one (planning ``change`` from it would drop the new test)."""
    ws = workspace({".gitignore": "/ignored/\n", "tests/t/test_one.py": CPU_TEST})
    ws.git("checkout", "-q", "-b", "other", "main")
    ws.git("rm", "-q", "tests/t/test_one.py")
    ws.commit("delete the test")
    ws.git("checkout", "-q", "change")
    ws.write({"tests/t/test_two.py": CPU_TEST})
    ws.commit("a second test")
    return ws


def plan(mizzen_ci, repo, *head: str):
    out = repo.root.parent / "plan.json"
    out.unlink(missing_ok=True)
    done = mizzen_ci(
        "plan", "--root", str(repo.root), "--base", "main", *head, "--no-cache", "--same-repo",
        "--output", str(out), cwd=repo.root, timeout=120,
    )  # fmt: skip
    return done, (json.loads(out.read_text()) if out.exists() else None)


def planned_files(p: dict) -> set[str]:
    return {t["file"] for j in p["jobs"] for t in j["tests"]}


def test_a_clean_checkout_of_the_head_is_planned(mizzen_ci, repo):
    head = repo.git("rev-parse", "HEAD")
    done, p = plan(mizzen_ci, repo, "--head", head)
    assert done.returncode == 0, done.stderr
    assert p["head"] == head
    assert "tests/t/test_two.py" in planned_files(p)  # the test the change adds


def test_another_commit_checked_out_is_refused(mizzen_ci, repo):
    head = repo.git("rev-parse", "change")
    repo.git("checkout", "-q", "other")  # the planner would read other's tests
    done, p = plan(mizzen_ci, repo, "--head", head)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert p is None  # nothing written
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert f"the checkout is at {repo.git('rev-parse', 'HEAD')[:12]}, not at {head[:12]}" in line
    assert f"Fix: check out {head[:12]} in a clean tree" in line


@pytest.mark.parametrize("dirt", ["tracked", "untracked"])
def test_a_dirty_checkout_of_the_head_is_refused(mizzen_ci, repo, dirt):
    if dirt == "tracked":
        (repo.root / "tests/t/test_one.py").write_text("# no registration any more\n")
    else:
        (repo.root / "tests/t/test_three.py").write_text(CPU_TEST)
    done, p = plan(mizzen_ci, repo, "--head", "HEAD")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert p is None
    shown = "tests/t/test_one.py" if dirt == "tracked" else "tests/t/test_three.py"
    assert f"1 file(s) differ from {repo.git('rev-parse', 'HEAD')[:12]}" in done.stderr
    assert repr(shown) in done.stderr
    assert "or leave out --head to plan the working tree as it is" in done.stderr


def test_ignored_files_and_the_working_tree_plan_are_fine(mizzen_ci, repo):
    (repo.root / "ignored").mkdir()
    (repo.root / "ignored" / "cache.json").write_text("{}")
    done, _ = plan(mizzen_ci, repo, "--head", "HEAD")
    assert done.returncode == 0, done.stderr
    (repo.root / "tests/t/test_three.py").write_text(CPU_TEST)
    done, p = plan(mizzen_ci, repo)  # no --head: the working tree, as it is
    assert done.returncode == 0, done.stderr
    assert "tests/t/test_three.py" in planned_files(p)
