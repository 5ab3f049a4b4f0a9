"""The lazy-import policy's GPU-only list covers the ROCm-only libraries: a module-scope import of
one, directly or through a chain, is reported on a CPU image; inside a function it is lazy."""

from __future__ import annotations

from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lazy_imports.policy import load_policy
from mizzen_ci.lazy_imports.static import check_static

register_cpu_ci(est_time=5, labels=["ci"])

ROCM_ONLY = ("aiter", "hip", "amdsmi")


def test_the_repository_policy_lists_the_rocm_only_libraries(repo_root):
    policy = load_policy(repo_root / "pyproject.toml")
    for module in ROCM_ONLY:
        assert module in policy.gpu_only, module
        rule = policy.budget("mizzen_train").violated_by(f"{module}.ops")
        assert rule is not None and rule.origin == "gpu-only", module
    assert policy.budget("mizzen_train").violated_by("hipster") is None  # dotted components


@pytest.mark.parametrize("module", ROCM_ONLY)
def test_a_module_scope_rocm_import_is_caught_with_its_chain(tmp_path: Path, repo_root, module):
    src = tmp_path / "src" / "kern"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("from . import attention\n")
    (src / "attention.py").write_text(f"import os\nfrom {module} import ops\n")
    lazy = tmp_path / "src" / "lazykern"
    lazy.mkdir()
    (lazy / "__init__.py").write_text("")
    (lazy / "run.py").write_text(f"def run():\n    import {module}\n    return {module}\n")
    report = check_static(
        tmp_path,
        [tmp_path / "src"],
        ["kern", "lazykern"],
        load_policy(repo_root / "pyproject.toml"),
    )
    got = {v.module: v.lines() for v in report.violations}
    assert got == {
        "kern": [
            "src/kern/__init__.py:1 imports kern.attention (module scope)",
            f"src/kern/attention.py:2 imports {module} (module scope)",
        ],
        "kern.attention": [f"src/kern/attention.py:2 imports {module} (module scope)"],
    }  # lazykern.run imports it inside a function: lazy, allowed
    assert report.packages["lazykern"] == ["lazykern", "lazykern.run"]
