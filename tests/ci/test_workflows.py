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
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from mizzen_ci import register_cpu_ci
from mizzen_ci.plan import Job, Plan, PlannedTest, SelectionSummary
from mizzen_ci.plan.cli import matrix
from mizzen_ci.plan.request import (
    BYPASS_FASTFAIL,
    PRIVATE_CACHE,
    SHARED_CACHE,
    TRUSTED_ASSOCIATIONS,
    UNTRUSTED_ENVIRONMENT,
    Inputs,
    compile_cache_scope,
    fast_fail,
)

register_cpu_ci(est_time=4, labels=["ci"])

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


# The one other write: the comment workflow's reply to an accepted command, posted by a job that
# checks out and runs no code (it downloads the reply the parse job wrote and posts it).
REPLY_WRITER = ("comment.yml", "reply")
# And the nightly flaky-test proposal: it pushes one branch and opens or updates its pull request
# (tests/ci/flakes/test_flakes_workflow.py checks the step's inputs).
FLAKES_PR_WRITER = ("nightly.yml", "flakes")


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
        elif (path.name, job_id) == REPLY_WRITER:
            assert perms == {"pull-requests": "write"}  # nothing else, not even contents
            assert not any("actions/checkout@" in st.get("uses", "") for st in job["steps"])
        elif (path.name, job_id) == FLAKES_PR_WRITER:
            assert perms == {"contents": "write", "pull-requests": "write"}
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
    assert re.search(r"name=nox_session_name\(arch\)", noxfile)


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


def gpu_pool_jobs() -> list[tuple[str, str, dict, str]]:
    """``(workflow, job id, job, the job its matrix comes from)`` for every job that can run on a
    self-hosted (GPU) runner: runs-on from a plan's matrix that is not the hosted kind, or a
    literal self-hosted label."""
    out = []
    for path in FILES:
        wf = yaml.safe_load(path.read_text())
        for job_id, job in wf["jobs"].items():
            runs_on = job.get("runs-on")
            if runs_on is None:
                continue  # a call of a reusable workflow: its own jobs are checked in its file
            if "matrix.runs_on" in str(runs_on):
                source = re.search(r"needs\.(\w+)\.outputs\.matrix", job["strategy"]["matrix"])
                assert source, f"{path.name}: {job_id}'s matrix comes from no plan job"
                if "--matrix hosted" not in plan_step(wf, source.group(1))["run"]:
                    out.append((path.name, job_id, job, source.group(1)))
            else:
                assert "self-hosted" not in str(runs_on), f"{path.name}: {job_id} names a runner"
    return out


def environment_of(expression: str, trusted_output: str) -> str:
    """Evaluate the one form of ``environment:`` the GPU jobs may use,
    ``${{ needs.P.outputs.trusted != 'true' && 'ENV' || '' }}``, for an output value."""
    m = re.fullmatch(
        r"\$\{\{ needs\.\w+\.outputs\.trusted != 'true' && '([\w-]+)' \|\| '' \}\}", expression
    )
    assert m, f"not the fail-closed form: {expression}"
    return m.group(1) if trusted_output != "true" else ""


def test_every_gpu_pool_job_of_an_untrusted_head_runs_in_the_reviewed_environment():
    # Approval by GitHub: a job that can reach a GPU runner names the deployment environment
    # whose required reviewers approve each run of an untrusted head; the decision is the
    # trusted plan's `trusted` output, fail-closed (anything but "true", a missing output too,
    # goes through the environment).
    found = gpu_pool_jobs()
    assert [(w, j) for w, j, _, _ in found] == [("gpu.yml", "gpu")]
    for workflow, job_id, job, source in found:
        wf = load(workflow)
        env = job.get("environment")
        assert isinstance(env, str), f"{workflow}: {job_id} has no environment"
        assert f"needs.{source}.outputs.trusted" in env  # the plan that made the matrix
        assert source in ([job["needs"]] if isinstance(job["needs"], str) else job["needs"])
        for output in ("false", "", "False", "TRUE", "true ", "1", "yes"):
            assert environment_of(env, output) == UNTRUSTED_ENVIRONMENT, output
        assert environment_of(env, "true") == ""
        # its inputs come from the trusted plan: the default branch's planner over the head as
        # data, whose `trusted` output the planner writes (`--github-output`)
        plan_job = wf["jobs"][source]
        assert plan_job["outputs"]["trusted"] == "${{ steps.plan.outputs.trusted }}"
        step = plan_step(wf, source)
        assert step["env"]["PYTHONPATH"] == "trusted/ci/src" and "--root tree" in step["run"]
        assert '"--github-output=$GITHUB_OUTPUT"' in step["run"]
        checkout = next(st for st in job["steps"] if "actions/checkout@" in st.get("uses", ""))
        assert checkout["with"]["ref"] == f"${{{{ needs.{source}.outputs.sha }}}}"
        assert job["runs-on"].startswith("${{ fromJSON(matrix.runs_on) }}")
        assert job["strategy"]["matrix"] == f"${{{{ fromJSON(needs.{source}.outputs.matrix) }}}}"
    # no other job of any workflow names the environment (it approves GPU runs only)
    for path in FILES:
        for job_id, job in yaml.safe_load(path.read_text())["jobs"].items():
            if (path.name, job_id) != ("gpu.yml", "gpu"):
                assert "environment" not in job, (path.name, job_id)


def test_the_environment_set_up_is_documented_beside_the_runner_groups():
    # (the planner's `trusted=` output itself: tests/ci/plan/test_trust.py)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"create `{UNTRUSTED_ENVIRONMENT}`" in readme
    for setting in ("Required reviewers", "Prevent self-review", "Selected branches and tags"):
        assert setting in readme, setting
    assert readme.index("Restrict the runner groups") < readme.index("Approval of untrusted heads")


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
        assert 'if [ "$EVENT" = pull_request ]' in run and "--base-rev=" in run
        assert "needs.plan.outputs.jobs != '0'" in gate["if"] and "always()" in gate["if"]
        downloads = [st for st in gate["steps"] if "download-artifact@" in st.get("uses", "")]
        assert any(st["with"].get("pattern") == "metrics-*" for st in downloads)
        (cache,) = (st for st in gate["steps"] if "cache/restore@" in st.get("uses", ""))
        store = re.search(r"--store (\S+)", run).group(1)
        assert store.startswith(cache["with"]["path"] + "/")  # the store rides in the history cache
    assert "--base-rev=HEAD^1" in runs_of(pr, "gate")  # the merge commit's base
    step = next(st for st in gpu["jobs"]["gate"]["steps"] if "gate check" in st.get("run", ""))
    assert step["env"]["PYTHONPATH"] == "trusted/ci/src" and "--root tree" in step["run"]
    assert step["env"]["BASE"] == "${{ inputs.base || github.event.pull_request.base.sha }}"
    trusted = next(
        st for st in gpu["jobs"]["gate"]["steps"] if st.get("with", {}).get("path") == "trusted"
    )
    assert "ref" not in trusted["with"]  # the default branch's own gate


def test_the_history_cache_is_restored_where_the_nightly_job_saves_it_outside_the_tree():
    # actions/cache derives a cache's version from the `path` string: a restore whose path is
    # not the save's never hits.  And a restore under the pull request's checkout (`tree/`)
    # would leave whatever the pull request committed there (a metrics.sqlite, durations) to be
    # read as the trusted history whenever the cache does not overwrite it.
    (save,) = (st for _, st in steps(load("nightly.yml")) if "cache/save@" in st.get("uses", ""))
    saved = save["with"]["path"]
    for path in FILES:
        for job_id, step in steps(yaml.safe_load(path.read_text())):
            if "cache/restore@" in step.get("uses", ""):
                assert step["with"]["path"] == saved, (path.name, job_id)
    gpu = load("gpu.yml")
    assert re.search(rf"--history[ =]{re.escape(saved)}\b", runs_of(gpu, "plan"))
    assert f"--store {saved}/metrics.sqlite" in runs_of(gpu, "gate")
    assert "tree/.ci-artifacts" not in (WORKFLOWS / "gpu.yml").read_text()


def test_the_merge_queue_gate_reads_the_quarantine_list_of_its_base_too():
    # a merge group's commit holds the change itself: its working tree's quarantine.toml would
    # let a change quarantine its own regression on the way into main
    gate = load("pr.yml")["jobs"]["gate"]
    run = runs_of(load("pr.yml"), "gate")
    assert '"$EVENT" = merge_group' in run and '"--base-rev=$QUEUE_BASE"' in run
    step = next(st for st in gate["steps"] if "gate check" in st.get("run", ""))
    assert step["env"]["QUEUE_BASE"] == "${{ github.event.merge_group.base_sha }}"
    checkout = next(st for st in gate["steps"] if "checkout@" in st.get("uses", ""))
    assert "merge_group" in str(checkout["with"]["fetch-depth"])  # the whole history there


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


# -- fast-fail: on pull requests the GPU jobs wait for the cheap checks and the CPU lane ---------


def test_the_plan_job_hands_the_fast_fail_decision_to_the_gpu_jobs():
    gpu = load("gpu.yml")
    plan = gpu["jobs"]["plan"]
    assert plan["outputs"]["fast_fail"] == "${{ steps.plan.outputs.fast_fail }}"
    # the wait runs only when the trusted plan says so (a missing answer waits: != 'false')
    wait = gpu["jobs"]["fastfail"]
    assert wait["needs"] == "plan"
    assert "needs.plan.outputs.fast_fail != 'false'" in wait["if"]
    # the GPU jobs need the wait, and start without it only when the plan does not fast-fail
    job = gpu["jobs"]["gpu"]
    assert set(job["needs"]) == {"plan", "fastfail"}
    cond = " ".join(job["if"].split())
    assert cond.startswith("!cancelled() && needs.plan.result == 'success'")
    assert (
        "(needs.plan.outputs.fast_fail == 'false' || (needs.fastfail.result == 'success' "
        "&& needs.fastfail.outputs.verdict == 'pass'))"
    ) in cond
    assert wait["outputs"]["verdict"] == "${{ steps.wait.outputs.verdict }}"
    # no gate of GPU metrics that were never made
    assert "needs.gpu.result != 'skipped'" in gpu["jobs"]["gate"]["if"]


def test_the_fast_fail_wait_is_the_trusted_judge_over_the_cpu_run_of_the_planned_head():
    gpu = load("gpu.yml")
    wait = gpu["jobs"]["fastfail"]
    assert wait["permissions"] == {"contents": "read", "actions": "read", "pull-requests": "read"}
    assert HOSTED.match(wait["runs-on"]) and wait["cache-mode"] == "none"
    (checkout,) = (st for st in wait["steps"] if "actions/checkout@" in st.get("uses", ""))
    assert checkout["with"] == {"path": "trusted", "persist-credentials": False}  # no ref: ours
    step = next(st for st in wait["steps"] if st.get("id") == "wait")
    env, run = step["env"], step["run"]
    assert env["PYTHONPATH"] == "trusted/ci/src"
    assert env["SHA"] == "${{ needs.plan.outputs.sha }}"  # the planned (pinned) head
    assert "python3 -S -m mizzen_ci fastfail --plan plan.json" in run
    # the CPU workflow's pull-request runs of exactly that head, and the pull request as it is now
    assert '"repos/$REPO/actions/workflows/pr.yml/runs?head_sha=$SHA&event=pull_request' in run
    assert 'gh api "repos/$REPO/pulls/$NUMBER"' in run
    assert '"--started-by=$STARTED_BY"' in run and "'comment' || 'event'" in env["STARTED_BY"]
    assert 'if [ "$verdict" = fail ]; then exit 1; fi' in run
    assert "$SECONDS" in run and int(env["WAIT_MINUTES"]) < wait["timeout-minutes"]
    # the policy's job names are pr.yml's: the checks and the CPU lanes it judges exist there
    pr = load("pr.yml")
    assert {"checks", "plan", "lanes", "gate", "ci"} <= set(pr["jobs"])
    # the status says why the GPU jobs did not run
    report = gpu["jobs"]["report"]
    assert "fastfail" in report["needs"]
    assert report["steps"][0]["env"]["VERDICT"] == "${{ needs.fastfail.outputs.verdict }}"
    assert '[ "$FASTFAIL" != success ] && [ "$FASTFAIL" != skipped ]' in report["steps"][0]["run"]
    assert '[ "$VERDICT" = superseded ]; then state=pending' in report["steps"][0]["run"]


def test_the_bypass_label_reaches_the_planner_from_event_data_only():
    step = plan_step(load("gpu.yml"))
    # pull_request_target's labels, or a comment run's: the labels of the event's issue
    assert step["env"]["LABELS"] == (
        "${{ inputs.labels || join(github.event.pull_request.labels.*.name, ',') }}"
    )
    assert '"--label=$LABELS"' in step["run"]
    call = load("comment.yml")["jobs"]["gpu"]
    assert call["with"]["labels"] == "${{ join(github.event.issue.labels.*.name, ',') }}"
    assert fast_fail(Inputs(labels=(BYPASS_FASTFAIL,)))[0] is False
    assert fast_fail(Inputs())[0] is True


def test_nightly_and_weekly_runs_never_wait_for_cpu_results():
    wf = load("nightly.yml")
    call = wf["jobs"]["gpu"]
    assert "needs" not in call  # the GPU side does not wait for the CPU side (`run`)
    assert call["with"]["event"] == "${{ github.event_name }}"  # schedule or workflow_dispatch
    for event in ("schedule", "workflow_dispatch"):
        for cadence in ("nightly", "weekly"):
            assert fast_fail(Inputs(event=event, cadence=cadence))[0] is False
    # gpu.yml's fast-fail job asks for reads only: the caller grants them, nothing more
    assert call["permissions"] == {
        "contents": "read", "statuses": "write", "actions": "read", "pull-requests": "read"
    }  # fmt: skip
    # pushes to main (gpu.yml's own trigger) never wait either
    assert fast_fail(Inputs(event="push"))[0] is False


# -- /rerun-failed and /rerun-test through the comment workflow ---------------------------------


def test_rerun_commands_reach_the_trusted_planner():
    wf = load("comment.yml")
    parse = wf["jobs"]["parse"]
    assert "contains(github.event.comment.body, '/rerun-')" in parse["if"]
    read = next(st for st in parse["steps"] if st.get("id") == "read")
    assert '"--github-output=$GITHUB_OUTPUT"' in read["run"]  # run= and rerun_failed=
    (checkout,) = (st for st in parse["steps"] if "actions/checkout@" in st.get("uses", ""))
    assert "ref" not in checkout["with"]  # the default branch's planner, never the PR's
    # the plan is made in gpu.yml by the trusted planner, from the comment as data
    call = wf["jobs"]["gpu"]
    assert call["uses"] == "$/.github/workflows/gpu.yml"
    assert call["with"]["comment_body"] == "${{ github.event.comment.body }}"
    assert call["with"]["sha"] == "${{ needs.parse.outputs.sha }}"


def test_rerun_failed_reads_the_last_gpu_run_of_the_pinned_head_as_data():
    wf = load("comment.yml")
    parse = wf["jobs"]["parse"]
    last = next(st for st in parse["steps"] if st.get("id") == "last")
    assert "steps.read.outputs.rerun_failed == 'true'" in last["if"]
    assert last["env"]["SHA"] == "${{ steps.pin.outputs.sha }}"  # the head pinned at comment time
    assert last["env"]["RUNS"] == (
        "${{ github.server_url }}/${{ github.repository }}/actions/runs/"
    )
    run = last["run"]
    # the run linked by the head's mizzen/gpu status, posted by this repository's Actions token
    assert 'gh api "repos/$REPO/commits/$SHA/status"' in run
    assert '.context == "mizzen/gpu" and .creator.login == "github-actions[bot]"' in run
    assert 'id=${url#"$RUNS"}' in run and "^[0-9]{1,20}$" in run
    assert ".github/workflows/gpu.yml" in run and ".github/workflows/comment.yml" in run
    assert 'gh run download "$id" --repo "$REPO" --pattern \'history-*\'' in run
    assert {"actions": "read", "statuses": "read"}.items() <= parse["permissions"].items()
    assert parse["outputs"]["last_run"] == "${{ steps.last.outputs.artifact }}"
    upload = next(
        st for st in parse["steps"] if st.get("with", {}).get("name") == "last-run-history"
    )
    assert upload["if"] == "steps.last.outputs.artifact != ''"
    # gpu.yml downloads it and hands it to the planner, which validates every record
    call = wf["jobs"]["gpu"]
    assert call["with"]["failed_from_artifact"] == "${{ needs.parse.outputs.last_run }}"
    gpu = load("gpu.yml")
    assert "failed_from_artifact" in triggers(gpu)["workflow_call"]["inputs"]
    download = next(
        st for st in gpu["jobs"]["plan"]["steps"]
        if st.get("with", {}).get("name") == "${{ inputs.failed_from_artifact }}"
    )  # fmt: skip
    assert download["if"] == "inputs.failed_from_artifact != ''"
    assert download["uses"].startswith("actions/download-artifact@")
    step = plan_step(gpu)
    assert download["with"]["path"] == "last-run" and "--failed-from=last-run" in step["run"]
    assert step["env"]["FAILED_FROM"] == "${{ inputs.failed_from_artifact }}"


def test_the_reply_acknowledges_accepted_commands_and_links_the_run_it_started():
    wf = load("comment.yml")
    parse = wf["jobs"]["parse"]
    write = next(st for st in parse["steps"] if "--reply reply.md" in st.get("run", ""))
    assert write["if"] == "steps.read.outputs.run == 'true'"
    assert write["env"]["RUN_URL"] == (
        "${{ github.server_url }}/${{ github.repository }}/actions/runs/${{ github.run_id }}"
    )
    assert write["env"]["SHA"] == "${{ steps.pin.outputs.sha }}"
    assert write["env"]["PYTHONPATH"] == "ci/src"  # the default branch's mizzen_ci escapes it
    assert '"--run-url=$RUN_URL" "--head=$SHA"' in write["run"]
    assert '"--last-run=$LAST_RUN"' in write["run"]
    reply = wf["jobs"]["reply"]
    assert reply["needs"] == "parse" and reply["if"] == "needs.parse.outputs.run == 'true'"
    uses = [st.get("uses", "") for st in reply["steps"]]
    assert [u.split("@")[0] for u in uses if u] == ["actions/download-artifact"]
    post = reply["steps"][-1]
    assert post["env"]["NUMBER"] == "${{ github.event.issue.number }}"
    assert (
        'gh api --method POST "repos/$REPO/issues/$NUMBER/comments" -F body=@reply.md'
        in post["run"]
    )


# -- compile caches: a pull request's head compiles into a private copy ------------------------


def _private_cache_step(gpu: dict) -> tuple[int, dict]:
    found = [
        (i, st) for i, st in enumerate(gpu["jobs"]["gpu"]["steps"])
        if "MIZZEN_COMPILE_CACHE_DIR=" in st.get("run", "")
    ]  # fmt: skip
    assert len(found) == 1, found
    return found[0]


def test_a_pull_requests_gpu_job_gets_a_private_copy_of_the_compile_cache_before_its_code_runs():
    gpu = load("gpu.yml")
    assert gpu["jobs"]["plan"]["outputs"]["compile_cache"] == (
        "${{ steps.plan.outputs.compile_cache }}"
    )
    index, step = _private_cache_step(gpu)
    # a missing or unknown answer is private: only the trusted plan's "shared" skips the copy
    assert step["if"] == "needs.plan.outputs.compile_cache != 'shared'"
    names = [st.get("name", st.get("uses", "")) for st in gpu["jobs"]["gpu"]["steps"]]
    runs_code = [
        i for i, st in enumerate(gpu["jobs"]["gpu"]["steps"]) if "nox" in st.get("run", "")
    ]
    assert runs_code and index < min(runs_code), names  # before anything of the head runs
    assert "bash " not in step["run"] and ".github/" not in step["run"]  # inline, not the head's
    assert compile_cache_scope("pull_request") == PRIVATE_CACHE
    assert {compile_cache_scope(e) for e in ("push", "schedule", "workflow_dispatch")} == {
        SHARED_CACHE
    }


def _run_private_cache_step(
    tmp_path: Path, extra_env: dict[str, str], cwd: Path | None = None
) -> tuple[Path, dict]:
    """Run the step's script the way the runner runs a `shell: bash` step."""
    _, step = _private_cache_step(load("gpu.yml"))
    home, temp, env_file = tmp_path / "home", tmp_path / "runner-temp", tmp_path / "github-env"
    temp.mkdir(parents=True)
    env_file.write_text("")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "RUNNER_TEMP": str(temp),
           "GITHUB_ENV": str(env_file), **extra_env}  # fmt: skip
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
        env=env, cwd=cwd or tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    exported = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    return temp / "mizzen-compile-cache", exported


def test_the_private_copy_holds_the_shared_cache_and_writes_to_it_never_reach_the_shared_one(
    tmp_path,
):
    shared = tmp_path / "home" / ".cache" / "mizzen-ci" / "compile"
    key = shared / "torch-2.11.0+cu130-sm90-py312" / "bytecode"
    key.mkdir(parents=True)
    (key / "torch.cpython-312.pyc").write_bytes(b"main's bytecode")
    triton = key.parent / "triton"
    triton.mkdir()
    (key.parent / "inductor").symlink_to(triton, target_is_directory=True)  # planted earlier
    private, exported = _run_private_cache_step(tmp_path, {})
    assert exported == {
        "MIZZEN_COMPILE_CACHE_DIR": str(private),
        "TORCH_EXTENSIONS_DIR": str(private / "torch-extensions"),
    }
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    copied = private / "torch-2.11.0+cu130-sm90-py312" / "bytecode" / "torch.cpython-312.pyc"
    assert copied.read_bytes() == b"main's bytecode"  # warm for the head
    assert not (copied.parent.parent / "inductor").exists()  # the link is not carried over
    assert not [p for p in private.rglob("*") if p.is_symlink()]
    copied.write_bytes(b"planted")  # what a head's run writes stays in its copy
    (copied.parent / "new.pyc").write_bytes(b"planted")
    assert (key / "torch.cpython-312.pyc").read_bytes() == b"main's bytecode"
    assert sorted(p.name for p in key.iterdir()) == ["torch.cpython-312.pyc"]


def test_the_private_copy_of_a_runner_without_a_cache_or_with_it_off_or_preset(tmp_path):
    private, exported = _run_private_cache_step(tmp_path / "none", {})
    assert exported["MIZZEN_COMPILE_CACHE_DIR"] == str(private) and not any(private.iterdir())
    # `off` on the runner: no copy, and still a private root (torch's default caches outlive a job)
    (tmp_path / "off" / "home" / ".cache" / "mizzen-ci" / "compile" / "k").mkdir(parents=True)
    private, exported = _run_private_cache_step(
        tmp_path / "off", {"MIZZEN_COMPILE_CACHE_DIR": "off"}
    )
    assert exported["MIZZEN_COMPILE_CACHE_DIR"] == str(private) and not any(private.iterdir())
    # variables the runner presets (the lane keeps them) are pointed into the copy as well
    preset = {"TRITON_CACHE_DIR": "/var/cache/triton", "PYTHONPYCACHEPREFIX": "/var/cache/pyc"}
    private, exported = _run_private_cache_step(tmp_path / "preset", preset)
    assert {k: exported[k] for k in preset} == {k: str(private / "preset" / k) for k in preset}
    assert "TORCHINDUCTOR_CACHE_DIR" not in exported  # not preset: the lane sets it in the copy


@pytest.mark.parametrize(
    "environ",
    [{}, {"XDG_CACHE_HOME": "/xdg"}, {"XDG_CACHE_HOME": "relative/xdg"},
     {"MIZZEN_COMPILE_CACHE_DIR": "/elsewhere/cache"}, {"MIZZEN_COMPILE_CACHE_DIR": "rel/cache"}],
    ids=["default", "xdg", "relative-xdg", "absolute", "relative"],
)  # fmt: skip
def test_the_step_copies_the_root_the_lane_would_use(tmp_path, monkeypatch, environ):
    """Parity of the step's bash with :func:`mizzen_ci.lane.compile_cache.cache_root`."""
    from mizzen_ci.lane.compile_cache import cache_root

    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "home"
    absolute = {k: str(tmp_path) + v if v.startswith("/") else v for k, v in environ.items()}
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    root = cache_root({**absolute, "HOME": str(home)})
    (root / "k").mkdir(parents=True)
    (root / "k" / "marker").write_text("this root")
    private, _ = _run_private_cache_step(tmp_path, absolute, cwd=work)
    assert (private / "k" / "marker").read_text() == "this root"
