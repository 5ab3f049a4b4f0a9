"""The planner over the repository's fleet with tests of both vendors: AMD pools get jobs with
their own ``runs-on`` labels and runner groups, ``run-on-<amd arch>`` and the weekly schedule
reach them, the report groups jobs, pools and arches by vendor, and a plan written before the
``vendor`` field existed still loads."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.output import markdown as escape_markdown
from mizzen_ci.plan import Plan
from mizzen_ci.plan.report import groups, markdown, terminal

register_cpu_ci(est_time=20, labels=["ci"])

GPU = "from mizzen_ci import register_gpu_ci\nregister_gpu_ci(est_time={t}, hardware={hw!r}, num_gpus={n}, labels=['train']{extra})\n"
CUDA = "from mizzen_ci import register_cuda_ci\nregister_cuda_ci(est_time={t}, hardware={hw!r}, num_gpus={n}, labels=['lora'])\n"
TESTS = {
    "tests/t/test_cpu.py": "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=30)\n",
    "tests/t/test_hopper.py": CUDA.format(t=120, hw=["hopper", "blackwell"], n=2),
    "tests/t/test_both.py": GPU.format(t=300, hw=["hopper", "cdna3"], n=8, extra=""),
    "tests/t/test_mi300x.py": GPU.format(t=200, hw=["cdna3"], n=1, extra=""),
    "tests/t/test_mi355x.py": GPU.format(t=400, hw=["cdna4"], n=4, extra=""),
    "tests/t/test_rdma.py": GPU.format(
        t=600, hw=["hopper", "cdna3"], n=8, extra=", needs=['rdma']"
    ),
    "tests/t/test_cdna2.py": GPU.format(t=60, hw=["cdna2", "cdna3"], n=1, extra=""),
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1"}
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, repo_root: Path) -> Path:
    """The repository's fleet table and the tests above, committed on ``main``, then touched on a
    branch (so every test is impacted)."""
    root = tmp_path_factory.mktemp("plan") / "repo"
    files = {
        "ci/fleet.toml": (repo_root / "ci" / "fleet.toml").read_text(),
        "pyproject.toml": '[project]\nname = "t"\nversion = "0"\n',
        **TESTS,
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    git(root, "checkout", "-qb", "change")
    for rel, text in TESTS.items():
        (root / rel).write_text(text + "# touched\n")
    git(root, "commit", "-qam", "touch every test")
    return root


@pytest.fixture(scope="module")
def plan(repo: Path, mizzen_ci, tmp_path_factory):
    """``plan(*ARGS)``: (the plan JSON, the terminal report, the Markdown summary) of one
    ``mizzen-ci plan --same-repo`` over the repository above (``--base main`` unless scheduled)."""
    out = tmp_path_factory.mktemp("out")

    def run(*args: str) -> tuple[dict, str, str]:
        base = [] if "schedule" in args else ["--base", "main"]
        (out / "summary.md").unlink(missing_ok=True)  # --summary appends (a step summary)
        done = mizzen_ci(
            "plan", "--root", str(repo), *base, "--head", "HEAD", "--no-cache", "--same-repo",
            "--output", str(out / "plan.json"), "--summary", str(out / "summary.md"), *args,
            cwd=repo, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return (
            json.loads((out / "plan.json").read_text()),
            done.stdout,
            (out / "summary.md").read_text(),
        )

    return run


def runs(p: dict) -> dict[tuple[str, str], str]:
    """{(test file, arch): pool} of a plan's GPU jobs."""
    return {(t["file"], j["arch"]): j["pool"] for j in p["jobs"] if j["arch"] for t in j["tests"]}


def test_amd_only_tests_go_to_the_amd_pools_and_shared_ones_home_to_nvidia(plan):
    p, _, _ = plan()
    assert runs(p) == {
        ("tests/t/test_hopper.py", "hopper"): "h200-2gpu",
        ("tests/t/test_both.py", "hopper"): "h200-8gpu",
        ("tests/t/test_rdma.py", "hopper"): "h100-8gpu-rdma",
        ("tests/t/test_mi300x.py", "cdna3"): "mi300x-8gpu",
        ("tests/t/test_cdna2.py", "cdna3"): "mi300x-8gpu",  # cdna2 has no pool
        ("tests/t/test_mi355x.py", "cdna4"): "mi355x-8gpu",
    }
    fleet = load_fleet(Path(__file__).resolve().parents[3] / "ci" / "fleet.toml")
    for job in p["jobs"]:
        if job["arch"] is None:
            assert job["vendor"] is None and job["runner_group"] is None
            continue
        pool = fleet.pool(job["pool"])
        assert job["vendor"] == fleet.generation(job["arch"]).vendor
        assert (tuple(job["runs_on"]), job["runner_group"]) == (pool.runs_on, pool.runner_group)
        assert job["lane"] == f"gpu-{job['arch']}" and job["id"].startswith(f"{job['arch']}-")


def test_run_on_cdna3_adds_the_mi300x_pool_and_weekly_runs_every_declared_arch(plan):
    asked, _, _ = plan("--label", "run-on-cdna3")
    default, _, _ = plan()
    added = set(runs(asked).items()) - set(runs(default).items())
    assert added == {(("tests/t/test_both.py", "cdna3"), "mi300x-8gpu")}
    not_here = {(n["file"], n["arch"]): n for n in asked["not_scheduled"]}
    rdma = not_here[("tests/t/test_rdma.py", "cdna3")]
    assert (rdma["code"], rdma["reason"]) == (
        "arch-not-in-fleet",
        "no cdna3 pool has 8 GPU(s) with rdma",
    )
    weekly, _, _ = plan("--event", "schedule", "--cadence", "weekly")
    assert runs(weekly) == {
        **runs(default),
        ("tests/t/test_hopper.py", "blackwell"): "b200-8gpu",
        ("tests/t/test_both.py", "cdna3"): "mi300x-8gpu",
    }
    weekly_not = {(n["file"], n["arch"]): n["code"] for n in weekly["not_scheduled"]}
    assert weekly_not[("tests/t/test_cdna2.py", "cdna2")] == "arch-not-in-fleet"


def test_the_report_groups_jobs_pools_and_arches_by_vendor(plan):
    p, text, md = plan("--label", "run-on-cdna3")
    headings = [line for line in text.splitlines() if " job(s) on " in line]
    assert headings == [
        "CPU (GitHub-hosted): 1 job(s) on 1 pool(s)",
        "NVIDIA GPUs: 3 job(s) on 3 pool(s)",
        "AMD GPUs: 3 job(s) on 2 pool(s)",
    ]
    nvidia, amd = (text.index(h) for h in headings[1:])
    between = text[nvidia:amd]
    assert "h200-8gpu" in between and "mi300x" not in between and "gpu-cdna3" not in between
    rest = text[amd:].split("\n\n")
    amd_tables = "\n\n".join(rest[:4])  # heading, jobs, pools, arches
    assert "mi300x-8gpu" in amd_tables and "mi355x-8gpu" in amd_tables
    assert "h200" not in amd_tables
    assert [line for line in md.splitlines() if line.startswith("### ")] == [
        f"### {escape_markdown(h)}" for h in headings
    ]
    assert md.count("<details>") == 2  # the groups are headings, not more collapsed blocks
    # the terminal and Markdown renderers read the same groups from the plan record
    loaded = Plan.from_json(p)
    assert [h for h, _ in groups(loaded)] == [h.split(":")[0] for h in headings]
    assert terminal(loaded) == text and markdown(loaded).rstrip() == md.rstrip()


def test_a_plan_written_before_the_vendor_field_still_loads_and_renders(plan):
    p, _, _ = plan("--label", "run-on-cdna3")
    for record in (*p["jobs"], *p["pools"], *p["capacity"]):
        del record["vendor"]
    old = Plan.from_json(p)
    assert {j.vendor for j in old.jobs} == {None}
    assert [h for h, _ in groups(old)] == ["CPU (GitHub-hosted)", "GPUs (vendor not recorded)"]
    p["jobs"][0]["vendor"] = 7
    with pytest.raises(ValueError, match=r"jobs\[0\]\.vendor: expected a string or null"):
        Plan.from_json(p)
