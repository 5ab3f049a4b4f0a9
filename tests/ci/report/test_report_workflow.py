"""nightly.yml's health-page job and the pool records, read as data: the page is rendered from the
history the nightly history job saved (this run's cache key) and uploaded from the folder it was
written to, with a read-only token; the pool records of each merged plan go into the history that
job saves, and the merge carries the earlier kinded records over."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=2, labels=["ci"])

NIGHTLY = Path(__file__).resolve().parents[3] / ".github" / "workflows" / "nightly.yml"


def test_the_health_page_is_rendered_from_the_saved_history_and_uploaded():
    jobs = yaml.safe_load(NIGHTLY.read_text())["jobs"]
    job, history = jobs["health-page"], jobs["history"]
    assert job["needs"] == "history" and job["permissions"] == {"contents": "read"}
    saved = next(s for s in history["steps"] if s.get("uses", "").startswith("actions/cache/save@"))
    restored = next(
        s for s in job["steps"] if s.get("uses", "").startswith("actions/cache/restore@")
    )
    assert (
        restored["with"]["key"] == saved["with"]["key"] and restored["with"]["fail-on-cache-miss"]
    )
    (render,) = (s for s in job["steps"] if "run" in s)
    argv = shlex.split(render["run"])
    assert argv[:5] == ["python3", "-S", "-m", "mizzen_ci", "report"]
    assert argv[argv.index("--history") + 1] == saved["with"]["path"]
    upload = next(
        s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")
    )
    assert upload["with"]["name"] == "health-page"
    assert upload["with"]["path"].rstrip("/") == argv[argv.index("--html") + 1]


def test_pool_records_go_into_the_saved_history_and_survive_the_merge():
    steps = yaml.safe_load(NIGHTLY.read_text())["jobs"]["history"]["steps"]
    saved = next(s for s in steps if s.get("uses", "").startswith("actions/cache/save@"))["with"][
        "path"
    ]
    names = [s.get("name", "") for s in steps]
    merge = steps[
        names.index("Merge durations and flake records; store the metric values as trusted")
    ]["run"]
    record = steps[
        names.index(
            "Record the pools of each merged run's plan (the health page's makespan and utilisation)"
        )
    ]
    assert f"{saved}/health.jsonl > .ci-artifacts/merged/health.jsonl" in merge
    assert merge.index("merged/health.jsonl") < merge.index("mv .ci-artifacts/merged")
    assert record["run"].count(f"--out {saved}/health.jsonl") == 2
    assert steps.index(record) < steps.index(
        next(s for s in steps if s.get("uses", "").startswith("actions/cache/save@"))
    )
