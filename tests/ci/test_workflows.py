"""The GitHub workflows against the planner they run: pinned actions, least privilege, no event
data in scripts, and the contract between the plan's matrix and the jobs that consume it.

(actionlint and zizmor lint the same files in the lint session; these tests pin what those tools
cannot know: that the workflows and the planner agree.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from mizzen_ci import register_cpu_ci
from mizzen_ci.plan import Job, Plan, PlannedTest, SelectionSummary
from mizzen_ci.plan.cli import matrix
from mizzen_ci.plan.request import TRUSTED_ASSOCIATIONS

register_cpu_ci(est_time=3, labels=["ci"])

PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


@pytest.fixture
def load(repo_root: Path):
    """``load(NAME)``: the parsed ``.github/workflows/NAME``."""

    def read(name: str) -> dict:
        return yaml.safe_load((repo_root / ".github" / "workflows" / name).read_text())

    return read


def triggers(wf: dict) -> dict:
    return wf.get("on") or wf.get(True)  # YAML 1.1 reads a bare `on` as true


def steps(wf: dict):
    for job_id, job in wf["jobs"].items():
        for step in job.get("steps", []):
            yield job_id, step


def test_the_three_workflows_exist(workflow_files):
    assert {f.name for f in workflow_files} >= {"pr.yml", "nightly.yml", "comment.yml"}


def test_actions_are_pinned_by_full_commit_sha(workflow_file):
    path = workflow_file
    wf = yaml.safe_load(path.read_text())
    for job in wf["jobs"].values():
        uses = [job["uses"]] if "uses" in job else [s["uses"] for s in job["steps"] if "uses" in s]
        for u in uses:
            assert u.startswith("$/") or PINNED.match(u), f"{path.name}: {u} is not pinned"
    comments = re.findall(r"uses: \S+@[0-9a-f]{40}(.*)", path.read_text())
    assert all(re.match(r" # v\d", c) for c in comments), "a pinned SHA names its version"


def test_least_privilege_and_no_expression_inside_scripts(workflow_file):
    path = workflow_file
    wf = yaml.safe_load(path.read_text())
    assert wf["permissions"] == {}, "workflow-level permissions are empty; jobs ask for theirs"
    for job_id, job in wf["jobs"].items():
        perms = job.get("permissions")
        assert perms is not None, f"{path.name}: job {job_id} states its permissions"
        assert set(perms.values()) <= {"read"}, f"{path.name}: job {job_id} asks to write"
    for job_id, step in steps(wf):
        assert "${{" not in step.get("run", ""), f"{path.name}: {job_id} expands into a script"
        if step.get("uses", "").startswith("actions/checkout@"):
            assert step["with"]["persist-credentials"] is False


def test_the_matrix_the_plan_writes_is_what_the_lane_jobs_read(load):
    pr = load("pr.yml")
    lanes = pr["jobs"]["lanes"]
    assert lanes["runs-on"] == "${{ fromJSON(matrix.runs_on) }}"
    assert lanes["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    read = set(re.findall(r"matrix\.(\w+)", yaml.safe_dump(lanes)))
    test = PlannedTest("tests/gpu/test_x.py", 1, 60.0, "est_time", 0.0, "asked for")
    job = Job("hopper-h200-2gpu-1", "gpu-hopper", "hopper", "h200-2gpu", ("self-hosted", "h200"),
              2, 30, False, 60.0, (test,))  # fmt: skip
    plan = Plan("pull_request", None, None, None, False, True, 3600.0,
                SelectionSummary(False, (), 1), jobs=[job])  # fmt: skip
    (entry,) = matrix(plan)["include"]
    assert read <= set(entry), f"the lanes job reads {read - set(entry)} the matrix lacks"
    assert json.loads(entry["runs_on"]) == ["self-hosted", "h200"]
    run = next(s["run"] for _, s in steps(pr) if "nox -s" in s.get("run", ""))
    assert '-- --job "$JOB_ID" --plan plan.json' in run
    plan_step = next(s for _, s in steps(pr) if s.get("id") == "plan")
    assert "python3 -S -m mizzen_ci plan" in plan_step["run"]
    assert {"matrix", "jobs"} <= set(pr["jobs"]["plan"]["outputs"])


def test_lane_sessions_named_by_the_planner_exist_in_the_noxfile(repo_root):
    noxfile = (repo_root / "noxfile.py").read_text()
    assert re.search(r"^def cpu\(", noxfile, re.M) and re.search(r"^def plan\(", noxfile, re.M)
    # the gpu-<arch> sessions are generated from the fleet table, one per generation, named as the
    # planner names their lanes
    assert re.search(r"name=lane_name\(arch\)", noxfile)


def test_comment_commands_only_from_the_trusted_associations_of_the_planner(load):
    wf = load("comment.yml")
    assert set(triggers(wf)) == {"issue_comment"}
    (job,) = wf["jobs"].values()
    listed = set(re.findall(r'"([A-Z_]+)"', job["if"]))
    assert listed == TRUSTED_ASSOCIATIONS
    assert "github.event.comment.author_association" in job["if"]
    assert job["with"]["comment_body"] == "${{ github.event.comment.body }}"  # data, into env


def test_nightly_and_weekly_cadences(load):
    wf = load("nightly.yml")
    crons = [c["cron"] for c in triggers(wf)["schedule"]]
    cadence = wf["jobs"]["run"]["with"]["cadence"]
    weekly = re.search(r"github\.event\.schedule == '([^']+)' && 'weekly'", cadence).group(1)
    assert weekly in crons and len(crons) == 2
    nightly = next(c for c in crons if c != weekly)
    assert nightly.split()[:2] == weekly.split()[:2]  # same time of day, different days
    assert wf["jobs"]["run"]["uses"] == "$/.github/workflows/pr.yml"
    assert wf["jobs"]["history"]["cache-mode"] == "write"  # the only writer of the cache


def test_pr_workflow_triggers_and_read_only_cache(load):
    pr = load("pr.yml")
    assert set(triggers(pr)) == {"pull_request", "push", "merge_group", "workflow_call"}
    assert "labeled" in triggers(pr)["pull_request"]["types"]  # ok-to-test / run-ci-* labels
    for job_id, job in pr["jobs"].items():
        assert job.get("cache-mode") in ("read", "none"), job_id
