"""The GPU lane (`mizzen-ci gpu-lane`, pretend GPUs) with a file quarantined on its arch: in
`record` mode (nightly) the file runs, its failure is in the lane's history (what lifts a
quarantine later) and the lane passes; in `skip` mode (pull requests) it is not run and the lane
passes.  (With no mode, a failing file fails the lane: tests/ci/lane/test_runner.py.)"""

from __future__ import annotations

import json

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=20, labels=["ci", "gpu-lane"])

HEAD = "from mizzen_ci import register_cuda_ci\n\nregister_cuda_ci(est_time=5, hardware=['hopper'], num_gpus=1, labels=['gpu-lane'])\n"
FLAKY_LIST = """[[flaky]]
file = "tests/gpu/test_bad.py"
arch = "hopper"
since = 2026-12-01
reason = "flipped 3 times in its last 5 trusted runs (k = 3)"
"""


@pytest.fixture
def repo(tmp_path, repo_root):
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "fleet.toml").write_text((repo_root / "ci" / "fleet.toml").read_text())
    (tmp_path / "ci" / "flaky.toml").write_text(FLAKY_LIST)
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_bad.py").write_text(
        HEAD + "\ndef test_it():\n    assert 1 + 1 == 3\n"
    )
    (tmp_path / "tests" / "gpu" / "test_ok.py").write_text(HEAD + "\ndef test_it():\n    pass\n")
    (tmp_path / "trace").mkdir()
    return tmp_path


def outcomes(root) -> dict[str, str]:
    path = root / ".ci-artifacts" / "history" / "gpu-hopper.jsonl"
    return {(r := json.loads(line))["file"]: r["outcome"] for line in path.read_text().splitlines()}


@pytest.mark.parametrize("mode", ["record", "skip"])
def test_a_quarantined_file_on_the_gpu_lane(repo, lane, mode):
    out = lane(repo, env={"MIZZEN_FLAKY": mode, "MIZZEN_FLAKY_REV": None, "GITHUB_ACTIONS": None})
    assert out.returncode == 0, out.stdout + out.stderr
    if mode == "record":
        assert outcomes(repo) == {
            "tests/gpu/test_bad.py": "failed",
            "tests/gpu/test_ok.py": "passed",
        }
        assert "quarantined as flaky: recorded, not gating" in out.stdout
    else:
        assert outcomes(repo) == {"tests/gpu/test_ok.py": "passed"}
        assert (
            "not run, quarantined as flaky (ci/flaky.toml): tests/gpu/test_bad.py: flipped"
            in out.stdout
        )
