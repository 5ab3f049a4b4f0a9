"""Trust cannot be steered by the change: `mizzen-ci plan` (a real subprocess under ``python3 -S``
over a real git repository) takes pools and runner labels from the base revision's fleet table,
treats an unknown fork status as untrusted, plans an untrusted head's GPU jobs only when the event
asks for them and marks them for the reviewed environment (``trusted=false``),
reads comment commands as whole lines (rerun commands too: only the named or last-failed registered
files, pinned to the head), and fails on registry errors after writing the plan."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=25, labels=["ci"])

FLEET = (Path(__file__).parents[1] / "fixtures" / "plan" / "small_fleet.toml").read_text()
# What a hostile head makes of the table: hosted jobs on GPU machines, GPU jobs elsewhere.
HOSTILE_FLEET = FLEET.replace(
    'runs_on = ["self-hosted", "h200"]\nrunner_group = "mizzen-h200"',
    'runs_on = ["self-hosted", "h200", "prod-deploy"]\nrunner_group = "production"',
).replace('runs_on = ["ubuntu-24.04"]', 'runs_on = ["ubuntu-24.04-gpu"]')
CPU_TEST = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=5)\n"
GPU_TEST = (
    "from mizzen_ci import register_cuda_ci\n"
    "register_cuda_ci(est_time=5, hardware=['hopper'], labels=['lora'])\n"
)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write(
        root,
        {
            "ci/fleet.toml": FLEET,
            "pyproject.toml": '[project]\nname = "t"\nversion = "0"\n',
            "tests/t/test_cpu.py": CPU_TEST,
            "tests/t/test_gpu.py": GPU_TEST,
        },
    )
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    git(root, "checkout", "-qb", "change")
    return root


@pytest.fixture
def plan(mizzen_ci):
    """``plan(repo, *ARGS, out=DIR)``: (exit code, plan JSON, stderr, the --github-output values)
    of one ``mizzen-ci plan --base main --head HEAD`` run over ``repo``."""

    def run(repo: Path, *args: str, out: Path | None = None) -> tuple[int, dict, str, dict]:
        out = out or repo.parent / "out"
        out.mkdir(exist_ok=True)
        gh = out / "gh.txt"
        gh.unlink(missing_ok=True)
        (out / "plan.json").unlink(missing_ok=True)
        done = mizzen_ci(
            "plan", "--root", str(repo), "--base", "main", "--head", "HEAD", "--no-cache",
            "--output", str(out / "plan.json"), "--github-output", str(gh), *args,
            cwd=repo, timeout=120,
        )  # fmt: skip
        data = json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else {}
        lines = gh.read_text().splitlines() if gh.exists() else []
        return done.returncode, data, done.stderr, dict(line.split("=", 1) for line in lines)

    return run


def labels_of(p: dict) -> set[tuple[str, ...]]:
    return {tuple(j["runs_on"]) for j in p["jobs"]}


def test_a_fork_that_edits_the_fleet_gets_the_base_fleets_hosted_cpu_pool_only(repo: Path, plan):
    write(repo, {"ci/fleet.toml": HOSTILE_FLEET, "tests/t/test_gpu.py": GPU_TEST + "# x\n"})
    git(repo, "commit", "-qam", "hostile")
    code, p, err, gh = plan(repo, "--fork", "--author-association", "NONE", "--label", "run-ci-all")
    assert code == 0, err
    assert p["trusted"] is False and p["approval"] is None
    assert p["fleet"] == f"{git(repo, 'rev-parse', 'main')[:12]}:ci/fleet.toml"
    assert labels_of(p) == {("ubuntu-24.04",)}  # the base's CPU pool, nothing else
    assert all(j["runner_group"] is None for j in p["jobs"])
    assert json.loads(gh["matrix"])["include"] and gh["blocked"] == "1"
    for kind in ("hosted", "self-hosted"):
        _, _, _, out = plan(repo, "--fork", "--author-association", "NONE", "--matrix", kind)
        labels = {e["runs_on"] for e in json.loads(out["matrix"])["include"]}
        assert labels <= {json.dumps(["ubuntu-24.04"])}, kind


def test_a_trusted_change_to_the_fleet_does_not_move_its_own_gpu_jobs(repo: Path, plan):
    write(repo, {"ci/fleet.toml": HOSTILE_FLEET})
    git(repo, "commit", "-qam", "move the pools")
    code, p, err, gh = plan(
        repo, "--same-repo", "--label", "run-ci-lora", "--matrix", "self-hosted"
    )
    assert code == 0, err
    assert p["trusted"] is True and gh["trusted"] == "true"
    (gpu,) = [j for j in p["jobs"] if j["arch"] == "hopper"]
    assert (tuple(gpu["runs_on"]), gpu["runner_group"]) == (("self-hosted", "h200"), "mizzen-h200")
    (entry,) = json.loads(gh["matrix"])["include"]
    assert json.loads(entry["runs_on"]) == {
        "group": "mizzen-h200",
        "labels": ["self-hosted", "h200"],
    }
    assert labels_of(p) == {("ubuntu-24.04",), ("self-hosted", "h200")}


def test_an_unknown_fork_status_is_untrusted(repo: Path, plan):
    write(repo, {"tests/t/test_gpu.py": GPU_TEST + "# x\n"})
    git(repo, "commit", "-qam", "change")
    code, p, _, _ = plan(repo, "--author-association", "CONTRIBUTOR")
    assert code == 0 and p["trusted"] is False
    assert not [j for j in p["jobs"] if j["arch"]]
    assert any("fork status unknown" in w for w in p["warnings"])
    _, p, _, _ = plan(repo, "--same-repo", "--author-association", "CONTRIBUTOR")
    assert p["trusted"] is True and [j for j in p["jobs"] if j["arch"]]


def test_only_the_event_that_adds_ok_to_test_approves_and_the_plan_names_the_pinned_head(
    repo: Path, plan
):
    write(repo, {"tests/t/test_gpu.py": GPU_TEST + "# x\n"})
    git(repo, "commit", "-qam", "change")
    head = git(repo, "rev-parse", "HEAD")
    untrusted = ("--fork", "--author-association", "NONE", "--label", "ok-to-test")
    _, p, _, gh = plan(repo, *untrusted, "--action", "labeled", "--label-added", "ok-to-test")
    assert p["approval"] and [j for j in p["jobs"] if j["arch"]]
    assert p["head"] == head and gh["sha"] == head
    # the planned GPU jobs of this untrusted head go through the reviewed environment: gpu.yml
    # reads `trusted` (tests/ci/test_workflows.py), GitHub's reviewers approve the run
    assert gh["trusted"] == "false" and "`gpu-untrusted`" in p["approval"]
    _, p, _, _ = plan(repo, *untrusted, "--action", "synchronize")
    assert p["approval"] is None and not [j for j in p["jobs"] if j["arch"]]


def test_comment_commands_are_whole_lines_from_trusted_associations(
    repo: Path, tmp_path: Path, plan, mizzen_ci
):
    write(repo, {"tests/t/test_gpu.py": GPU_TEST + "# x\n"})
    git(repo, "commit", "-qam", "change")
    body = tmp_path / "comment.md"
    untrusted = ("--fork", "--author-association", "NONE")
    cases = {
        "Please do NOT /run-ci this yet": False,
        "> /run-ci lora": False,  # a quoted command is not a command
        "  /run-ci lora": False,  # nor an indented one
        "```\n/run-ci lora\n```": False,  # nor one in a fenced code block
        "x/run-ci lora": False,
        "/run-cilora": False,
        "thanks!\n/run-ci lora\nmore text": True,
    }
    for text, runs in cases.items():
        body.write_text(text)
        _, p, _, _ = plan(repo, *untrusted, "--comment-file", "MEMBER", str(body))
        assert bool([j for j in p["jobs"] if j["arch"]]) is runs, text
        done = mizzen_ci("comment", "--body-file", str(body), "--association", "member")
        assert json.loads(done.stdout)["accepted"] is runs, text
    body.write_text("/run-ci lora")
    _, p, _, _ = plan(repo, *untrusted, "--comment-file", "NONE", str(body))
    assert not [j for j in p["jobs"] if j["arch"]]
    assert any("association NONE" in w for w in p["warnings"])


def planned(p: dict) -> set[tuple[str, str | None]]:
    return {(t["file"], j["arch"]) for j in p["jobs"] for t in j["tests"]}


def test_rerun_test_plans_the_named_files_only_at_the_pinned_head(repo: Path, tmp_path: Path, plan):
    write(
        repo,
        {
            "tests/t/test_gpu.py": GPU_TEST + "# x\n",
            "tests/t/test_cpu.py": CPU_TEST + "# x\n",
            "tests/u/test_other.py": CPU_TEST,
            "tests/u/test_gpu_too.py": GPU_TEST,
        },
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "change")
    head = git(repo, "rev-parse", "HEAD")
    body = tmp_path / "comment.md"
    body.write_text("/rerun-test tests/t/test_gpu.py tests/u/test_other.py")
    untrusted = ("--fork", "--author-association", "NONE")
    code, p, err, gh = plan(repo, *untrusted, "--comment-file", "MEMBER", str(body))
    assert code == 0, err
    # the changed test_cpu.py and the new test_gpu_too.py are impacted; a rerun consults no impact
    assert planned(p) == {("tests/t/test_gpu.py", "hopper"), ("tests/u/test_other.py", None)}
    assert p["approval"] and p["head"] == head and gh["sha"] == head
    reasons = {n["file"]: n["reason"] for n in p["not_scheduled"]}
    assert reasons["tests/t/test_cpu.py"] == "not asked for by the rerun"
    assert "tests/u/test_gpu_too.py" in reasons
    # from an untrusted commenter: ignored, the plan is the change's
    _, p, _, _ = plan(repo, *untrusted, "--comment-file", "NONE", str(body))
    assert ("tests/t/test_cpu.py", None) in planned(p)
    assert not [j for j in p["jobs"] if j["arch"]]


@pytest.mark.parametrize(
    "path, refusal",
    [
        ("tests/t/test_missing.py", "not a registered test file"),
        ("tests/t/test_link.py", "registry error"),  # a symbolic link to a registered file
        ("tests/../ci/fleet.toml", "not a test file path"),
        ("/etc/passwd", "not a test file path"),
        ("packages/x/test_a.py", "not a test file path"),
        ("tests/t/test_gpu.py;rm", "not a test file path"),
        ("tests/t/test_gp\u0443.py", "not a test file path"),  # a Cyrillic look-alike
    ],
)
def test_rerun_test_refuses_what_is_not_a_registered_test_file(
    repo: Path, tmp_path: Path, plan, path: str, refusal: str
):
    (repo / "tests/t/test_link.py").symlink_to("test_gpu.py")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "link")
    body = tmp_path / "comment.md"
    body.write_text(f"/rerun-test {path}")
    _, p, _, _ = plan(repo, "--same-repo", "--comment-file", "OWNER", str(body))
    assert planned(p) == set(), p["jobs"]
    assert any(refusal in w for w in p["warnings"]), p["warnings"]


def test_rerun_failed_plans_what_failed_in_the_last_run(repo: Path, tmp_path: Path, plan):
    write(repo, {"tests/u/test_other.py": CPU_TEST})
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "change")
    body = tmp_path / "comment.md"
    body.write_text("thanks\n/rerun-failed")
    last = tmp_path / "last.jsonl"
    record = {"arch": None, "lane": "cpu", "when": "2026-12-01T00:00:00Z", "job": None}
    lines = [
        {**record, "file": "tests/t/test_cpu.py", "seconds": 3.0, "outcome": "passed"},
        {**record, "file": "tests/u/test_other.py", "seconds": 3.0, "outcome": "failed"},
        {**record, "file": "tests/t/test_gpu.py", "seconds": 5.0, "outcome": "error",
         "arch": "hopper", "lane": "gpu-hopper"},
    ]  # fmt: skip
    last.write_text(
        "\n".join(json.dumps(line) for line in lines)
        + '\n{"file": "tests/t/test_cpu.py", "seconds": 1e999}\nnot json\n'
    )
    trusted = ("--same-repo", "--comment-file", "MEMBER", str(body))
    code, p, err, _ = plan(repo, *trusted, "--failed-from", str(last))
    assert code == 0, err
    assert planned(p) == {("tests/u/test_other.py", None), ("tests/t/test_gpu.py", "hopper")}
    assert any("last-run record" in w and "last.jsonl:4" in w for w in p["warnings"])
    # without the record of the last run it says so and reruns nothing
    _, p, _, _ = plan(repo, *trusted)
    assert planned(p) == set()
    assert any("no record of this pull request's last run" in w for w in p["warnings"])


def test_rerun_commands_apply_to_pull_requests_only(repo: Path, tmp_path: Path, plan):
    body = tmp_path / "comment.md"
    body.write_text("/rerun-test tests/t/test_gpu.py")
    _, p, _, _ = plan(repo, "--event", "push", "--comment-file", "OWNER", str(body))
    assert ("tests/t/test_cpu.py", None) in planned(p)  # a push runs every CPU test
    assert any("rerun commands apply to pull requests" in w for w in p["warnings"])


def test_registry_errors_fail_the_plan_after_it_is_written(repo: Path, plan):
    write(repo, {"tests/t/test_broken.py": "register_cpu_ci(est_time=-1)\n"})
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "broken")
    code, p, err, gh = plan(repo, "--same-repo")
    assert code == 1
    assert "registry error" in err and "mizzen-ci validate" in err
    assert p["errors"] and any("test_broken.py" in e for e in p["errors"])
    assert "matrix" in gh  # the plan and its outputs exist: the failure is readable


def test_a_base_without_a_fleet_table_is_refused(tmp_path: Path, plan):
    root = tmp_path / "bare"
    write(root, {"README.md": "x\n"})
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    git(root, "checkout", "-qb", "change")
    write(root, {"ci/fleet.toml": FLEET, "tests/t/test_cpu.py": CPU_TEST})
    git(root, "add", "-A")
    git(root, "commit", "-qm", "add the fleet")
    code, p, err, _ = plan(root, "--same-repo", out=tmp_path / "o")
    assert code == 2 and not p
    assert "the base revision has no readable ci/fleet.toml" in err and "Traceback" not in err
