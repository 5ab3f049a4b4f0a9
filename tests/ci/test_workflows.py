"""The GitHub workflows against the planner they run: pinned actions, least privilege, no event
data in scripts, the contract between the plan's matrix and the jobs that consume it, and the
trust facts: no job a pull request's own workflow file defines can get a self-hosted runner, the
self-hosted runs-on comes only from the default branch's planner, approved runs are pinned to a
commit, the cheap checks are required.

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

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def triggers(wf: dict) -> dict:
    return wf.get("on") or wf.get(True)  # YAML 1.1 reads a bare `on` as true


def steps(wf: dict):
    for job_id, job in wf["jobs"].items():
        for step in job.get("steps", []):
            yield job_id, step


def test_the_workflows_exist():
    assert {f.name for f in FILES} >= {"pr.yml", "gpu.yml", "nightly.yml", "comment.yml"}


def callers_of(name: str) -> dict[str, list[str]]:
    """{workflow file: its jobs that call the reusable workflow ``name``}."""
    out: dict[str, list[str]] = {}
    for path in FILES:
        for job_id, job in yaml.safe_load(path.read_text())["jobs"].items():
            if job.get("uses") == f"$/.github/workflows/{name}":
                out.setdefault(path.name, []).append(job_id)
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_actions_are_pinned_by_full_commit_sha(path):
    wf = yaml.safe_load(path.read_text())
    for job in wf["jobs"].values():
        uses = [job["uses"]] if "uses" in job else [s["uses"] for s in job["steps"] if "uses" in s]
        for u in uses:
            assert u.startswith("$/") or PINNED.match(u), f"{path.name}: {u} is not pinned"
    comments = re.findall(r"uses: \S+@[0-9a-f]{40}(.*)", path.read_text())
    assert all(re.match(r" # v\d", c) for c in comments), "a pinned SHA names its version"


# The only write a workflow may ask for: commit statuses, from the job that posts `mizzen/gpu`
# (it runs no code of the change: no checkout at all) and from the callers of gpu.yml (a called
# workflow never gets more than its caller grants).
STATUS_WRITERS = {("gpu.yml", "report")} | {
    (f, j) for f, jobs in callers_of("gpu.yml").items() for j in jobs
}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_least_privilege_and_no_expression_inside_scripts(path):
    wf = yaml.safe_load(path.read_text())
    assert wf["permissions"] == {}, "workflow-level permissions are empty; jobs ask for theirs"
    for job_id, job in wf["jobs"].items():
        perms = job.get("permissions")
        assert perms is not None, f"{path.name}: job {job_id} states its permissions"
        writes = {k for k, v in perms.items() if v != "read"}
        if (path.name, job_id) in STATUS_WRITERS:
            assert writes == {"statuses"} and perms["statuses"] == "write", (path.name, job_id)
        else:
            assert not writes, f"{path.name}: job {job_id} asks to write {sorted(writes)}"
        if "statuses" in writes and "steps" in job:
            assert not any("actions/checkout@" in st.get("uses", "") for st in job["steps"])
    for job_id, step in steps(wf):
        assert "${{" not in step.get("run", ""), f"{path.name}: {job_id} expands into a script"
        if step.get("uses", "").startswith("actions/checkout@"):
            assert step["with"]["persist-credentials"] is False


def planned(runner_group: str | None) -> Plan:
    test = PlannedTest("tests/t/test_x.py", 1, 60.0, "est_time", 0.0, "asked for")
    gpu = Job(id="hopper-h200-2gpu-1", lane="gpu-hopper", arch="hopper", pool="h200-2gpu",
              runs_on=("self-hosted", "h200"), runner_group="mizzen-h200", gpus=2,
              timeout_minutes=30, over_budget=False, est_seconds=60.0, tests=(test,))  # fmt: skip
    cpu = Job(id="cpu-1", lane="cpu", arch=None, pool="cpu-hosted", runs_on=("ubuntu-24.04",),
              runner_group=None, gpus=1, timeout_minutes=20, over_budget=False,
              est_seconds=60.0, tests=(test,))  # fmt: skip
    return Plan(event="pull_request", cadence=None, base=None, head="a" * 40, worktree=False,
                trusted=True, approval=None, fleet="ci/fleet.toml", budget_seconds=3600.0,
                selection=SelectionSummary(False, (), 1), jobs=[cpu, gpu])  # fmt: skip


@pytest.mark.parametrize(
    ("workflow", "job_id", "kind"),
    [("pr.yml", "lanes", "hosted"), ("gpu.yml", "gpu", "self-hosted")],
)
def test_the_matrix_the_plan_writes_is_what_the_lane_jobs_read(workflow, job_id, kind):
    wf = load(workflow)
    lanes = wf["jobs"][job_id]
    assert lanes["runs-on"].startswith("${{ fromJSON(matrix.runs_on) }}")
    assert lanes["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    read = set(re.findall(r"matrix\.(\w+)", yaml.safe_dump(lanes)))
    (entry,) = matrix(planned(None), kind)["include"]
    assert read <= set(entry), f"the lane job reads {read - set(entry)} the matrix lacks"
    if kind == "hosted":
        assert json.loads(entry["runs_on"]) == ["ubuntu-24.04"]
    else:  # a runner group holds self-hosted machines: runs-on names it
        assert json.loads(entry["runs_on"]) == {
            "group": "mizzen-h200",
            "labels": ["self-hosted", "h200"],
        }
    run = next(st["run"] for st in lanes["steps"] if "nox -s" in st.get("run", ""))
    assert '-- --job "$JOB_ID" --plan plan.json' in run
    assert "python3 -S -m mizzen_ci plan" in plan_step(wf)["run"]
    assert {"matrix", "jobs", "sha"} <= set(wf["jobs"]["plan"]["outputs"])


def test_lane_sessions_named_by_the_planner_exist_in_the_noxfile():
    noxfile = (REPO / "noxfile.py").read_text()
    assert re.search(r"^def cpu\(", noxfile, re.M) and re.search(r"^def plan\(", noxfile, re.M)
    # the gpu-<arch> sessions are generated from the fleet table, one per generation, named as the
    # planner names their lanes
    assert re.search(r"name=lane_name\(arch\)", noxfile)


def plan_step(wf: dict, job: str = "plan") -> dict:
    return next(st for st in wf["jobs"][job]["steps"] if st.get("id") == "plan")


HOSTED = re.compile(r"^ubuntu-\d+\.\d+$")


def test_a_pull_request_workflow_never_asks_for_a_self_hosted_runner():
    # Under pull_request a fork's own copy of the file runs: such a workflow runs hosted jobs only,
    # its lane matrix holds hosted jobs only, and it starts no GPU workflow.
    for path in FILES:
        wf = yaml.safe_load(path.read_text())
        if "pull_request" not in triggers(wf):
            continue
        for job_id, job in wf["jobs"].items():
            assert "uses" not in job, f"{path.name}: {job_id} calls a workflow"
            runs_on = job["runs-on"]
            if runs_on == "${{ fromJSON(matrix.runs_on) }}":
                matrix_from = re.search(r"needs\.(\w+)\.outputs\.matrix", job["strategy"]["matrix"])
                assert "--matrix hosted" in plan_step(wf, matrix_from.group(1))["run"]
            else:
                assert HOSTED.match(runs_on), f"{path.name}: {job_id} runs on {runs_on!r}"
        assert "self-hosted" not in yaml.safe_dump(wf), path.name  # (comments aside)


def test_self_hosted_jobs_come_only_from_the_default_branchs_planner_and_pinned_head():
    gpu = load("gpu.yml")
    # every trigger runs the default branch's definition of the file
    assert set(triggers(gpu)) == {"pull_request_target", "push", "workflow_call"}
    assert triggers(gpu)["push"]["branches"] == ["main"]
    for caller in callers_of("gpu.yml"):
        assert "pull_request" not in triggers(load(caller)), caller
    plan = gpu["jobs"]["plan"]
    trusted, tree = (st for st in plan["steps"] if "actions/checkout@" in st.get("uses", ""))
    assert trusted["with"]["path"] == "trusted" and "ref" not in trusted["with"]  # own commit
    assert tree["with"]["path"] == "tree"
    assert tree["with"]["ref"] == (
        "${{ inputs.sha || github.event.pull_request.head.sha || github.sha }}"
    )  # a commit, never refs/pull/N/merge or a branch name
    step = plan_step(gpu)
    assert step["env"]["PYTHONPATH"] == "trusted/ci/src"  # the planner that decides trust
    assert "--root tree" in step["run"] and "--matrix self-hosted" in step["run"]
    assert "--head=$HEAD_SHA" in step["run"]
    job = gpu["jobs"]["gpu"]
    assert job["runs-on"].startswith("${{ fromJSON(matrix.runs_on) }}")
    assert job["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    (checkout,) = (st for st in job["steps"] if "actions/checkout@" in st.get("uses", ""))
    assert checkout["with"]["ref"] == "${{ needs.plan.outputs.sha }}"  # the planned head only
    # no other workflow can route a job by a plan's matrix
    for path in FILES:
        if path.name != "gpu.yml":
            assert "--matrix self-hosted" not in path.read_text(), path.name


def test_the_checks_job_is_required_and_runs_the_cheap_checks():
    pr = load("pr.yml")
    assert "checks" in pr["jobs"]["ci"]["needs"]
    run = " ".join(st.get("run", "") for st in pr["jobs"]["checks"]["steps"])
    assert "mizzen_ci validate" in run and "lazy-imports --static" in run
    assert "nox -s lint" in run
    assert '[ "$CHECKS" = success ]' in pr["jobs"]["ci"]["steps"][0]["run"]


def test_comment_commands_only_from_the_trusted_associations_of_the_planner():
    wf = load("comment.yml")
    assert set(triggers(wf)) == {"issue_comment"}
    parse = wf["jobs"]["parse"]
    listed = set(re.findall(r'"([A-Z_]+)"', parse["if"]))
    assert listed == TRUSTED_ASSOCIATIONS
    assert "github.event.comment.author_association" in parse["if"]
    read = next(st for st in parse["steps"] if st.get("id") == "read")
    assert read["env"]["BODY"] == "${{ github.event.comment.body }}"  # data, into env
    assert "mizzen_ci comment --body-file" in read["run"]
    pin = next(st for st in parse["steps"] if st.get("id") == "pin")
    assert 'gh api "repos/$REPO/pulls/$NUMBER"' in pin["run"]  # head and fork status looked up
    call = wf["jobs"]["gpu"]
    assert call["uses"] == "$/.github/workflows/gpu.yml"
    assert call["with"]["sha"] == "${{ needs.parse.outputs.sha }}"  # pinned at comment time
    assert call["with"]["fork"] == "${{ needs.parse.outputs.fork }}"
    assert call["with"]["comment_body"] == "${{ github.event.comment.body }}"


def test_nightly_and_weekly_cadences():
    wf = load("nightly.yml")
    crons = [c["cron"] for c in triggers(wf)["schedule"]]
    cadence = wf["jobs"]["run"]["with"]["cadence"]
    weekly = re.search(r"github\.event\.schedule == '([^']+)' && 'weekly'", cadence).group(1)
    assert weekly in crons and len(crons) == 2
    nightly = next(c for c in crons if c != weekly)
    assert nightly.split()[:2] == weekly.split()[:2]  # same time of day, different days
    assert wf["jobs"]["run"]["uses"] == "$/.github/workflows/pr.yml"
    assert wf["jobs"]["gpu"]["uses"] == "$/.github/workflows/gpu.yml"
    assert wf["jobs"]["gpu"]["with"]["cadence"] == cadence
    assert wf["jobs"]["history"]["cache-mode"] == "write"  # the only writer of the cache


def test_only_the_nightly_history_job_writes_the_cache():
    for path in FILES:
        for job_id, job in yaml.safe_load(path.read_text())["jobs"].items():
            mode = job.get("cache-mode")
            if (path.name, job_id) == ("nightly.yml", "history"):
                assert mode == "write"
            else:
                assert mode in ("read", "none"), (path.name, job_id)


def test_pr_workflow_triggers():
    pr = load("pr.yml")
    assert set(triggers(pr)) == {"pull_request", "push", "merge_group", "workflow_call"}


# -- the metric gate and the history it reads ----------------------------------------------------


def runs_of(wf: dict, job: str) -> str:
    return "\n".join(st.get("run", "") for st in wf["jobs"][job]["steps"])


def test_the_store_is_written_only_by_the_nightly_history_job_on_main():
    writers = {
        (path.name, job_id)
        for path in FILES
        for job_id, job in yaml.safe_load(path.read_text())["jobs"].items()
        if "gate ingest" in yaml.safe_dump(job) or "history merge" in yaml.safe_dump(job)
    }
    assert writers == {("nightly.yml", "history")}
    history = load("nightly.yml")["jobs"]["history"]
    assert "github.ref == 'refs/heads/main'" in history["if"]
    run = runs_of(load("nightly.yml"), "history")
    assert "gate ingest --store .ci-artifacts/merged/metrics.sqlite --trusted" in run
    # the pushes it merges: this repository's pushes to main only, never a pull request's run
    assert "--branch main --event push" in run and "pull_request" not in run
    assert history["permissions"] == {"contents": "read", "actions": "read"}


def test_the_gate_judges_every_lane_read_only_with_the_bases_quarantine():
    pr, gpu = load("pr.yml"), load("gpu.yml")
    for wf, job, lanes in ((pr, "gate", "cpu"), (gpu, "gate", "gpu")):
        gate = wf["jobs"][job]
        assert gate["cache-mode"] == "read" and gate["permissions"] == {"contents": "read"}
        run = runs_of(wf, job)
        assert "python3 -S -m mizzen_ci gate check" in run and f"--lanes {lanes}" in run
        assert "gate ingest" not in run
        assert '"--summary=$GITHUB_STEP_SUMMARY"' in run
        assert 'if [ "$EVENT" = pull_request ]' in run and "--quarantine-rev=" in run
        assert "needs.plan.outputs.jobs != '0'" in gate["if"] and "always()" in gate["if"]
        downloads = [st for st in gate["steps"] if "download-artifact@" in st.get("uses", "")]
        assert any(st["with"].get("pattern") == "metrics-*" for st in downloads)
        (cache,) = (st for st in gate["steps"] if "cache/restore@" in st.get("uses", ""))
        store = re.search(r"--store (\S+)", run).group(1)
        assert store.startswith(cache["with"]["path"] + "/")  # the store rides in the history cache
    assert "--quarantine-rev=HEAD^1" in runs_of(pr, "gate")  # the merge commit's base
    step = next(st for st in gpu["jobs"]["gate"]["steps"] if "gate check" in st.get("run", ""))
    assert step["env"]["PYTHONPATH"] == "trusted/ci/src" and "--root tree" in step["run"]
    assert step["env"]["BASE"] == "${{ inputs.base || github.event.pull_request.base.sha }}"
    trusted = next(
        st for st in gpu["jobs"]["gate"]["steps"] if st.get("with", {}).get("path") == "trusted"
    )
    assert "ref" not in trusted["with"]  # the default branch's own gate


def test_a_failing_gate_fails_ci_and_the_gpu_status():
    pr, gpu = load("pr.yml"), load("gpu.yml")
    ci = pr["jobs"]["ci"]
    assert "gate" in ci["needs"]
    assert '{ [ "$GATE" = success ] || [ "$GATE" = skipped ]; }' in ci["steps"][0]["run"]
    report = gpu["jobs"]["report"]
    assert "gate" in report["needs"]
    assert (
        'elif [ "$GATE" != success ] && [ "$GATE" != skipped ]; then state=failure'
        in (report["steps"][0]["run"])
    )


@pytest.mark.parametrize(("workflow", "job_id"), [("pr.yml", "lanes"), ("gpu.yml", "gpu")])
def test_every_lane_job_stamps_and_uploads_its_metrics(workflow, job_id):
    job = load(workflow)["jobs"][job_id]
    key = job["env"]["MIZZEN_RUN_KEY"]
    for part in ("github.run_id", "github.run_attempt", "matrix.id"):
        assert part in key  # one run key per run, attempt and job: re-uploads count once
    assert job["env"]["MIZZEN_JOB"] == "${{ matrix.id }}"
    (upload,) = (
        st for st in job["steps"] if st.get("with", {}).get("name", "").startswith("metrics-")
    )
    assert upload["if"] == "always()" and upload["with"]["path"] == ".ci-artifacts/metrics/"
    assert upload["with"]["name"] == "metrics-${{ matrix.id }}"
