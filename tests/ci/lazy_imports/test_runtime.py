"""The runtime lazy-import check: real subprocesses with a sys.meta_path blocker on fixture trees,
including what the static check cannot see, and a planted ``import sglang`` in a copy of the
workspace that both checks must catch with the chain."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lazy_imports.policy import load_policy
from mizzen_ci.lazy_imports.runtime import check_runtime
from mizzen_ci.lazy_imports.static import check_static

# It imports every module of the real workspace in subprocesses and copies its source trees.
register_cpu_ci(est_time=40, labels=["ci"], watches=["packages/*/src/**/*.py"])

FIXTURE_PACKAGES = [
    "rt_clean",
    "rt_computed",
    "rt_guarded",
    "rt_budget",
    "rt_broken",
    "rt_reexport",
]


@pytest.fixture(scope="module")
def runtime_tree(ci_fixtures: Path) -> Path:
    return ci_fixtures / "lazy_imports" / "runtime"


@pytest.fixture(scope="module")
def site_dir(runtime_tree: Path) -> Path:
    """Stand-ins for third-party libraries: on PYTHONPATH, not a source dir."""
    return runtime_tree / "site"


@pytest.fixture(scope="module")
def fixture_env(site_dir: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site_dir)}


@pytest.fixture(scope="module")
def fixture_report(runtime_tree, fixture_env):
    policy = load_policy(runtime_tree / "pyproject.toml")
    report = check_runtime(
        runtime_tree, [runtime_tree / "src"], FIXTURE_PACKAGES, policy, env=fixture_env, timeout=120
    )
    return {r.package: r for r in report.results}


def titles(result) -> list[str]:
    return [f.title for f in result.findings]


def test_clean_package_with_third_party_probing_and_a_tolerated_load(fixture_report):
    r = fixture_report["rt_clean"]
    assert r.findings == []
    assert sorted(r.imported) == ["rt_clean", "rt_clean.sub"]
    assert r.third_party_refusals == 1  # thirdparty_guarded's try/except import fakegpu
    assert r.tolerated == ["fakegpu (loaded by thirdparty_needs, tolerated by the policy)"]


def test_runtime_catches_a_computed_importlib_name_that_static_cannot_see(
    fixture_report, runtime_tree
):
    policy = load_policy(runtime_tree / "pyproject.toml")
    static = check_static(runtime_tree, [runtime_tree / "src"], ["rt_computed"], policy)
    assert static.ok  # the name is computed: invisible in the syntax tree
    [finding] = fixture_report["rt_computed"].findings
    assert finding.title == (
        "src/rt_computed/__init__.py:6 asked for fakegpu while importing rt_computed: fakegpu is "
        "GPU-only, forbidden at import time in every package (refused by the blocker)"
    )
    assert finding.stack == (
        "src/rt_computed/__init__.py:6  backend = importlib.import_module(_NAME)",
    )
    assert finding.note.startswith("Modules that failed to import because of it: rt_computed.")
    assert (finding.file, finding.line) == ("src/rt_computed/__init__.py", 6)


def test_a_guarded_import_in_our_code_fails_even_though_the_import_survived(fixture_report):
    r = fixture_report["rt_guarded"]
    assert sorted(r.imported) == ["rt_guarded", "rt_guarded.opt"]
    [finding] = r.findings
    assert finding.title.startswith("src/rt_guarded/opt.py:2 asked for fakegpu while importing")
    assert finding.note.startswith("A try/except absorbed the refusal")


def test_budget_violation_reports_the_importing_stack_and_the_casualties(fixture_report):
    [finding] = fixture_report["rt_budget"].findings
    assert finding.title == (
        "src/rt_budget/helper.py:1 asked for fakeheavy while importing rt_budget: fakeheavy is "
        "outside rt_budget's import budget (refused by the blocker)"
    )
    assert finding.stack == (
        "src/rt_budget/client.py:1  from rt_budget import helper",
        "src/rt_budget/helper.py:1  import fakeheavy",
    )
    assert "rt_budget.client, rt_budget.helper" in finding.note


def test_any_import_failure_is_reported_with_its_traceback(fixture_report):
    [finding] = fixture_report["rt_broken"].findings
    assert finding.title == (
        "import of rt_broken.bad failed: ValueError: rt_broken.bad cannot be imported"
    )
    assert finding.stack == (
        'src/rt_broken/bad.py:1  raise ValueError("rt_broken.bad cannot be imported")',
    )
    assert (finding.file, finding.line) == ("src/rt_broken/bad.py", 1)


def test_pulling_a_lazy_reexport_at_module_scope_is_caught_by_both_checks(
    fixture_report, runtime_tree
):
    policy = load_policy(runtime_tree / "pyproject.toml")
    static = check_static(runtime_tree, [runtime_tree / "src"], ["rt_reexport"], policy)
    assert {v.module: v.lines() for v in static.violations} == {
        "rt_reexport.user": [
            "src/rt_reexport/user.py:3 imports kernels from rt_reexport (module scope; a name "
            "rt_reexport does not bind, so its module __getattr__ runs)",
            "src/rt_reexport/__init__.py:6 imports fakegpu (inside module __getattr__, run by the "
            "import above)",
        ]
    }
    [finding] = fixture_report["rt_reexport"].findings
    assert finding.stack == (
        "src/rt_reexport/user.py:3  from rt_reexport import kernels",
        "src/rt_reexport/__init__.py:6  import fakegpu",
    )
    assert "rt_reexport.user" in finding.note and "rt_reexport," not in finding.note


def test_a_cuda_initialisation_attempt_is_caught_on_a_machine_without_gpu(
    runtime_tree, fixture_env
):
    policy = load_policy(runtime_tree / "pyproject.toml")
    env = {**fixture_env, "CUDA_VISIBLE_DEVICES": ""}
    [r] = check_runtime(runtime_tree, [runtime_tree / "src"], ["rt_cuda"], policy, env=env).results
    assert r.torch_imported
    [finding] = r.findings
    assert finding.title.startswith("CUDA initialisation attempted while importing rt_cuda")
    assert finding.stack[0] == "src/rt_cuda/__init__.py:6  torch.cuda.init()"
    assert (finding.file, finding.line) == ("src/rt_cuda/__init__.py", 6)


def test_cli_runtime_exit_code_and_annotations(mizzen_ci, runtime_tree, site_dir):
    out = mizzen_ci(
        "lazy-imports", "--runtime", "--root", str(runtime_tree), "--package", "rt_guarded",
        "--package", "rt_clean",
        env={"PYTHONPATH": f"{mizzen_ci.ci_src}:{site_dir}"}, github=True, site=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "lazy-imports runtime: rt_clean: 2 module(s) imported, clean" in out.stdout
    [annotation] = [ln for ln in out.stdout.splitlines() if ln.startswith("::error")]
    assert annotation.startswith(
        "::error file=src/rt_guarded/opt.py,line=2,title=mizzen lazy-imports (runtime)::"
    )


# ---- the workspace itself


def test_runtime_on_the_repository_light_packages_is_clean(repo_root, ci_src):
    """mizzen_ci (stdlib only) and mizzen_rollout (no torch/ray/harbor/transformers) import
    cleanly under their budgets; the heavy packages run in `nox -s lazy-imports`."""
    report = check_runtime(
        repo_root,
        [ci_src, repo_root / "packages" / "rollout" / "src"],
        ["mizzen_ci", "mizzen_rollout"],
        load_policy(repo_root / "pyproject.toml"),
        timeout=120,
    )
    assert report.ok, "\n".join(line for f in report.findings for line in f.lines())
    assert {r.package: r.torch_imported for r in report.results} == {
        "mizzen_ci": False,
        "mizzen_rollout": False,
    }


@pytest.fixture
def planted_workspace(tmp_path, repo_root) -> tuple[Path, int]:
    """A copy of the workspace sources with `import sglang` appended to mizzen_rollout's
    __init__; returns (root, line of the planted import)."""
    shutil.copy(repo_root / "pyproject.toml", tmp_path / "pyproject.toml")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "tests", "*.egg-info")
    for member in ("ci", "packages/train", "packages/rollout", "packages/plugins"):
        shutil.copytree(repo_root / member, tmp_path / member, ignore=ignore)
    init = tmp_path / "packages/rollout/src/mizzen_rollout/__init__.py"
    text = init.read_text()
    text = text if text.endswith("\n") else text + "\n"
    init.write_text(text + "import sglang\n")
    return tmp_path, len(text.splitlines()) + 1


def test_a_planted_sglang_import_fails_both_checks_with_the_chain(planted_workspace, mizzen_ci):
    root, line = planted_workspace
    env = {"PYTHONPATH": str(root / "ci" / "src")}  # the copy's mizzen_ci, not this checkout's
    hop = f"packages/rollout/src/mizzen_rollout/__init__.py:{line} imports sglang (module scope)"
    static = mizzen_ci("lazy-imports", "--static", "--root", str(root), env=env, timeout=120)
    assert static.returncode == 1
    assert f"  {hop}" in static.stderr.splitlines()
    assert " loads sglang at import time: sglang is GPU-only" in static.stderr
    runtime = mizzen_ci(
        "lazy-imports", "--runtime", "--root", str(root), "--package", "mizzen_rollout",
        env=env, site=True, timeout=120,
    )  # fmt: skip
    assert runtime.returncode == 1
    assert (
        f"packages/rollout/src/mizzen_rollout/__init__.py:{line} asked for sglang while importing "
        "mizzen_rollout: sglang is GPU-only" in runtime.stderr
    )
    assert f"    packages/rollout/src/mizzen_rollout/__init__.py:{line}  import sglang" in (
        runtime.stderr.splitlines()
    )
