"""The planner on real temporary git repositories: make commits, then plan.

A small workspace (two packages, CPU and GPU tests, a conftest, data files) is committed on main;
each scenario branches, changes something with real git (edit, rename, delete, untracked files),
and plans.  Every plan must account for every registered test (scheduled, or listed with a
reason), besides the scenario's own assertions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan import Plan
from mizzen_ci.plan.change import git_change
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Comment, Inputs

register_cpu_ci(est_time=30, labels=["ci"])

FLEET = """
capabilities = ["rdma"]
labels = ["ci", "lora", "train", "rollout"]

[[arch]]
name = "hopper"
vendor = "nvidia"
compute_capabilities = ["9.0"]

[[arch]]
name = "blackwell"
vendor = "nvidia"
compute_capabilities = ["10.0"]

[[arch]]
name = "ampere"
vendor = "nvidia"
compute_capabilities = ["8.0"]

[cpu_pool]
name = "cpu-hosted"
runs_on = ["ubuntu-24.04"]
runners = 4
job_setup_s = 60

[[pool]]
name = "h200-2gpu"
arch = "hopper"
gpu = "H200"
gpus_per_runner = 2
runners = 2
runs_on = ["self-hosted", "h200", "gpu-2"]
runner_group = "mizzen-h200-2gpu"
job_setup_s = 300

[[pool]]
name = "h100-8gpu-rdma"
arch = "hopper"
gpu = "H100"
gpus_per_runner = 8
runners = 1
runs_on = ["self-hosted", "h100", "gpu-8", "rdma"]
runner_group = "mizzen-h100-8gpu-rdma"
job_setup_s = 300
capabilities = ["rdma"]

[[pool]]
name = "b200-8gpu"
arch = "blackwell"
gpu = "B200"
gpus_per_runner = 8
runners = 1
runs_on = ["self-hosted", "b200", "gpu-8"]
runner_group = "mizzen-b200-8gpu"
job_setup_s = 300
"""

CPU = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time={t}, labels=['ci']{extra})\n"
CUDA = (
    "from mizzen_ci import register_cuda_ci\n"
    "register_cuda_ci(est_time={t}, hardware={hw!r}, num_gpus={n}, labels={labels!r}{extra})\n"
)

FILES = {
    "pyproject.toml": (
        '[project]\nname = "ws"\nversion = "0"\n\n'
        '[tool.uv.workspace]\nmembers = ["packages/alpha", "packages/beta"]\n'
    ),
    "uv.lock": "version = 1\n",
    "README.md": "# workspace\n",
    "docs/guide.md": "a guide\n",
    "packages/alpha/pyproject.toml": '[project]\nname = "alpha"\nversion = "0"\n',
    "packages/alpha/src/alpha/__init__.py": '"""alpha."""\n',
    "packages/alpha/src/alpha/core.py": "import json\nfrom . import util\n",
    "packages/alpha/src/alpha/leaf.py": "def f():\n    return 1\n",
    "packages/alpha/src/alpha/util/__init__.py": "",
    "packages/alpha/src/alpha/util/text.py": "def g():\n    return 2\n",
    "packages/alpha/src/alpha/data/table.json": "{}\n",
    "packages/beta/pyproject.toml": '[project]\nname = "beta"\nversion = "0"\n',
    "packages/beta/src/beta/__init__.py": "",
    "packages/beta/src/beta/model.py": (
        "def build():\n    from alpha import leaf  # lazy: tests run function bodies\n"
        "    return leaf.f()\n"
    ),
    "packages/beta/src/beta/engine.py": "from beta.model import build\n",
    "tests/alpha/test_core.py": "import alpha.core\n" + CPU.format(t=10, extra=""),
    "tests/alpha/test_leaf.py": "from alpha import leaf\n" + CPU.format(t=10, extra=""),
    "tests/alpha/test_text.py": "from alpha.util.text import g\n" + CPU.format(t=10, extra=""),
    "tests/alpha/test_plain.py": "import json\n" + CPU.format(t=5, extra=""),
    "tests/alpha/test_cpu_nightly.py": CPU.format(t=5, extra=", nightly=True"),
    "tests/beta/conftest.py": "import pytest\n",
    "tests/beta/data/sample.txt": "data\n",
    "tests/beta/test_engine.py": "import beta.engine\n" + CPU.format(t=20, extra=""),
    "tests/beta/test_model_gpu.py": "import beta.model\n"
    + CUDA.format(t=300, hw=["hopper"], n=1, labels=["lora"], extra=""),
    "tests/beta/test_both_gpu.py": "import beta\n"
    + CUDA.format(t=600, hw=["hopper", "blackwell"], n=2, labels=["train"], extra=""),
    "tests/beta/test_rdma_gpu.py": CUDA.format(
        t=900, hw=["hopper", "blackwell"], n=8, labels=["train"], extra=", needs=['rdma']"
    ),
    "tests/beta/test_ampere_too.py": CUDA.format(
        t=60, hw=["hopper", "ampere"], n=1, labels=["rollout"], extra=""
    ),
    "tests/gpu/test_nightly_gpu.py": CUDA.format(
        t=4000, hw=["hopper"], n=2, labels=["train"], extra=", nightly=True"
    ),
    "tests/gpu/test_disabled_gpu.py": CUDA.format(
        t=60, hw=["hopper"], n=1, labels=["lora"], extra=", disabled='flaky NCCL, issue #7'"
    ),
}
ALL_CPU = {
    "tests/alpha/test_core.py",
    "tests/alpha/test_leaf.py",
    "tests/alpha/test_text.py",
    "tests/alpha/test_plain.py",
    "tests/beta/test_engine.py",
}
GPU_HOME = {
    ("tests/beta/test_model_gpu.py", "hopper"),
    ("tests/beta/test_both_gpu.py", "hopper"),
    ("tests/beta/test_rdma_gpu.py", "hopper"),
    ("tests/beta/test_ampere_too.py", "hopper"),
}
UNHOSTABLE = 'from mizzen_ci import register_cuda_ci\nregister_cuda_ci(est_time=60, hardware=["ampere"], labels=["train"])\n'


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1"},
    )
    return out.stdout


def write(repo: Path, rel: str, text: str) -> None:
    path = repo / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("template") / "repo"
    write(repo, "ci/fleet.toml", FLEET)
    for rel, text in FILES.items():
        write(repo, rel, text)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    return repo


@pytest.fixture
def repo(template: Path, tmp_path: Path) -> Path:
    """A fresh copy of the template on a branch `change` off main."""
    dest = tmp_path / "repo"
    shutil.copytree(template, dest, symlinks=True)
    git(dest, "checkout", "-q", "-b", "change")
    return dest


def commit(repo: Path, message: str = "change") -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def plan(repo: Path, base: str | None = "main", head: str | None = "HEAD", **inputs):
    options = inputs.pop("options", PlanOptions())
    inputs.setdefault("fork", False)  # a pull request from this repository unless told otherwise
    fleet = load_fleet(repo / "ci" / "fleet.toml")
    change = git_change(repo, base, head)
    p = build_plan(repo, fleet, change, Inputs(**inputs), options).to_json()
    check_accounted(repo, p)
    return p


def scheduled(p: dict) -> set[tuple[str, str | None]]:
    return {(t["file"], j["arch"]) for j in p["jobs"] for t in j["tests"]}


def not_scheduled(p: dict) -> dict[tuple[str, str | None], str]:
    return {(n["file"], n["arch"]): n["code"] for n in p["not_scheduled"]}


def check_accounted(repo: Path, p: dict) -> None:
    """Every registered test file appears, no (file, arch) is both scheduled and not, and no
    pair is scheduled twice."""
    runs = [(t["file"], j["arch"]) for j in p["jobs"] for t in j["tests"]]
    assert len(runs) == len(set(runs)), "a (test, arch) placed twice"
    missing = set(runs) & set(not_scheduled(p))
    assert not missing, f"both scheduled and not: {missing}"
    files = {f for f, _ in runs} | {n["file"] for n in p["not_scheduled"]}
    on_disk = {p.relative_to(repo).as_posix() for p in (repo / "tests").rglob("test_*.py")}
    kept = {o["file"] for o in p.get("overrides", [])}  # a base file the head deleted
    assert files == on_disk | kept


# --------------------------------------------------------------------------------------------


def test_docs_only_change_selects_nothing(repo):
    write(repo, "docs/guide.md", "a better guide\n")
    write(repo, "packages/alpha/README.md", "alpha readme\n")
    commit(repo)
    p = plan(repo)
    assert p["jobs"] == []
    assert set(not_scheduled(p).values()) == {"not-impacted", "nightly-only", "disabled"}
    assert not p["selection"]["everything"]


def test_one_leaf_module_selects_exactly_the_tests_whose_closure_holds_it(repo):
    write(repo, "packages/alpha/src/alpha/leaf.py", "def f():\n    return 3\n")
    commit(repo)
    p = plan(repo)
    # test_leaf imports it; beta.model imports it lazily inside a function (reached by
    # test_model_gpu and, through beta.engine, by test_engine).
    assert scheduled(p) == {
        ("tests/alpha/test_leaf.py", None),
        ("tests/beta/test_engine.py", None),
        ("tests/beta/test_model_gpu.py", "hopper"),
    }
    whys = {t["file"]: t["why"] for j in p["jobs"] for t in j["tests"]}
    assert "alpha.leaf" in whys["tests/beta/test_model_gpu.py"]
    assert not_scheduled(p)[("tests/alpha/test_core.py", None)] == "not-impacted"


def test_package_init_change_reaches_its_importers(repo):
    write(repo, "packages/alpha/src/alpha/__init__.py", '"""alpha, changed."""\nX = 1\n')
    commit(repo)
    p = plan(repo)
    # importing alpha.<anything> runs alpha/__init__.py first
    assert {f for f, _ in scheduled(p)} == {
        "tests/alpha/test_core.py",
        "tests/alpha/test_leaf.py",
        "tests/alpha/test_text.py",
        "tests/beta/test_engine.py",
        "tests/beta/test_model_gpu.py",
    }


def test_rename_counts_both_paths(repo):
    git(
        repo,
        "mv",
        "packages/alpha/src/alpha/util/text.py",
        "packages/alpha/src/alpha/util/words.py",
    )
    commit(repo)
    change = git_change(repo, "main", "HEAD")
    assert [(e.status, e.old_path, e.path) for e in change.entries] == [
        ("R", "packages/alpha/src/alpha/util/text.py", "packages/alpha/src/alpha/util/words.py")
    ]
    p = plan(repo)
    # test_text still imports the old module name: it is impacted (and would now fail)
    assert ("tests/alpha/test_text.py", None) in scheduled(p)
    # alpha.util's __init__ did not change and nobody imports alpha.util.words
    assert ("tests/alpha/test_core.py", None) not in scheduled(p)


def test_deletion_selects_the_importers_of_the_deleted_module(repo):
    git(repo, "rm", "-q", "packages/alpha/src/alpha/leaf.py")
    commit(repo)
    p = plan(repo)
    assert {f for f, _ in scheduled(p)} == {
        "tests/alpha/test_leaf.py",
        "tests/beta/test_engine.py",
        "tests/beta/test_model_gpu.py",
    }


def test_a_deleted_test_file_the_base_runs_stays_in_the_plan_with_an_error(repo):
    git(repo, "rm", "-q", "tests/alpha/test_plain.py")
    commit(repo)
    p = plan(repo)
    # the base runs a changed test file; a change cannot remove a run (land disabled= first)
    assert scheduled(p) == {("tests/alpha/test_plain.py", None)}
    assert any("tests/alpha/test_plain.py: the base runs it" in e for e in p["errors"])
    (o,) = p["overrides"]
    assert "deletes it" in o["reason"]
    # a test the base already disabled goes quietly
    git(repo, "rm", "-q", "tests/gpu/test_disabled_gpu.py")
    commit(repo)
    p = plan(repo, base="HEAD~1")
    assert p["jobs"] == [] and not p["errors"] and "overrides" not in p


@pytest.mark.parametrize("path", ["uv.lock", "packages/beta/pyproject.toml", "ci/fleet.toml"])
def test_dependency_or_ci_change_selects_everything(repo, path):
    (repo / path).write_text((repo / path).read_text() + "\n# touched\n")
    commit(repo)
    p = plan(repo)
    assert p["selection"]["everything"] and path in p["selection"]["because"][0]
    assert {f for f, a in scheduled(p) if a is None} == ALL_CPU
    assert {(f, a) for f, a in scheduled(p) if a} == GPU_HOME


def test_unknown_path_selects_everything(repo):
    write(repo, "tools/release.sh", "echo release\n")
    commit(repo)
    p = plan(repo)
    assert p["selection"]["everything"]
    assert "no rule knows this path" in p["selection"]["because"][0]
    assert {f for f, a in scheduled(p) if a is None} == ALL_CPU


def test_unusable_diff_selects_everything_with_a_warning(repo):
    p = plan(repo, base="no-such-branch")
    assert p["selection"]["everything"]
    assert any("no-such-branch" in w for w in p["warnings"])
    assert {f for f, a in scheduled(p) if a is None} == ALL_CPU


def test_conftest_and_test_data_select_their_directories(repo):
    write(repo, "tests/beta/conftest.py", "import pytest\nimport alpha.core\n")
    commit(repo, "conftest")
    p = plan(repo)
    assert {f for f, _ in scheduled(p)} == {
        "tests/beta/test_engine.py",
        "tests/beta/test_model_gpu.py",
        "tests/beta/test_both_gpu.py",
        "tests/beta/test_rdma_gpu.py",
        "tests/beta/test_ampere_too.py",
    }
    # a data file is read by the tests of the directories above it
    write(repo, "tests/beta/data/sample.txt", "new data\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "data")
    p = plan(repo, base="HEAD~1")
    assert {f for f, _ in scheduled(p)} == {
        "tests/beta/test_engine.py",
        "tests/beta/test_model_gpu.py",
        "tests/beta/test_both_gpu.py",
        "tests/beta/test_rdma_gpu.py",
        "tests/beta/test_ampere_too.py",
    }


def test_package_data_file_selects_that_packages_tests(repo):
    write(repo, "packages/alpha/src/alpha/data/table.json", '{"a": 1}\n')
    commit(repo)
    p = plan(repo)
    assert {f for f, _ in scheduled(p)} == {
        "tests/alpha/test_core.py",
        "tests/alpha/test_leaf.py",
        "tests/alpha/test_text.py",
        "tests/beta/test_engine.py",  # beta.model reaches alpha.leaf
        "tests/beta/test_model_gpu.py",
    }


def test_working_tree_default_range_includes_uncommitted_and_untracked(repo):
    write(repo, "packages/alpha/src/alpha/util/text.py", "def g():\n    return 5\n")  # unstaged
    write(repo, "packages/alpha/src/alpha/extra.py", "import alpha.leaf\n")  # untracked
    p = plan(repo, base=None, head=None)
    assert p["worktree"] is True
    assert p["base"] == git(repo, "rev-parse", "main").strip()
    assert {f for f, _ in scheduled(p)} == {"tests/alpha/test_text.py"}


def test_labels_and_trusted_comment_commands_add_gpu_tests(repo):
    write(repo, "docs/guide.md", "docs\n")
    commit(repo)
    p = plan(
        repo,
        labels=("run-ci-lora", "run-on-blackwell"),
        comments=(
            Comment("MEMBER", "looks good\n/run-ci train"),
            Comment("NONE", "/run-ci rollout"),
        ),
    )
    assert scheduled(p) == {
        ("tests/beta/test_model_gpu.py", "hopper"),  # run-ci-lora
        ("tests/beta/test_both_gpu.py", "hopper"),  # /run-ci train (home arch) ...
        ("tests/beta/test_both_gpu.py", "blackwell"),  # ... and run-on-blackwell
        ("tests/beta/test_rdma_gpu.py", "hopper"),
    }
    ns = not_scheduled(p)
    assert ns[("tests/beta/test_rdma_gpu.py", "blackwell")] == "arch-not-in-fleet"  # no rdma
    assert ns[("tests/beta/test_ampere_too.py", "hopper")] == "not-impacted"  # NONE ignored
    assert any("association NONE" in w for w in p["warnings"])
    whys = {t["file"]: t["why"] for j in p["jobs"] for t in j["tests"]}
    assert whys["tests/beta/test_model_gpu.py"] == "asked for by run-ci-lora"


def test_run_ci_all_and_unknown_labels(repo):
    write(repo, "docs/guide.md", "docs\n")
    commit(repo)
    p = plan(repo, labels=("run-ci-all", "run-ci-nosuch", "run-on-volta"))
    assert {(f, a) for f, a in scheduled(p)} == GPU_HOME
    assert any("nosuch" in w for w in p["warnings"])
    assert any("volta" in w for w in p["warnings"])


def test_untrusted_author_runs_cpu_only_until_this_event_asks_for_gpu_jobs(repo):
    write(repo, "packages/alpha/src/alpha/leaf.py", "def f():\n    return 4\n")
    commit(repo)
    untrusted = {"fork": True, "author_association": "FIRST_TIME_CONTRIBUTOR"}
    p = plan(repo, labels=("run-ci-all",), action="synchronize", **untrusted)
    assert {a for _, a in scheduled(p)} == {None}
    assert not_scheduled(p)[("tests/beta/test_model_gpu.py", "hopper")] == "untrusted"
    assert p["trusted"] is False and p["approval"] is None
    # the labeled event that adds ok-to-test approves the head it carries ...
    p = plan(repo, labels=("ok-to-test",), action="labeled", label_added="ok-to-test", **untrusted)
    assert ("tests/beta/test_model_gpu.py", "hopper") in scheduled(p)
    assert "ok-to-test" in p["approval"] and "`gpu-untrusted`" in p["approval"]
    assert p["trusted"] is False  # the workflow sends these GPU jobs through the environment
    # ... another label added later approves nothing, nor does a later push
    p = plan(repo, labels=("ok-to-test", "x"), action="labeled", label_added="x", **untrusted)
    assert ("tests/beta/test_model_gpu.py", "hopper") not in scheduled(p)
    p = plan(repo, labels=("ok-to-test",), action="synchronize", **untrusted)
    assert ("tests/beta/test_model_gpu.py", "hopper") not in scheduled(p)
    assert any("a later push needs a new one" in w for w in p["warnings"])
    # a trusted commenter's command approves the head the run is pinned to; an untrusted one not
    p = plan(repo, comments=(Comment("NONE", "/run-ci all"),), **untrusted)
    assert {a for _, a in scheduled(p)} == {None}
    p = plan(repo, comments=(Comment("MEMBER", "/run-ci lora"),), **untrusted)
    assert ("tests/beta/test_model_gpu.py", "hopper") in scheduled(p)
    assert "a trusted comment (/run-ci lora)" in p["approval"]
    assert "required reviewers approve this run" in p["approval"] and p["trusted"] is False
    # a command that asks for nothing that can run asks for no GPU job
    p = plan(repo, comments=(Comment("MEMBER", "/run-ci nosuchlabel"),), **untrusted)
    assert {a for _, a in scheduled(p)} == {None} and p["approval"] is None
    # unknown fork status is untrusted; a fork of a member is trusted
    p = plan(repo, fork=None, author_association="CONTRIBUTOR", labels=("run-ci-all",))
    assert {a for _, a in scheduled(p)} == {None}
    p = plan(repo, fork=True, author_association="MEMBER", action="synchronize")
    assert ("tests/beta/test_model_gpu.py", "hopper") in scheduled(p)


def test_nightly_runs_every_enabled_gpu_test_on_its_auto_arch(repo):
    p = plan(repo, base=None, head=None, event="schedule", cadence="nightly")
    gpu = {(f, a) for f, a in scheduled(p) if a}
    assert gpu == GPU_HOME | {("tests/gpu/test_nightly_gpu.py", "hopper")}
    assert {f for f, a in scheduled(p) if a is None} == ALL_CPU | {
        "tests/alpha/test_cpu_nightly.py"
    }
    assert not_scheduled(p)[("tests/gpu/test_disabled_gpu.py", "hopper")] == "disabled"
    assert not_scheduled(p)[("tests/beta/test_both_gpu.py", "blackwell")] == "not-auto-arch"


def test_weekly_runs_every_declared_arch_the_fleet_has(repo):
    p = plan(repo, base=None, head=None, event="schedule", cadence="weekly")
    assert ("tests/beta/test_both_gpu.py", "blackwell") in scheduled(p)
    ns = not_scheduled(p)
    assert ns[("tests/beta/test_ampere_too.py", "ampere")] == "arch-not-in-fleet"
    assert ns[("tests/beta/test_rdma_gpu.py", "blackwell")] == "arch-not-in-fleet"
    reasons = {(n["file"], n["arch"]): n["reason"] for n in p["not_scheduled"]}
    assert (
        "no blackwell pool has 8 GPU(s) with rdma"
        in reasons[("tests/beta/test_rdma_gpu.py", "blackwell")]
    )


def test_a_test_no_fleet_pool_can_host_is_listed_with_the_registry_error(repo):
    write(repo, "tests/gpu/test_ampere_only.py", UNHOSTABLE)
    commit(repo)
    p = plan(repo)
    ns = not_scheduled(p)
    assert ns[("tests/gpu/test_ampere_only.py", None)] == "registry-error"
    assert any("test_ampere_only.py" in e and "no-pool" in e for e in p["errors"])


def test_over_budget_test_gets_a_job_of_its_own_and_a_warning(repo):
    p = plan(
        repo,
        base=None,
        head=None,
        event="schedule",
        cadence="nightly",
        options=PlanOptions(budget_seconds=1800),
    )
    (job,) = [j for j in p["jobs"] if j["over_budget"]]
    assert job["tests"][0]["file"] == "tests/gpu/test_nightly_gpu.py"
    setup = {q["pool"]: q["setup_seconds"] for q in p["pools"]}
    assert setup[job["pool"]] > 0
    assert job["est_seconds"] == setup[job["pool"]] + 4000  # a job holds its runner for both
    assert job["tests"][0]["start_seconds"] == setup[job["pool"]]  # tests start after set-up
    assert all(j["est_seconds"] <= 1800 for j in p["jobs"] if not j["over_budget"])
    assert any("test_nightly_gpu.py" in w and "job of its own" in w for w in p["warnings"])


def test_history_replaces_est_time(repo, tmp_path):
    store = tmp_path / "h.jsonl"
    rec = {"file": "tests/beta/test_model_gpu.py", "arch": "hopper", "outcome": "passed",
           "lane": "gpu-hopper", "job": None}  # fmt: skip
    store.write_text(
        "".join(
            json.dumps({**rec, "seconds": s, "when": f"2026-11-{d:02d}T00:00:00+00:00"}) + "\n"
            for d, s in enumerate([100, 110, 120, 500], 1)
        )
    )
    p = plan(repo, labels=("run-ci-lora",), options=PlanOptions(history=(store,)))
    (t,) = [t for j in p["jobs"] for t in j["tests"]]
    assert (t["est_seconds"], t["estimate"]) == (500, "history")  # p90 of 4 = the largest


def test_cli_under_python_S_writes_plan_summary_and_matrix(repo, tmp_path, mizzen_ci):
    write(repo, "packages/alpha/src/alpha/leaf.py", "def f():\n    return 9\n")
    commit(repo)
    out, summary, gh = tmp_path / "plan.json", tmp_path / "summary.md", tmp_path / "gh.txt"
    proc = mizzen_ci(
        "plan", "--root", str(repo), "--base", "main", "--head", "HEAD", "--same-repo",
        "--label", "run-ci-train", "--output", str(out), "--summary", str(summary),
        "--github-output", str(gh), "--verbose", cwd=repo,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "tests/beta/test_model_gpu.py" in proc.stdout
    loaded = Plan.load(out)
    assert loaded.to_json() == json.loads(out.read_text())  # read back whole, nothing lost
    gpu_job = next(j for j in loaded.jobs if "tests/beta/test_model_gpu.py" in j.files)
    assert loaded.job(gpu_job.id).files == [t.file for t in gpu_job.tests]
    assert gpu_job.lane == "gpu-hopper" and gpu_job.pool == "h200-2gpu"
    assert "## mizzen CI plan" in summary.read_text()
    lines = dict(line.split("=", 1) for line in gh.read_text().splitlines())
    matrix = json.loads(lines["matrix"])
    assert int(lines["jobs"]) == len(matrix["include"]) == len(loaded.jobs)
    entry = next(e for e in matrix["include"] if e["id"] == gpu_job.id)
    assert json.loads(entry["runs_on"]) == {
        "group": gpu_job.runner_group,
        "labels": list(gpu_job.runs_on),
    }
    assert entry["lane"] == "gpu-hopper"


def test_cli_reads_a_comment_from_a_file_whatever_its_text(repo, tmp_path, mizzen_ci):
    write(repo, "docs/guide.md", "docs\n")
    commit(repo)
    body = tmp_path / "comment.txt"
    body.write_text("--help me; $(rm -rf /)\n/run-ci lora\n")
    proc = mizzen_ci(
        "plan", "--root", str(repo), "--base=main", "--head", "HEAD", "--same-repo",
        "--comment-file", "MEMBER", str(body), "--json", cwd=repo,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert scheduled(json.loads(proc.stdout)) == {("tests/beta/test_model_gpu.py", "hopper")}
