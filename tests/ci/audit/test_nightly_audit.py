"""nightly.yml runs the selection audit and bisects a new failure on main (issue 34), checked on
the workflow's steps and inputs (nothing here calls GitHub): the audit step's summary and its
failing exit, the execution store carried into the history cache, and the bisect job's
conditions, revisions and job id, all through `nox -s audit` / `nox -s bisect` / mizzen-ci."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=2, labels=["ci"])

NIGHTLY = Path(__file__).resolve().parents[3] / ".github" / "workflows" / "nightly.yml"


def _jobs() -> dict:
    return yaml.safe_load(NIGHTLY.read_text())["jobs"]


def _runs(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def test_the_audit_job_posts_the_table_and_fails_below_full_recall():
    audit = _jobs()["audit"]
    assert audit["permissions"] == {"contents": "read"}
    run = _runs(audit)
    assert "python3 -m nox -s audit --" in run
    assert '"--markdown=$GITHUB_STEP_SUMMARY"' in run  # the table into the step summary
    assert "--record .ci-artifacts/execution/audit.jsonl" in run  # the page's record, uploaded
    assert "|| true" not in run and "continue-on-error" not in str(audit)  # a miss fails the job
    upload = [s for s in audit["steps"] if "upload-artifact@" in s.get("uses", "")]
    assert upload and upload[0]["with"]["name"] == "execution-cpu"
    assert upload[0]["if"] == "always()"


def test_the_history_job_merges_the_execution_store_into_the_cache():
    history = _jobs()["history"]
    assert "audit" in history["needs"]
    run = _runs(history)
    merge = run.index("mizzen_ci audit --merge")
    assert "--store .ci-artifacts/merged/execution.sqlite" in run
    assert merge < run.index("mv .ci-artifacts/merged .ci-artifacts/history")  # before the swap
    downloads = [s["with"].get("pattern") for s in history["steps"] if "download-artifact@" in
                 s.get("uses", "")]  # fmt: skip
    assert "execution-*" in downloads
    # the audit record reaches the health page's store after the swap (else the swap drops it)
    carry = run.index(".ci-artifacts/new/execution/*/audit.jsonl")
    assert carry > run.index("mv .ci-artifacts/merged .ci-artifacts/history")
    assert ">> .ci-artifacts/history/health.jsonl" in run[carry:]


def test_the_bisect_job_runs_for_a_new_failure_on_main_and_writes_the_summary():
    bisect = _jobs()["bisect"]
    assert bisect["needs"] == ["run"]
    assert bisect["if"] == "failure() && github.ref == 'refs/heads/main'"
    assert bisect["permissions"] == {"contents": "read", "actions": "read"}
    checkout = bisect["steps"][0]
    assert checkout["with"]["fetch-depth"] == 0 and checkout["with"]["persist-credentials"] is False
    found = next(s for s in bisect["steps"] if s.get("id") == "failed")
    assert "--status success" in found["run"] and "--workflow nightly.yml" in found["run"]
    assert "mizzen_ci bisect --failed-jobs" in found["run"]
    assert re.search(r"\[\[ \$good =~ \^\[0-9a-f\]\{40\}\$ \]\]", found["run"])  # validated
    step = bisect["steps"][-1]
    assert step["if"] == "steps.failed.outputs.job != ''"
    assert step["env"] == {"GOOD": "${{ steps.failed.outputs.good }}",
                           "JOB": "${{ steps.failed.outputs.job }}", "SHA": "${{ github.sha }}"}  # fmt: skip
    assert step["run"].split() == [
        "python3", "-m", "nox", "-s", "bisect", "--", "--job", '"$JOB"', "--plan",
        ".ci-artifacts/bisect/plan.json", "--good", '"$GOOD"', "--bad", '"$SHA"',
        '"--markdown=$GITHUB_STEP_SUMMARY"',
    ]  # fmt: skip
    assert "${{" not in step["run"]  # expressions reach the shell through env only
