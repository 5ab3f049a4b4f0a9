"""``mizzen-ci gpu-lane`` checks every output path before it creates, runs or prints anything
(issue: hostile output paths): a ``--report-dir`` that is a file, a ``--history`` or
``--flake-record`` that is a folder, a ``$GITHUB_STEP_SUMMARY`` under a file is exit 2 with one
line naming the option and the fix — no traceback, no compile cache or report folder created."""

from __future__ import annotations

from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=5, labels=["ci", "gpu-lane"])

GPU_TEST = (
    "from mizzen_ci import register_cuda_ci\nregister_cuda_ci(est_time=5, hardware=['hopper'])\n"
)


@pytest.fixture
def tree(tmp_path: Path, repo_root: Path) -> Path:
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "fleet.toml").write_text((repo_root / "ci" / "fleet.toml").read_text())
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "t"\nversion = "0"\n')
    (tmp_path / "tests" / "t").mkdir(parents=True)
    (tmp_path / "tests" / "t" / "test_gpu.py").write_text(GPU_TEST + "def test_x():\n    pass\n")
    (tmp_path / "afile").write_text("a file\n")
    (tmp_path / "adir").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("args", "env", "option"),
    [
        (("--report-dir", "afile"), {}, "--report-dir"),
        (("--report-dir", "afile/reports"), {}, "--report-dir"),
        (("--history", "adir"), {}, "--history"),
        (("--flake-record", "adir"), {}, "--flake-record"),
        (("--record-execution", "adir"), {}, "--record-execution"),
        ((), {"GITHUB_STEP_SUMMARY": "afile/summary.md"}, "$GITHUB_STEP_SUMMARY"),
    ],
)
def test_an_output_that_cannot_be_written_refuses_before_anything(tree, lane, args, env, option):
    args = [str(tree / a) if a in ("afile", "adir") or "/" in a else a for a in args]
    done = lane(tree, *args, env=env)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and option in done.stderr and "Fix:" in done.stderr
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tree / "compile-cache").exists() and not (tree / ".ci-artifacts").exists()
    assert (tree / "afile").read_text() == "a file\n" and not any((tree / "adir").iterdir())
