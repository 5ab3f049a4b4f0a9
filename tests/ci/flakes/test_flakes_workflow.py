"""nightly.yml's flaky-test proposal job, read as data (never run, GitHub never called): it runs
after the history job on main only, reads the history that job saved (trusted runs only),
proposes with `mizzen-ci flakes propose --write --body`, and hands `gh` exactly the body file the
command wrote, on one fixed branch, with a token that can push and edit pull requests only.
The lanes read the flaky list as the plugin expects: skip from the base for pull requests and
merge groups, record otherwise."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from mizzen_ci import register_cpu_ci
from mizzen_ci.flakes.cli import DEFAULT_INPUTS
from mizzen_ci.flakes.pytest_plugin import MODE_ENV, REV_ENV

register_cpu_ci(est_time=2, labels=["ci"])

WORKFLOWS = Path(__file__).resolve().parents[3] / ".github" / "workflows"


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def test_the_proposal_job_runs_on_main_after_the_history_with_the_least_token():
    wf = load("nightly.yml")
    job, history = wf["jobs"]["flakes"], wf["jobs"]["history"]
    assert job["needs"] == "history" and "needs.history.result == 'success'" in job["if"]
    assert "github.ref == 'refs/heads/main'" in job["if"]
    assert job["permissions"] == {"contents": "write", "pull-requests": "write"}
    assert job["cache-mode"] == "read"
    saved = next(s for s in history["steps"] if s.get("uses", "").startswith("actions/cache/save@"))
    restored = next(
        s for s in job["steps"] if s.get("uses", "").startswith("actions/cache/restore@")
    )
    assert restored["with"]["path"] == saved["with"]["path"] == DEFAULT_INPUTS[0].as_posix()
    assert (
        restored["with"]["key"] == saved["with"]["key"] and restored["with"]["fail-on-cache-miss"]
    )


def test_gh_gets_the_body_the_proposal_wrote_on_one_branch():
    job = load("nightly.yml")["jobs"]["flakes"]
    propose, pr = (s for s in job["steps"] if "run" in s)
    argv = shlex.split(propose["run"])
    assert argv[:6] == ["python3", "-S", "-m", "mizzen_ci", "flakes", "propose"]
    assert "--write" in argv and argv[argv.index("--history") + 1] == ".ci-artifacts/history"
    body = argv[argv.index("--body") + 1]
    assert body == "$RUNNER_TEMP/flaky-body.md"
    script = pr["run"]
    assert script.count(f'--body-file "{body}"') == 2  # gh pr edit and gh pr create
    assert 'gh pr edit "$BRANCH"' in script and '--head "$BRANCH"' in script
    assert job["env"]["BRANCH"] == "mizzen/flaky-quarantine"
    assert pr["env"] == {"GH_TOKEN": "${{ github.token }}", "REPO": "${{ github.repository }}"}
    assert "-- ci/flaky.toml" in script and "git add" not in script  # commits only the list


def test_lanes_skip_from_the_base_on_pull_requests_and_record_otherwise():
    for name, job in (("pr.yml", "lanes"), ("gpu.yml", "gpu")):
        env = load(name)["jobs"][job]["env"]
        assert "'skip' || 'record'" in env[MODE_ENV], name
        assert "base" in env[REV_ENV] and "head" not in env[REV_ENV], name
