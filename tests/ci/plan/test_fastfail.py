"""The fast-fail policy and the comment-command acknowledgement, on the planner's side: the plan
says whether a run's GPU jobs wait for the cheap checks and the CPU lane (pull requests do, unless
a maintainer's ``bypass-fastfail`` label is on them; pushes, merge queues, nightly and weekly runs
never do), ``mizzen-ci fastfail`` judges GitHub's answers about the CPU run of the head (a table of
cases, then the real CLI over answer files, hostile ones included), and ``mizzen-ci comment``
writes the outputs and the escaped reply the comment workflow posts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.output import markdown
from mizzen_ci.plan import Plan, SelectionSummary
from mizzen_ci.plan.fastfail import JobState, Pull, Run, judge
from mizzen_ci.plan.request import BYPASS_FASTFAIL, Comment, Inputs, fast_fail

register_cpu_ci(est_time=20, labels=["ci"])

HEAD = "a" * 40
OTHER = "b" * 40

FLEET = (Path(__file__).parents[1] / "fixtures" / "plan" / "small_fleet.toml").read_text()


# -- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "waits", "because"),
    [
        (Inputs(event="pull_request"), True, "wait for the cheap checks and the CPU lane"),
        (Inputs(event="pull_request", labels=("run-ci-lora", BYPASS_FASTFAIL)), False, "label"),
        # a look-alike is no bypass (U+2010 HYPHEN)
        (Inputs(event="pull_request", labels=("bypass\u2010fastfail",)), True, "wait"),
        (Inputs(event="pull_request", labels=("Bypass-Fastfail",)), True, "wait"),
        # a comment command's run is a pull request's run: it waits too, unless the label is on
        (
            Inputs(event="pull_request", comments=(Comment("MEMBER", "/rerun-failed"),)),
            True,
            "wait",
        ),
        # the comment cannot bypass: only a label can
        (
            Inputs(event="pull_request", comments=(Comment("OWNER", BYPASS_FASTFAIL),)),
            True,
            "wait",
        ),
        (Inputs(event="push"), False, "push runs never fast-fail"),
        (Inputs(event="merge_group"), False, "merge_group runs never fast-fail"),
        (Inputs(event="schedule", cadence="nightly"), False, "nightly runs never fast-fail"),
        (Inputs(event="schedule", cadence="weekly"), False, "weekly runs never fast-fail"),
        (Inputs(event="workflow_dispatch", cadence="weekly"), False, "never fast-fail"),
    ],
)
def test_the_fast_fail_policy(inputs: Inputs, waits: bool, because: str):
    got, why = fast_fail(inputs)
    assert got is waits and because in why


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    files = {
        "ci/fleet.toml": FLEET,
        "pyproject.toml": '[project]\nname = "t"\nversion = "0"\n',
        "tests/t/test_cpu.py": "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=5)\n",
        "tests/t/test_gpu.py": "from mizzen_ci import register_cuda_ci\n"
        "register_cuda_ci(est_time=5, hardware=['hopper'], labels=['lora'])\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    git(root, "checkout", "-qb", "change")
    (root / "tests/t/test_gpu.py").write_text(files["tests/t/test_gpu.py"] + "# x\n")
    git(root, "commit", "-qam", "change")
    return root


@pytest.mark.parametrize(
    ("args", "waits", "cache"),
    [
        (("--event=pull_request", "--same-repo", "--base=main"), True, "private"),
        (("--event=pull_request", "--same-repo", "--base=main", "--label", BYPASS_FASTFAIL), False,
         "private"),
        (("--event=schedule", "--cadence=nightly"), False, "shared"),
        (("--event=schedule", "--cadence=weekly"), False, "shared"),
        (("--event=push", "--base=main"), False, "shared"),
    ],
)  # fmt: skip
def test_the_plan_and_its_github_outputs_carry_the_decision(repo, mizzen_ci, args, waits, cache):
    """Fast-fail, and the compile-cache scope of the GPU jobs: a pull request's head (trusted
    author or not) gets a private copy, what the repository holds the runner's shared cache."""
    out = repo.parent / "out"
    out.mkdir()
    done = mizzen_ci(
        "plan", "--root", str(repo), "--head", "HEAD", "--no-cache", *args,
        "--output", str(out / "plan.json"), "--github-output", str(out / "gh.txt"),
        "--summary", str(out / "summary.md"), cwd=repo, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fast_fail"] is waits and plan["fast_fail_reason"]
    outputs = dict(line.split("=", 1) for line in (out / "gh.txt").read_text().splitlines())
    assert outputs["fast_fail"] == str(waits).lower()
    assert outputs["compile_cache"] == cache
    said = markdown(f"fast-fail {'on' if waits else 'off'}: ")
    assert said in (out / "summary.md").read_text()
    assert Plan.load(out / "plan.json").fast_fail is waits


def test_a_plan_written_before_the_field_reads_as_not_fast_failing():
    data = plan_of().to_json()
    del data["fast_fail"], data["fast_fail_reason"]
    old = Plan.from_json(data)
    assert old.fast_fail is False and old.fast_fail_reason is None
    data["fast_fail"] = "yes"
    with pytest.raises(ValueError, match="fast_fail: expected true or false"):
        Plan.from_json(data)


# -- the judge -------------------------------------------------------------------------------


def plan_of(waits: bool = True, approval: str | None = None) -> Plan:
    return Plan(event="pull_request", cadence=None, base=OTHER, head=HEAD, worktree=False,
                trusted=approval is None, approval=approval, fleet="ci/fleet.toml",
                budget_seconds=3600.0, selection=SelectionSummary(False, (), 1),
                fast_fail=waits, fast_fail_reason="why")  # fmt: skip


def run_of(status="completed", conclusion="success", id=7, head=HEAD, event="pull_request"):
    return Run(id, head, event, status, conclusion, ".github/workflows/pr.yml", 1)


OPEN = Pull("open", HEAD, ())
DONE_OK = [JobState("checks", "completed", "success"), JobState("cpu-1", "completed", "success")]


@pytest.mark.parametrize(
    ("plan", "runs", "jobs", "pull", "started_by", "verdict", "because"),
    [
        (plan_of(False), [], None, OPEN, "event", "pass", "no fast-fail"),
        (plan_of(), [], None, OPEN, "event", "wait", "no pull-request run"),
        # runs of other heads, of other events: none of this head yet
        (plan_of(), [run_of(head=OTHER), run_of(event="push")], None, OPEN, "event", "wait", "yet"),
        (plan_of(), [run_of("in_progress", None)], DONE_OK[:1], OPEN, "event", "wait", "1 of 1"),
        # the first failed job fails at once, before the run ends
        (
            plan_of(),
            [run_of("in_progress", None)],
            [JobState("checks", "completed", "failure"), JobState("cpu-1", "in_progress", None)],
            OPEN, "event", "fail", "checks did not pass",
        ),
        (plan_of(), [run_of()], DONE_OK, OPEN, "event", "pass", "passed"),
        # the newest run of the head decides (a re-run after a failure)
        (plan_of(), [run_of(conclusion="failure", id=3), run_of(id=9)], DONE_OK, OPEN, "event",
         "pass", "run 9"),
        (plan_of(), [run_of(conclusion="cancelled")], None, OPEN, "event", "fail", "cancelled"),
        (plan_of(), [run_of(conclusion="action_required")], None, OPEN, "event", "wait",
         "approval"),
        (plan_of(), [run_of("in_progress", None)], None, Pull("open", OTHER, ()), "event",
         "superseded", "head moved"),
        (plan_of(), [], None, Pull("closed", HEAD, ()), "event", "superseded", "closed"),
        # the label added while waiting: the labeled event's run takes over a trusted event run …
        (plan_of(), [run_of("in_progress", None)], None, Pull("open", HEAD, (BYPASS_FASTFAIL,)),
         "event", "superseded", "labeled event"),
        # … but a comment command's or an approved run goes on now (no other run plans it)
        (plan_of(), [run_of("in_progress", None)], None, Pull("open", HEAD, (BYPASS_FASTFAIL,)),
         "comment", "pass", "added while this run waited"),
        (plan_of(approval="the `ok-to-test` label"), [], None,
         Pull("open", HEAD, (BYPASS_FASTFAIL,)), "event", "pass", "added while"),
    ],
)  # fmt: skip
def test_the_judge(plan, runs, jobs, pull, started_by, verdict, because):
    got = judge(plan, runs, jobs, pull, started_by)
    assert got.state == verdict and because in got.why, got


# -- the CLI over real answer files ----------------------------------------------------------


def api_run(**over) -> dict:
    return {"id": 41, "head_sha": HEAD, "event": "pull_request", "status": "completed",
            "conclusion": "success", "path": ".github/workflows/pr.yml", "run_attempt": 2,
            **over}  # fmt: skip


@pytest.fixture
def answers(tmp_path: Path, mizzen_ci):
    """``answers(runs=[...], jobs=[...] | None, pull={...}, *ARGS)``: the CompletedProcess of
    ``mizzen-ci fastfail`` over those answers and the plan of :func:`plan_of`."""
    (tmp_path / "plan.json").write_text(plan_of().dumps())

    def run(runs, jobs=None, pull=None, *args: str):
        (tmp_path / "runs.json").write_text(json.dumps({"total_count": 1, "workflow_runs": runs}))
        pull = pull or {"state": "open", "head": {"sha": HEAD}, "labels": [{"name": "x"}]}
        (tmp_path / "pull.json").write_text(json.dumps(pull))
        more = []
        if jobs is not None:
            (tmp_path / "jobs.json").write_text(json.dumps({"jobs": jobs}))
            more = ["--jobs", str(tmp_path / "jobs.json")]
        return mizzen_ci(
            "fastfail", "--plan", str(tmp_path / "plan.json"),
            "--runs", str(tmp_path / "runs.json"), "--pull", str(tmp_path / "pull.json"),
            *more, *args,
        )  # fmt: skip

    return run


def test_the_cli_prints_the_newest_run_and_the_verdict(answers, tmp_path: Path):
    runs = [api_run(id=40), api_run(id=41, status="in_progress", conclusion=None)]
    done = answers(runs, None, None, "--run-id")
    assert (done.returncode, done.stdout) == (0, "41\n")
    assert answers([api_run(head_sha=OTHER)], None, None, "--run-id").stdout == "\n"
    jobs = [{"name": "checks", "status": "completed", "conclusion": "success"}]
    done = answers(runs, jobs)
    assert (done.returncode, done.stdout) == (0, "wait\n")
    assert "run 41 (attempt 2): in_progress, 1 of 1 job(s) done" in done.stderr
    summary = tmp_path / "summary.md"
    done = answers([api_run()], jobs, None, f"--summary={summary}")
    assert done.stdout == "pass\n" and "Fast-fail: pass" in summary.read_text()


def test_hostile_job_names_are_escaped_and_malformed_answers_refused(answers):
    jobs = [{"name": "::error::pwn\n##[set-output x]", "status": "completed",
             "conclusion": "failure"}]  # fmt: skip
    done = answers([api_run(status="in_progress", conclusion=None)], jobs)
    assert done.stdout == "fail\n"
    assert "\n::" not in done.stderr and "##[" not in done.stderr
    for runs, what in [
        ([{**api_run(), "id": "41"}], "workflow_runs[0].id: expected an integer"),
        ([{**api_run(), "id": 10**30}], "workflow_runs[0].id: out of range"),
        ([{**api_run(), "status": ["x"]}], "workflow_runs[0].status: expected a string"),
        ("nope", "workflow_runs: expected a list"),
    ]:
        done = answers(runs)
        assert done.returncode == 2 and what in done.stderr and "Traceback" not in done.stderr
    done = answers([api_run()], None, {"state": "open", "head": {}, "labels": []})
    assert done.returncode == 2 and "head.sha" in done.stderr


# -- the comment command's outputs and reply ------------------------------------------------


RUN_URL = "https://github.com/o/r/actions/runs/123"


def test_comment_outputs_and_the_escaped_reply(tmp_path: Path, mizzen_ci):
    body = tmp_path / "c.md"
    body.write_text("thanks\n/rerun-failed\n/rerun-test tests/x/test_[a](https://evil).py @all\n")
    gh, reply = tmp_path / "gh.txt", tmp_path / "reply.md"
    done = mizzen_ci(
        "comment", "--body-file", str(body), "--association", "member",
        f"--github-output={gh}", "--reply", str(reply), f"--run-url={RUN_URL}",
        f"--head={HEAD}", "--last-run=https://github.com/o/r/actions/runs/99",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert gh.read_text() == "run=true\nrerun_failed=true\n"
    text = reply.read_text()
    assert RUN_URL in text and f"`{HEAD[:12]}`" in text and "actions/runs/99" in text
    # the comment's own words only inside code spans: no link, no mention
    assert "`/rerun-test tests/x/test_[a](https://evil).py @all`" in text
    assert (
        text.replace("`/rerun-test tests/x/test_[a](https://evil).py @all`", "").count("evil") == 0
    )
    # no last run found: the reply says /rerun-failed has nothing to rerun
    done = mizzen_ci(
        "comment", "--body-file", str(body), "--association", "OWNER", "--reply", str(reply),
        f"--run-url={RUN_URL}", f"--head={HEAD}",
    )  # fmt: skip
    assert done.returncode == 0 and "reruns nothing" in reply.read_text()


def test_comment_outputs_refuse_untrusted_and_bad_values(tmp_path: Path, mizzen_ci):
    body = tmp_path / "c.md"
    body.write_text("/rerun-failed\n")
    gh = tmp_path / "gh.txt"
    done = mizzen_ci("comment", "--body-file", str(body), "--association", "NONE",
                     f"--github-output={gh}")  # fmt: skip
    assert done.returncode == 0 and gh.read_text() == "run=false\nrerun_failed=false\n"
    reply = tmp_path / "reply.md"
    for args, what in [
        (["--association", "NONE", f"--run-url={RUN_URL}", f"--head={HEAD}"], "no accepted"),
        (["--association", "OWNER", "--run-url=https://evil/x", f"--head={HEAD}"], "not the URL"),
        (["--association", "OWNER", f"--run-url={RUN_URL}", "--head=main"], "40-hex-digit"),
        (["--association", "OWNER", f"--run-url={RUN_URL}", f"--head={HEAD}",
          "--last-run=javascript:x"], "--last-run: not the URL"),
    ]:  # fmt: skip
        done = mizzen_ci("comment", "--body-file", str(body), "--reply", str(reply), *args)
        assert done.returncode == 2 and what in done.stderr and not reply.exists(), args
