"""Outputs of ``mizzen-ci plan``, ``comment`` and ``fastfail`` are all or nothing (issue: hostile
output paths): every output path is checked before anything is written or printed, so a folder
where a file is wanted, or a file where a folder is, is exit 2 with one line naming the option,
the path and the fix — no traceback, no answer already printed, no plan.json or
``$GITHUB_OUTPUT`` line left behind.  A pull request whose *base* has a fleet table of the wrong
shape is refused the same way (the base's table decides pools and labels)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.plan import Plan, SelectionSummary

register_cpu_ci(est_time=8, labels=["ci"])

HEAD = "a" * 40
TESTS = {
    "pyproject.toml": '[project]\nname = "t"\nversion = "0"\n',
    "tests/t/test_cpu.py": "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=5)\n",
}


@pytest.fixture
def repo(workspace):
    ws = workspace(TESTS)
    ws.write({"tests/t/test_cpu.py": TESTS["tests/t/test_cpu.py"] + "# changed\n"})
    ws.commit()
    out = ws.root.parent / "out"
    out.mkdir()
    (out / "adir").mkdir()
    (out / "afile").write_text("a file\n")
    return ws


def one_line_refusal(done, option: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert option in done.stderr and "Fix:" in done.stderr, done.stderr
    assert done.stdout == "", done.stdout  # nothing printed before the refusal


def left(out: Path) -> dict[str, str]:
    """Every file under ``out`` (temporary files included) and its text."""
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}


def plan(ws, mizzen_ci, *args: str):
    return mizzen_ci("plan", "--root", str(ws.root), "--event", "push", "--base", "main",
                     "--head", "HEAD", "--no-cache", *args, cwd=ws.root, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    ("outputs", "option"),
    [
        ({"--output": "adir"}, "--output"),
        ({"--output": "plan.json", "--summary": "afile/s.md"}, "--summary"),
        ({"--output": "plan.json", "--summary": "s.md", "--github-output": "adir"},
         "--github-output"),
        ({"--github-output": "gh.txt", "--summary": "adir"}, "--summary"),
        ({"--output": "same.txt", "--summary": "same.txt"}, "--summary"),
    ],
)  # fmt: skip
def test_a_plan_output_that_cannot_be_written_writes_nothing(repo, mizzen_ci, outputs, option):
    out = repo.root.parent / "out"
    (out / "gh.txt").write_text("before=1\n")
    before = left(out)
    args = [x for o, p in outputs.items() for x in (o, str(out / p))]
    one_line_refusal(plan(repo, mizzen_ci, *args), option)
    assert left(out) == before  # plan.json not written, $GITHUB_OUTPUT not appended to


def test_plan_outputs_are_written_whole_appending_where_github_appends(repo, mizzen_ci):
    out = repo.root.parent / "out"
    (out / "gh.txt").write_text("before=1\n")
    (out / "s.md").write_text("# earlier step\n")
    done = plan(repo, mizzen_ci, "--output", str(out / "new" / "dir" / "plan.json"),
                "--summary", str(out / "s.md"), "--github-output", str(out / "gh.txt"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "new" / "dir" / "plan.json").read_text())["event"] == "push"
    gh = (out / "gh.txt").read_text()
    assert gh.startswith("before=1\nmatrix=") and gh.endswith("\n") and "\njobs=" in gh
    assert (out / "s.md").read_text().startswith("# earlier step\n") and len(left(out)) == 4
    assert not [p for p in out.rglob(".*")]  # no temporary file left


def test_a_pull_request_whose_base_fleet_has_a_bad_shape_is_refused(workspace, mizzen_ci):
    fleet = (Path(__file__).parents[1] / "fixtures" / "plan" / "small_fleet.toml").read_text()
    ws = workspace({**TESTS, "ci/fleet.toml": "pool = 5\n" + fleet.replace("[[pool]]", "[[p]]")})
    ws.write({"ci/fleet.toml": fleet})  # the head's table is fine: the base's decides
    ws.commit()
    done = mizzen_ci("plan", "--root", str(ws.root), "--base", "main", "--head", "HEAD",
                     "--same-repo", "--no-cache", cwd=ws.root, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "the base revision's fleet table is broken" in done.stderr
    assert "pool must be a list of tables, got 5. Fix:" in done.stderr


# -- comment and fastfail ---------------------------------------------------------------------

RUN_URL = "https://github.com/o/r/actions/runs/123"


@pytest.mark.parametrize(
    ("outputs", "option"),
    [
        ({"--github-output": "adir"}, "--github-output"),
        ({"--github-output": "gh.txt", "--reply": "adir"}, "--reply"),
        ({"--github-output": "gh.txt", "--reply": "afile/r.md"}, "--reply"),
    ],
)
def test_comment_outputs_that_cannot_be_written_write_nothing(tmp_path, mizzen_ci, outputs, option):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("a file\n")
    (tmp_path / "body.txt").write_text("/run-ci lora\n")
    before = left(tmp_path)
    args = [x for o, p in outputs.items() for x in (o, str(tmp_path / p))]
    done = mizzen_ci("comment", "--body-file", str(tmp_path / "body.txt"), "--association",
                     "MEMBER", f"--run-url={RUN_URL}", f"--head={HEAD}", *args)  # fmt: skip
    one_line_refusal(done, option)
    assert left(tmp_path) == before  # no run=true in $GITHUB_OUTPUT without its reply


def test_fastfail_summary_that_cannot_be_written_prints_no_verdict(tmp_path, mizzen_ci):
    plan = Plan(event="pull_request", cadence=None, base="b" * 40, head=HEAD, worktree=False,
                trusted=True, approval=None, fleet="ci/fleet.toml", budget_seconds=3600.0,
                selection=SelectionSummary(False, (), 1), fast_fail=True,
                fast_fail_reason="why")  # fmt: skip
    (tmp_path / "plan.json").write_text(plan.dumps())
    run = {"id": 41, "head_sha": HEAD, "event": "pull_request", "status": "completed",
           "conclusion": "success", "path": ".github/workflows/pr.yml", "run_attempt": 1}  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps({"total_count": 1, "workflow_runs": [run]}))
    pull = {"state": "open", "head": {"sha": HEAD}, "labels": []}
    (tmp_path / "pull.json").write_text(json.dumps(pull))
    (tmp_path / "adir").mkdir()
    args = ["fastfail", *(f"--{k}={tmp_path / k}.json" for k in ("plan", "runs", "pull"))]
    done = mizzen_ci(*args, "--summary", str(tmp_path / "adir"))
    one_line_refusal(done, "--summary")
    done = mizzen_ci(*args, "--summary", str(tmp_path / "s.md"))
    assert (done.returncode, done.stdout) == (0, "pass\n")
    assert (tmp_path / "s.md").read_text().startswith("## Fast-fail: pass")
